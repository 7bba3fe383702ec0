"""FLUX.3 [klein] (base and the step-distilled flow map) as one record: its checkpoints, requests, runtime facts."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import InvalidRequest
from paradit.families.flux2.latents import pixel_granularity
from paradit.families.flux3.model import Flux3Config, Flux3Transformer
from paradit.families.flux3.presets import DEFAULTS, FLUX3_SCHEDULER, text_encoder_spec
from paradit.family import Family, Measured, imported
from paradit.parallel.tensor_plan import COLUMN, ROW, ROW_MLP, Shard, TensorPlan
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

REFERENCE_LIMIT = 10  # reference images a request may give: diffusers' FLUX.3 prompt upsampler's stated maximum
GATE_UP = Shard("column", ("MLP hidden", "MLP hidden"))  # the MLPs' input projection: [gate, up]
# diffusers hands the scheduler its own sigmas, which DPMSolverMultistepScheduler takes none of
SCHEDULERS = ("flow-euler", "unipc")


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    """The modular pipeline's class says which model: the flow map (Flux3DistilledModularPipeline) or the base."""
    transformer = component_config(folder, "transformer")
    distilled = index["_class_name"] == "Flux3DistilledModularPipeline" or transformer.get("flow_map", False)
    defaults = DEFAULTS["flux3-klein" if distilled else "flux3-klein-base"]
    encoder = text_encoder_spec(component_config(folder, "text_encoder"), index.get("text_encoder", [None, None])[1])
    return checkpoint_spec(
        folder,
        index,
        "flux3",
        "flow map, step-distilled" if distilled else "true CFG",
        transformer=transformer,
        text_encoder=encoder,
        # No scheduler folder: diffusers' modular pipeline makes its scheduler from this config.
        scheduler=FLUX3_SCHEDULER,
        **{key: defaults[key] for key in ("guidance_mode", "steps", "guidance", "height", "width")},
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    if spec.guidance_mode == "none" and request.guidance is not None:
        # diffusers' distilled pipeline has no guider: a scale is ignored, as there.
        logger.warning("guidance %s is ignored: %s is step-distilled", request.guidance, spec.name)
        request = dataclasses.replace(request, guidance=None)
    if request.negative_prompt is not None and spec.guidance_mode != "cfg":
        raise InvalidRequest(f"{spec.name} does not use classifier-free guidance, so it takes no negative prompt")
    granularity = pixel_granularity(spec.vae)
    resolved = resolve_common(spec, request, granularity, image_limit=REFERENCE_LIMIT, schedulers=SCHEDULERS)
    if not resolved.images:
        return resolved
    # The pipeline's preprocessing (diffusers' processor), imported for requests with references alone.
    from paradit.families.flux3.pipeline import prepare_reference

    # diffusers' own sizing (its processor: one reference padded to the token grid, several each cropped to it).
    prepared = [prepare_reference(spec.vae, image, len(resolved.images)) for image in resolved.images]
    first, crop = prepared[0]
    # Without a size diffusers makes the first reference's (a single one's canvas, cropped back after decoding).
    resolved.height = resolved.height if request.height is not None else first.shape[-2]
    resolved.width = resolved.width if request.width is not None else first.shape[-1]
    if request.height is None and request.width is None:
        resolved.output_crop = crop
    resolved.reference_tokens = sum(pixels.shape[-2] * pixels.shape[-1] for pixels, _ in prepared) // granularity**2
    return resolved


def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
    """diffusers' ClassifierFreeGuidance: two branches whenever the scale is above 1."""
    return spec.guidance_mode == "cfg" and request.guidance is not None and request.guidance > 1.0


FAMILY = Family(
    name="flux3",
    pipeline=imported("paradit.families.flux3.pipeline", "Flux3Pipeline"),
    diffusers_pipelines=("Flux3ModularPipeline", "Flux3DistilledModularPipeline"),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    uses_cfg=uses_cfg,
    build_transformer=lambda spec: Flux3Transformer(Flux3Config.from_dict(spec.transformer)),
    prompt_encoder=imported("paradit.families.flux3.pipeline", "Qwen3VLPromptEncoder"),
    vae="AutoencoderKLFlux2",
    tensor_plan=TensorPlan(
        family="FLUX.3",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {
            "attention": model.config.inner_dim,
            "MLP hidden": model.single_transformer_blocks[0].ff.linear_out.in_features,
        },
        linears={
            # Every block, per-mode or joint, is one attention and one MLP side by side.
            "*.attn.to_[qkv]": COLUMN,
            "*.attn.to_out.0": ROW,
            "*.ff.linear_in": GATE_UP,
            "*.ff.linear_out": ROW_MLP,
        },
        local_attributes={"*.attn": ("heads",)},
    ),
    # The embedders, timestep MLPs, per-mode modulations and output layers: few FLOPs, feeding every block.
    keep_high_precision=("embedder", "modulations", "norm_out", "proj_out"),
    lora_loader="Flux3LoraLoaderMixin",
    measured=Measured.read(Path(__file__).parent),
)
