"""FLUX.2 (dev, klein and klein KV) as one record: its checkpoints, requests, runtime facts."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import InvalidRequest
from paradit.families.flux2.latents import pixel_granularity, reference_size
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.families.flux2.presets import DEV_LAYERS, KLEIN_LAYERS, Flux2Details, caches_references
from paradit.family import Family, Measured, SettledRun, imported
from paradit.parallel.tensor_plan import ROW_MLP, Shard, TensorPlan, joint_attention
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, TextEncoderSpec, checkpoint_spec

if TYPE_CHECKING:
    from paradit.text_encoder import PromptEncoder

logger = logging.getLogger(__name__)

REFERENCE_LIMIT = 10  # reference images a request may give: Black Forest Labs' stated maximum for FLUX.2
REFERENCE_AREA = 1024 * 1024  # pixels diffusers shrinks a larger reference to
KLEIN_INPAINTING_STRENGTH = 0.8  # Flux2KleinInpaintPipeline's default
GATE_UP = Shard("column", ("MLP hidden", "MLP hidden"))  # the MLPs' input projection: [gate, up]


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    """klein KV runs as distilled klein whatever its index says: its pipeline never guides."""
    name = index["_class_name"]
    if name == "Flux2Pipeline":
        mode, steps, guidance = "embedded", 50, 4.0
    elif name == "Flux2KleinKVPipeline" or index.get("is_distilled", False):
        mode, steps, guidance = "none", 4, None
    else:
        mode, steps, guidance = "cfg", 50, 4.0
    layers = DEV_LAYERS if name == "Flux2Pipeline" else KLEIN_LAYERS
    # The encoder's own config too: memory estimates (and random weights) build it without reading its weights.
    encoder_config = component_config(folder, "text_encoder")
    encoder = TextEncoderSpec(encoder_config, layers=layers, class_name=index.get("text_encoder", [None, None])[1])
    return checkpoint_spec(
        folder,
        index,
        "flux2",
        text_encoder=encoder,
        guidance_mode=mode,
        steps=steps,
        guidance=guidance,
        height=1024,
        width=1024,
        details=Flux2Details(cached_references=True) if name == "Flux2KleinKVPipeline" else None,
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    if spec.guidance_mode == "none" and request.guidance is not None:
        # diffusers' Flux2KleinPipeline takes the scale and ignores it for a step-distilled checkpoint: so do we.
        logger.warning("guidance %s is ignored: %s is step-distilled", request.guidance, spec.name)
        request = dataclasses.replace(request, guidance=None)
    if request.negative_prompt is not None and spec.guidance_mode != "cfg":
        raise InvalidRequest(f"{spec.name} does not use classifier-free guidance, so it takes no negative prompt")
    granularity = pixel_granularity(spec.vae)
    # klein inpaints (Flux2KleinInpaintPipeline: the image to repaint, then at most one reference); dev and KV do not.
    inpaints = spec.guidance_mode != "embedded" and not caches_references(spec)
    inpainting = request.mask is not None and inpaints
    resolved = resolve_common(
        spec,
        request,
        granularity,
        image_limit=2 if inpainting else REFERENCE_LIMIT,
        image_to_image=inpainting,
        inpainting_strength=KLEIN_INPAINTING_STRENGTH if inpaints else None,
    )
    resolved.images = tuple(
        resolve_reference(image, index, checked=not inpainting) for index, image in enumerate(resolved.images)
    )
    if resolved.images:  # diffusers makes the first image's size when none is asked for
        sizes = [reference_size(image, granularity) for image in resolved.images]
        resolved.height = resolved.height if request.height is not None else sizes[0][0]
        resolved.width = resolved.width if request.width is not None else sizes[0][1]
        if inpainting:  # the image to repaint joins as a reference too, at the output's size
            sizes[0] = (resolved.height, resolved.width)
        resolved.reference_tokens = sum(math.prod(size) // granularity**2 for size in sizes)
    return resolved


def resolve_reference(image, index: int, checked: bool = True):
    # diffusers' image checks and resize, imported for requests with images: text-only ones resolve without it.
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    try:
        if checked:
            Flux2ImageProcessor.check_image_input(image)
    except ValueError as exc:
        raise InvalidRequest(f"image {index + 1}: {exc}", param="image") from None
    if image.width * image.height > REFERENCE_AREA:
        image = Flux2ImageProcessor._resize_to_target_area(image, REFERENCE_AREA)
    return image


# The pipeline's module imports diffusers and transformers: the record's classes are imported when a run builds them.
def prompt_encoder(spec: ModelSpec) -> type[PromptEncoder]:
    from paradit.families.flux2.pipeline import MistralPromptEncoder
    from paradit.text_encoder import DecoderPromptEncoder

    return (
        MistralPromptEncoder
        if spec.text_encoder.config.get("model_type", "").startswith("mistral")
        else DecoderPromptEncoder
    )


def check_run(settings: SettledRun, request: ResolvedRequest) -> None:
    """KV's cached references, whole on each rank and made outside the forward, fit no split plan and no CUDA graph."""
    if not request.images or not caches_references(settings.spec):
        return
    parallel = settings.parallel
    asked = {
        "--ulysses": parallel.ulysses > 1,
        "--ring": parallel.ring > 1,
        "--pipefusion": parallel.pipefusion > 1,
        "--shard-weights": bool(parallel.shard_weights),
        "--cuda-graphs": settings.options.cuda_graphs,
    }
    flags = " and ".join(flag for flag, used in asked.items() if used)
    if flags:
        raise InvalidRequest(
            f"{settings.spec.name} caches its reference images' keys and values, which {flags} "
            f"cannot take yet; drop {flags} (one GPU and --tensor take references) or the images",
            param="image",
        )


