"""Z-Image (Turbo, base, Omni) as one record: its checkpoints, requests, runtime facts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import InvalidRequest
from paradit.families.zimage.latents import pixel_granularity
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer
from paradit.families.zimage.presets import TURBO_SCHEDULER, OmniEncoders, text_encoder_spec
from paradit.family import Family, Measured
from paradit.parallel.tensor_plan import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    from paradit.pipelines.base import DiffusionPipeline
    from paradit.text_encoder import PromptEncoder

# diffusers' ZImagePipeline defaults; a checkpoint scheduled like the published Turbo gets Turbo's instead.
PIPELINE_DEFAULTS = {"guidance_mode": "cfg", "steps": 50, "guidance": 5.0, "height": 1024, "width": 1024}
TURBO_DEFAULTS = {**PIPELINE_DEFAULTS, "steps": 8, "guidance": 0.0}
OMNI_IMAGE_LIMIT = 10  # diffusers sets none; ten images at 1024x1024 already add 40k latent tokens
LARGEST_IMAGE = 1024 * 1024  # pixels diffusers shrinks a larger condition image to (or to the output's, if given)


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    encoder, scheduler = component_config(folder, "text_encoder"), component_config(folder, "scheduler")
    # The model_index of Turbo and of the base model are identical; their schedulers are not (shift 3.0 vs 6.0).
    turbo = all(scheduler.get(key) == value for key, value in TURBO_SCHEDULER.items())
    text_encoder = text_encoder_spec(encoder, index.get("text_encoder", [None, None])[1])
    if index["_class_name"] == "ZImageOmniPipeline":
        text_encoder = OmniEncoders(text_encoder, component_config(folder, "siglip"))
    return checkpoint_spec(
        folder,
        index,
        "zimage",
        "Turbo, step-distilled" if turbo else "true CFG",
        scheduler=scheduler,
        text_encoder=text_encoder,
        **(TURBO_DEFAULTS if turbo else PIPELINE_DEFAULTS),
    )


def is_omni(spec: ModelSpec) -> bool:
    return isinstance(spec.text_encoder, OmniEncoders)


# diffusers hands the scheduler its own sigmas as a list: DPMSolverMultistep takes none, UniPCMultistep fails on it
SCHEDULERS = ("flow-euler",)


def resolve_omni_images(
    request: ResolvedRequest, height: int | None, width: int | None, largest: tuple[int, int], granularity: int
) -> None:
    """Omni's condition images as diffusers takes them, and by default the last one's size floored to whole tokens.
    ``largest``: the latent rows and columns the rotary tables reach (SigLIP's positions span them)."""
    if not request.images:
        return
    # diffusers' image checks and resize, imported for requests with images: text-only ones resolve without it.
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    images = []
    for index, image in enumerate(request.images):
        try:
            Flux2ImageProcessor.check_image_input(image)
        except ValueError as exc:
            raise InvalidRequest(f"image {index + 1}: {exc}", param="image") from None
        if image.width * image.height > LARGEST_IMAGE:
            area = height * width if height and width else LARGEST_IMAGE
            image = Flux2ImageProcessor._resize_to_target_area(image, area)
        rows, cols = largest
        if image.height // granularity * 2 > rows or image.width // granularity * 2 > cols:
            most = f"{cols * granularity // 2}x{rows * granularity // 2}"
            raise InvalidRequest(
                f"image {index + 1} makes {image.width}x{image.height} pixels; this model takes at most {most}",
                param="image",
            )
        images.append(image)
    request.images = tuple(images)
    request.height = height or images[-1].height // granularity * granularity
    request.width = width or images[-1].width // granularity * granularity
    request.reference_tokens = sum((i.height // granularity) * (i.width // granularity) for i in images)


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    g, omni = pixel_granularity(spec.vae), is_omni(spec)
    # Rotary positions are looked up in tables of axes_lens rows; a latent grid past them has no position.
    _, max_rows, max_cols = spec.transformer["axes_lens"]
    resolved = resolve_common(
        spec,
        request,
        g,
        largest=(max_rows * g, max_cols * g),
        image_limit=OMNI_IMAGE_LIMIT if omni else 1,
        image_to_image=not omni,  # Omni's images condition; diffusers has no Omni image-to-image or inpainting
        inpainting_strength=None if omni else 1.0,
        schedulers=SCHEDULERS,
    )
    if omni:
        resolve_omni_images(resolved, request.height, request.width, (max_rows, max_cols), g)
    elif resolved.images and (request.height is None or request.width is None):
        image = resolved.images[0]
        height, width = request.height or image.height // g * g, request.width or image.width // g * g
        if not (g <= height <= max_rows * g and g <= width <= max_cols * g):
            raise InvalidRequest(
                f"the image's {image.width}x{image.height} makes {width}x{height}, outside this "
                f"model's {g} to {max_cols * g}x{max_rows * g}; give --width and --height",
                param="size",
            )
        resolved.height, resolved.width = height, width
    return resolved


# The pipeline's module imports diffusers and transformers: the record's classes are imported when a run builds them.
def pipeline(spec: ModelSpec) -> type[DiffusionPipeline]:
    from paradit.families.zimage.omni import ZImageOmniPipeline
    from paradit.families.zimage.pipeline import ZImagePipeline

    return ZImageOmniPipeline if is_omni(spec) else ZImagePipeline


def prompt_encoder(spec: ModelSpec) -> type[PromptEncoder]:
    from paradit.families.zimage.omni import OmniPromptEncoder
    from paradit.families.zimage.pipeline import CaptionEncoder

    return OmniPromptEncoder if is_omni(spec) else CaptionEncoder


FAMILY = Family(
    name="zimage",
    pipeline=pipeline,
    diffusers_pipelines=("ZImagePipeline", "ZImageOmniPipeline"),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    # The reference guides whenever the scale is above 0, the step-distilled Turbo too (its default 0 turns it off).
    uses_cfg=lambda spec, request: request.guidance > 0,
    build_transformer=lambda spec: ZImageTransformer(ZImageConfig.from_dict(spec.transformer)),
    prompt_encoder=prompt_encoder,
    vae="AutoencoderKL",
    tensor_plan=TensorPlan(
        family="Z-Image",
        heads=lambda model: model.config.n_heads,
        widths=lambda model: {
            "attention": model.layers[0].attention.to_q.out_features,
            "MLP hidden": model.layers[0].feed_forward.w2.in_features,
        },
        linears={
            # The noise refiner, the context refiner and the joint layers share one block layout.
            "*.attention.to_[qkv]": COLUMN,
            "*.attention.to_out.0": ROW,
            "*.feed_forward.w[13]": COLUMN_MLP,  # w1 the gate, w3 the up projection
            "*.feed_forward.w2": ROW_MLP,
        },
    ),
    keep_high_precision=("embedder", "adaLN", "final_layer"),
    lora_loader="ZImageLoraLoaderMixin",
    measured=Measured.read(Path(__file__).parent),
)
