"""Wan 2.2 (T2V-A14B, I2V-A14B, TI2V-5B) as one record: its checkpoints, its requests, its runtime facts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import CheckpointError, InvalidRequest
from paradit.families.wan.latents import image_input, vae_factors
from paradit.families.wan.model import WanConfig, WanTransformer
from paradit.families.wan.presets import WanDetails, WanTextEncoder
from paradit.family import Family, Measured, imported
from paradit.parallel.tensor_plan import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan
from paradit.pipelines.requests import check_guidance, not_allowed, resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    pass

# diffusers' WanPipeline.__call__ defaults, for a checkpoint folder.
PIPELINE_DEFAULTS = {"steps": 50, "guidance": 5.0, "height": 480, "width": 832, "frames": 81, "fps": 16}
MAX_FRAMES, MAX_FPS = 1024, 240


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    present = {
        name: isinstance(index.get(name), list) and index[name][0] is not None
        for name in ("transformer", "transformer_2", "image_encoder")
    }
    if not present["transformer"]:
        raise CheckpointError(f"{folder} has no transformer/ (a low-noise expert alone is not served)")
    if present["image_encoder"]:
        raise CheckpointError(
            f"{folder} is a Wan 2.1 image-to-video checkpoint (a CLIP image encoder), which paradit does not run; its "
            "Wan 2.2 checkpoints (I2V-A14B, TI2V-5B) encode the image with the VAE alone and do run"
        )
    boundary = index.get("boundary_ratio")
    two_experts = present["transformer_2"] and boundary is not None
    experts = {"transformer_2": component_config(folder, "transformer_2")} if two_experts else {}
    per_token = bool(index.get("expand_timesteps"))
    layout = ("two experts" if experts else "one transformer") + (", per-token timesteps" if per_token else "")
    return checkpoint_spec(
        folder,
        index,
        "wan",
        layout,
        text_encoder=WanTextEncoder(component_config(folder, "text_encoder")),
        guidance_mode="cfg",
        **PIPELINE_DEFAULTS,
        experts=experts,
        details=WanDetails(boundary if experts else None, per_token),
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    temporal, spatial = vae_factors(spec.vae)
    mode = image_input(spec)
    if mode is None and request.image is not None:
        raise InvalidRequest(
            f"{spec.name} is text-to-video and takes no image; the image-to-video models are "
            "wan2.2-i2v-a14b and wan2.2-ti2v-5b"
        )
    resolved = resolve_common(spec, request, spatial * spec.transformer["patch_size"][1], image_limit=1)
    if mode == "channels" and not resolved.images:
        raise InvalidRequest(f"{spec.name} animates an image; give the first frame (--image PATH)")
    frames = spec.frames if request.frames is None else int(request.frames)
    if frames < 1 or frames % temporal != 1 % temporal or frames > MAX_FRAMES:
        takes = f"this model takes {temporal}k+1 frames (1, {temporal + 1}, {2 * temporal + 1}, ...) up to {MAX_FRAMES}"
        raise not_allowed("frames", frames, takes)
    guidance_2 = request.guidance_2
    if guidance_2 is not None and not spec.experts:
        raise InvalidRequest("guidance_2 is for models with a low-noise expert; this one has one transformer")
    if spec.experts and guidance_2 is None:
        # diffusers' rule: the low-noise scale is the high-noise one unless given; a preset's own default otherwise.
        guidance_2 = spec.guidance_2 if request.guidance is None and spec.guidance_2 is not None else resolved.guidance
    check_guidance("guidance_2", guidance_2)
    resolved.frames, resolved.guidance_2 = frames, guidance_2
    resolved.fps = spec.fps if request.fps is None else request.fps
    if not isinstance(resolved.fps, int) or not 1 <= resolved.fps <= MAX_FPS:
        raise not_allowed("fps", resolved.fps, f"give a whole number from 1 to {MAX_FPS}")
    return resolved


def sequence_tokens(spec: ModelSpec) -> int:
    """The video's patches at ``spec``'s size and frames (the text is cross-attended apart)."""
    temporal, spatial = vae_factors(spec.vae)
    patch = spec.transformer["patch_size"]
    frames = (spec.frames - 1) // temporal + 1
    return frames // patch[0] * (spec.height // spatial // patch[1]) * (spec.width // spatial // patch[2])


FAMILY = Family(
    name="wan",
    pipeline=imported("paradit.families.wan.pipeline", "WanPipeline"),
    diffusers_pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    # diffusers guides when the (high-noise) scale is above 1; the low-noise scale then applies even if it is 1.
    uses_cfg=lambda spec, request: request.guidance > 1,
    build_transformer=lambda spec: WanTransformer(WanConfig.from_dict(spec.transformer)),
    prompt_encoder=imported("paradit.families.wan.pipeline", "UMT5PromptEncoder"),
    vae="AutoencoderKLWan",
    # The QK norms span all heads: sharded, they sum their squares over the tensor group, which keeps them exact.
    tensor_plan=TensorPlan(
        family="Wan",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {"attention": model.config.inner_dim, "MLP hidden": model.config.ffn_dim},
        linears={
            "blocks.*.attn[12].to_[qkv]": COLUMN,
            "blocks.*.attn[12].to_out.0": ROW,
            "blocks.*.ffn.net.0.proj": COLUMN_MLP,
            "blocks.*.ffn.net.2": ROW_MLP,
        },
        norms_across_heads=("blocks.*.attn[12].norm_[qk]",),
    ),
    # The embedders, every ``scale_shift_table`` (parameters, named for completeness) and the output projection.
    keep_high_precision=("patch_embedding", "condition_embedder", "scale_shift_table", "proj_out"),
    lora_loader="WanLoraLoaderMixin",
    video=True,
    sequence_tokens=sequence_tokens,
    measured=Measured.read(Path(__file__).parent),
)
