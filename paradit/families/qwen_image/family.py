"""Qwen-Image as one record: its checkpoints, its requests, its runtime facts."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import InvalidRequest
from paradit.families.qwen_image.edit import EDIT_PIPELINES, EditInputs
from paradit.families.qwen_image.latents import pixel_granularity
from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer
from paradit.family import Family, Measured, imported
from paradit.parallel.tensor_plan import COLUMN_MLP, ROW_MLP, TensorPlan, joint_attention
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    from paradit.text_encoder import PromptEncoder

logger = logging.getLogger(__name__)

EDIT_PLUS_IMAGE_LIMIT = 10  # diffusers sets none; what one request's tokens can reasonably hold
# diffusers' QwenImagePipeline.__call__ defaults, for a checkpoint folder.
PIPELINE_DEFAULTS = {"guidance_mode": "cfg", "steps": 50, "guidance": 4.0, "height": 1024, "width": 1024}


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    transformer = component_config(folder, "transformer")
    QwenImageConfig.from_dict(transformer)  # refuses the variants this pipeline does not serve, before loading
    return checkpoint_spec(
        folder,
        index,
        "qwen_image",
        transformer=transformer,
        text_encoder=component_config(folder, "text_encoder"),
        **PIPELINE_DEFAULTS,
        details=EDIT_PIPELINES.get(index["_class_name"]),
    )


# diffusers' pipelines hand the scheduler their own sigmas, which DPMSolverMultistepScheduler takes none of
SCHEDULERS = ("flow-euler", "unipc")


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """A text-to-image checkpoint given an image runs image-to-image or inpainting; an edit one needs its image(s)."""
    granularity = pixel_granularity(spec.vae)
    edit: EditInputs | None = spec.details
    plus = edit is not None and edit.plus
    limit = EDIT_PLUS_IMAGE_LIMIT if plus else 1
    # Edit inpaints (QwenImageEditInpaintPipeline: its one image, noised where the mask is white); Edit-Plus does not.
    inpainting = request.mask is not None and not plus
    resolved = resolve_common(
        spec,
        request,
        granularity,
        image_limit=limit,
        image_to_image=edit is None or inpainting,
        inpainting_strength=None if plus else 0.6,
        schedulers=SCHEDULERS,
    )
    if edit is None:
        return resolved
    if not resolved.images:
        raise InvalidRequest(f"{spec.name} edits: give the image{'(s)' * (limit > 1)} to edit (--image)", param="image")
    # Without a size, Edit makes its image's input size and Edit-Plus its last image's, floored to whole tokens.
    height, width = (side // granularity * granularity for side in edit.input_size(resolved.images[-1]))
    if inpainting and (request.height, request.width) not in ((None, None), (height, width)):
        # Its image is the target too: the two token grids must match.
        logger.warning(
            "%s inpaints at its image's %dx%d, ignoring the size asked as diffusers does", spec.name, width, height
        )
        resolved.height, resolved.width = height, width
    resolved.height = resolved.height if request.height is not None else height
    resolved.width = resolved.width if request.width is not None else width
    resolved.reference_tokens = sum(math.prod(edit.input_size(image)) // granularity**2 for image in resolved.images)
    return resolved


# The pipeline's module imports diffusers and transformers: the record's classes are imported when a run builds them.
def prompt_encoder(spec: ModelSpec) -> type[PromptEncoder]:
    from paradit.families.qwen_image.pipeline import QwenPromptEncoder, QwenVisionPromptEncoder

    return QwenPromptEncoder if spec.details is None else QwenVisionPromptEncoder


def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
    """diffusers' rule for ``true_cfg_scale``: a negative prompt (even " ", as Qwen-Image's authors give) and > 1."""
    return request.negative_prompts is not None and request.guidance > 1.0


FAMILY = Family(
    name="qwen_image",
    pipeline=imported("paradit.families.qwen_image.pipeline", "QwenImagePipeline"),
    diffusers_pipelines=("QwenImagePipeline", *EDIT_PIPELINES),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    uses_cfg=uses_cfg,
    build_transformer=lambda spec: QwenImageTransformer(QwenImageConfig.from_dict(spec.transformer)),
    prompt_encoder=prompt_encoder,
    vae="AutoencoderKLQwenImage",
    tensor_plan=TensorPlan(
        family="Qwen-Image",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {
            "attention": model.transformer_blocks[0].attn.to_q.out_features,
            "MLP hidden": model.transformer_blocks[0].img_mlp.net[2].in_features,
        },
        linears={
            **joint_attention("transformer_blocks.*.attn"),
            **{f"transformer_blocks.*.{mlp}.net.0.proj": COLUMN_MLP for mlp in ("img_mlp", "txt_mlp")},
            **{f"transformer_blocks.*.{mlp}.net.2": ROW_MLP for mlp in ("img_mlp", "txt_mlp")},
        },
        local_attributes={"transformer_blocks.*.attn": ("heads",)},
    ),
    keep_high_precision=("img_in", "txt_in", "time_text_embed", "_mod.", "norm_out", "proj_out"),
    lora_loader="QwenImageLoraLoaderMixin",
    measured=Measured.read(Path(__file__).parent),
)
