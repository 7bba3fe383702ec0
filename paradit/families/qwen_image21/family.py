"""Qwen-Image 2.1 (base and Turbo) as one record: its checkpoints, its requests, its runtime facts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import component_config
from paradit.errors import InvalidRequest
from paradit.families.qwen_image21.latents import SIDE_MULTIPLE, TOKEN_PIXELS, area_size
from paradit.families.qwen_image21.model import QwenImage21Config, QwenImage21Transformer
from paradit.families.qwen_image21.presets import QwenImage21Inputs
from paradit.family import Family, Measured, SettledRun, imported
from paradit.parallel.tensor_plan import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan
from paradit.pipelines.requests import resolve_common
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, checkpoint_spec

if TYPE_CHECKING:
    pass

CONDITION_IMAGE_LIMIT = 10  # the model card's stated maximum of reference images
# diffusers' QwenImage21Pipeline.__call__ defaults: 40 steps, no guidance (true_cfg_scale 1), output_resolution 1024.
PIPELINE_DEFAULTS = {"guidance_mode": "cfg", "steps": 40, "guidance": 1.0, "height": 1024, "width": 1024}
# diffusers hands the scheduler its own sigmas, which DPMSolverMultistepScheduler takes none of
SCHEDULERS = ("flow-euler", "unipc")


def read_checkpoint(folder: Path, index: dict) -> ModelSpec:
    """A checkpoint's ``sample_sigmas`` (model_index.json: Turbo's schedule) set its default steps."""
    transformer = component_config(folder, "transformer")
    QwenImage21Config.from_dict(transformer)  # refuses the variants paradit does not serve, before loading
    sigmas = index.get("sample_sigmas")
    defaults = dict(PIPELINE_DEFAULTS, steps=len(sigmas)) if sigmas else PIPELINE_DEFAULTS
    return checkpoint_spec(
        folder,
        index,
        "qwen_image21",
        transformer=transformer,
        text_encoder=component_config(folder, "text_encoder"),
        **defaults,
        details=QwenImage21Inputs(sample_sigmas=tuple(sigmas) if sigmas else None),
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """Condition images (``--image``, up to ten) edit; without a size the output takes the last one's aspect at
    about ``output_resolution`` squared pixels, as diffusers makes it."""
    if request.mask is not None:
        raise InvalidRequest(f"{spec.name} takes no mask: its pipeline edits from condition images", param="mask")
    resolved = resolve_common(spec, request, SIDE_MULTIPLE, image_limit=CONDITION_IMAGE_LIMIT, schedulers=SCHEDULERS)
    if request.cache is not None and uses_cfg(spec, resolved):
        # Each branch runs its own call over its own prefix: a cache would take the two calls for two steps.
        raise InvalidRequest(
            f"{spec.name} runs each guidance branch apart (their prefixes differ), which --cache cannot follow yet; "
            "drop --cache, or the negative prompt or a --guidance above 1",
            param="cache",
        )
    if not resolved.images:
        return resolved
    inputs: QwenImage21Inputs = spec.details or QwenImage21Inputs()
    height, width = area_size(inputs.output_resolution, resolved.images[-1])
    resolved.height = resolved.height if request.height is not None else height
    resolved.width = resolved.width if request.width is not None else width
    sizes = [area_size(inputs.output_resolution, image) for image in resolved.images]
    resolved.reference_tokens = sum(math.prod(size) // TOKEN_PIXELS**2 for size in sizes)
    return resolved


def check_run(settings: SettledRun, request: ResolvedRequest) -> None:
    """The prefix's keys and values are made once per request, outside any captured graph; PipeFusion's stages keep
    theirs whole, not split over a sequence group, and run one prefix a step (each guidance branch has its own)."""
    parallel = settings.parallel
    guided_on_one_rank = uses_cfg(settings.spec, request) and parallel.cfg == 1
    asked = {
        "--pipefusion with --ulysses or --ring": parallel.pipefusion > 1 and parallel.sequence_degree > 1,
        "--pipefusion with guidance but without --cfg 2": parallel.pipefusion > 1 and guided_on_one_rank,
        "--cuda-graphs": settings.options.cuda_graphs,
    }
    refused = [flag for flag, used in asked.items() if used]
    if refused:
        flags = " and ".join(refused)
        raise InvalidRequest(
            f"{settings.spec.name} runs its prompt and condition images once as a cached prefix, which {flags} "
            f"cannot take yet; drop {flags} (--ulysses, --ring, --tensor, --pipefusion, --shard-weights and CFG "
            "parallel take it)"
        )


def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
    """diffusers' rule for ``true_cfg_scale``: a negative prompt and a scale above 1."""
    return request.negative_prompts is not None and request.guidance is not None and request.guidance > 1.0


FAMILY = Family(
    name="qwen_image21",
    pipeline=imported("paradit.families.qwen_image21.pipeline", "QwenImage21Pipeline"),
    diffusers_pipelines=("QwenImage21Pipeline",),
    read_checkpoint=read_checkpoint,
    resolve_request=resolve_request,
    check_run=check_run,
    uses_cfg=uses_cfg,
    build_transformer=lambda spec: QwenImage21Transformer(QwenImage21Config.from_dict(spec.transformer)),
    prompt_encoder=imported("paradit.families.qwen_image21.pipeline", "Qwen3VLPromptEncoder"),
    vae="AutoencoderKLQwenImage21",
    tensor_plan=TensorPlan(
        family="Qwen-Image 2.1",
        heads=lambda model: model.config.num_attention_heads,
        widths=lambda model: {
            "attention": model.transformer_blocks[0].attn.to_q.out_features,
            "MLP hidden": model.transformer_blocks[0].img_mlp.out.in_features,
        },
        linears={
            "transformer_blocks.*.attn.to_[qkv]": COLUMN,
            "transformer_blocks.*.attn.to_out.0": ROW,
            "transformer_blocks.*.img_mlp.proj": COLUMN_MLP,
            "transformer_blocks.*.img_mlp.gate_layer": COLUMN_MLP,
            "transformer_blocks.*.img_mlp.out": ROW_MLP,
        },
        local_attributes={"transformer_blocks.*.attn": ("heads",)},
    ),
    # The embedders, the one shared modulation and the output layers: few FLOPs, feeding every block.
    keep_high_precision=("img_in", "txt_in", "time_text_embed", "modulation", "norm_out", "proj_out"),
    lora_loader="QwenImageLoraLoaderMixin",
    measured=Measured.read(Path(__file__).parent),
)