FAMILY = Family(
    name="flux2",
    pipeline=imported("paradit.families.flux2.pipeline", "Flux2Pipeline"),
    diffusers_pipelines=("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline"),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    check_run=check_run,
    uses_cfg=lambda spec, request: (
        spec.guidance_mode == "cfg" and request.guidance is not None and request.guidance > 1.0
    ),
    build_transformer=lambda spec: Flux2Transformer(Flux2Config.from_dict(spec.transformer)),
    prompt_encoder=prompt_encoder,
    vae="AutoencoderKLFlux2",
    tensor_plan=TensorPlan(
        family="FLUX.2",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {
            "attention": model.single_transformer_blocks[0].attn.inner_dim,
            "MLP hidden": model.single_transformer_blocks[0].attn.mlp_hidden_dim,
        },
        linears={
            **joint_attention("transformer_blocks.*.attn"),
            **{f"transformer_blocks.*.{ff}.linear_in": GATE_UP for ff in ("ff", "ff_context")},
            **{f"transformer_blocks.*.{ff}.linear_out": ROW_MLP for ff in ("ff", "ff_context")},
            # The single blocks pack [q, k, v, MLP gate, MLP up] into one projection and read [attention, MLP] back.
            "single_transformer_blocks.*.attn.to_qkv_mlp_proj": Shard(
                "column", ("attention", "attention", "attention", "MLP hidden", "MLP hidden")
            ),
            "single_transformer_blocks.*.attn.to_out": Shard("row", ("attention", "MLP hidden")),
        },
        local_attributes={
            "transformer_blocks.*.attn": ("heads",),
            "single_transformer_blocks.*.attn": ("heads", "inner_dim", "mlp_hidden_dim"),
        },
    ),
    # The embedders, timestep and guidance MLPs, shared modulations and output layers: few FLOPs, feeding every block.
    keep_high_precision=("embed", "modulation", "norm_out", "proj_out"),
    lora_loader="Flux2LoraLoaderMixin",
    measured=Measured.read(Path(__file__).parent),
)
