"""Stable Diffusion 3 / 3.5 as one record: checkpoints, requests, runtime facts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import CheckpointError
from paradit.families.sd3.latents import pixel_granularity, vae_scale_factor
from paradit.families.sd3.model import SD3Config, SD3Transformer
from paradit.families.sd3.presets import PRESETS, SD3TextEncoders
from paradit.family import Family, Measured, imported
from paradit.parallel.tensor_plan import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan, joint_attention
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    pass


def published_defaults(transformer: dict) -> tuple[int, float]:
    """A published SD3.5 transformer's model-card steps and guidance (a preset's hub id resolves to a folder)."""
    for preset in PRESETS:
        if preset.hub_id and all(transformer.get(key) == value for key, value in preset.transformer.items()):
            return preset.steps, preset.guidance
    return 28, 7.0  # diffusers' StableDiffusion3Pipeline.__call__ defaults, for any other checkpoint


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    transformer, scheduler = component_config(folder, "transformer"), component_config(folder, "scheduler")
    if scheduler.get("use_dynamic_shifting"):
        raise CheckpointError(
            f"{folder}: a scheduler with use_dynamic_shifting is not supported; SD3.5 uses a fixed shift"
        )
    vae = component_config(folder, "vae")
    steps, guidance = published_defaults(transformer)
    size = transformer.get("sample_size", 128) * vae_scale_factor(vae)
    return checkpoint_spec(
        folder,
        index,
        "sd3",
        transformer=transformer,
        text_encoder=SD3TextEncoders(*(component_config(folder, f"text_encoder{n}") for n in ("", "_2", "_3"))),
        vae=vae,
        scheduler=scheduler,
        guidance_mode="cfg",
        steps=steps,
        guidance=guidance,
        height=size,
        width=size,
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    granularity = pixel_granularity(spec)
    largest = spec.transformer["pos_embed_max_size"] * granularity
    return resolve_common(
        spec,
        request,
        granularity,
        largest=(largest, largest),
        default_negative="",
        image_limit=1,
        image_to_image=True,
        inpainting_strength=0.6,
    )


FAMILY = Family(
    name="sd3",
    pipeline=imported("paradit.families.sd3.pipeline", "SD3Pipeline"),
    diffusers_pipelines=("StableDiffusion3Pipeline",),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    uses_cfg=lambda spec, request: request.guidance > 1.0,
    build_transformer=lambda spec: SD3Transformer(SD3Config.from_dict(spec.transformer)),
    prompt_encoder=imported("paradit.families.sd3.pipeline", "SD3PromptEncoder"),
    vae="AutoencoderKL",
    tensor_plan=TensorPlan(
        family="SD3.5",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {
            "attention": model.transformer_blocks[0].attn.to_q.out_features,
            "MLP hidden": model.transformer_blocks[0].ff.net[2].in_features,
        },
        linears={
            # The last block has no to_add_out (its text output is never read): the pattern matches the others.
            **joint_attention("transformer_blocks.*.attn"),
            # SD3.5-medium's image-only attention (attn2) in its first blocks.
            "transformer_blocks.*.attn2.to_[qkv]": COLUMN,
            "transformer_blocks.*.attn2.to_out.0": ROW,
            "transformer_blocks.*.ff*.net.0.proj": COLUMN_MLP,  # ff and ff_context
            "transformer_blocks.*.ff*.net.2": ROW_MLP,
        },
    ),
    # The embedders, the AdaLN modulation (under "norm" names: norm1.linear, norm1_context.linear, norm_out), proj_out.
    keep_high_precision=("embed", "norm", "proj_out"),
    lora_loader="SD3LoraLoaderMixin",
    after_dummy_init=lambda transformer: transformer.pos_embed.fill_position_table(),  # a fixed sin-cos buffer
    measured=Measured.read(Path(__file__).parent),
)
