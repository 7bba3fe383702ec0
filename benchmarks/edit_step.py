"""One editing step on one GPU: paradit's transformer against diffusers' own, like for like, in the same process.

Per (model, reference count): paradit's transformer is built as the engine builds it (``runtime.load_transformer``,
random weights), diffusers' (``QwenImageTransformer2DModel``, ``Flux2Transformer2DModel``) from the same config and
handed the very same weight tensors (identical parameter names: one copy in memory). paradit's inputs are the ones
its own pipeline passes the transformer: the family pipeline's ``predictor`` (CFG's two branches batched, text padded
to one length and masked as ``encode_rows`` pads it, the mask dropped when nothing is padded) and ``model_call``
(references' tokens after the target's, their grids / position ids) are run on a stand-in transformer that records
the call, which is then timed on paradit's real one. diffusers' inputs are the ones its pipeline passes
(``QwenImageEditPlusPipeline``, ``QwenImagePipeline``, ``Flux2Pipeline``, ``Flux2KleinPipeline``): one call per
guidance branch at batch 1, each branch its own unpadded text (its mask then None), ``img_shapes`` with the target's
and each reference's grid (2511's ``zero_cond_t`` modulates the references as at timestep 0 through them), FLUX.2's
ids from the pipeline's own static helpers.

What the prompt encoder would give is replaced by random embeddings of the lengths it gives: Qwen-Image-Edit-Plus
(2509, 2511) prompts carry each image's vision tokens (Qwen2.5-VL reads each reference at about 384x384 pixels:
a 392x392 grid of 14-pixel patches, merged 2x2: 196 tokens, plus "Picture N: " and the vision markers), the negative
prompt " " carries them too; FLUX.2 pads every prompt to 512 tokens. Text-to-image (0 references) of an edit
checkpoint is its text-to-image sibling's step (Qwen-Image), as neither pipeline takes an edit without images.

Reported per case: paradit's step (its forwards: both branches in one batch when the model guides with CFG, or
apart where their texts differ in length), diffusers'
step (its two batch-1 forwards, cond then uncond, as its loop runs them), each side's single branch (paradit: its
pipeline's call without CFG, batch 1), the ratio, peak memory, and with ``--check`` the largest difference between
the two implementations' predictions per branch (the proof that the inputs are like for like). ``--blocks`` builds
both sides with fewer blocks (FLUX.2-dev's 32B does not fit beside 3 references' activations); the full step is then
projected from the per-block time (approximate: the embedding and output layers are counted as blocks).
``--quantize fp8`` builds paradit's side with FP8 linears, as the engine's ``--quantize fp8`` does (diffusers' side
stays its bf16 transformer, the reference the issue names), and reports the FP8 prediction's relative L2 against
paradit's bf16 one on the same weights (the FP8 transformer runs first and is freed before the bf16 one loads).

    python benchmarks/edit_step.py --check --out-dir $OUT          (DEFAULT_CASES, in ~8 minutes on an H100)
    python benchmarks/edit_step.py --models flux2-dev --refs 3 --blocks flux2-dev=14 --out-dir $OUT
    python benchmarks/edit_step.py --models flux2-klein-4b --refs 0 1 3 --quantize fp8 --check --out-dir $OUT
    python benchmarks/edit_step.py --tiny --device cpu             (every model's tiny stand-in, both sides, ~20 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_ms, print_table, write_json  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.flux2.pipeline import Flux2Layout  # noqa: E402
from paradit.families.flux2.presets import FLUX2_TINY_TRANSFORMER  # noqa: E402
from paradit.families.qwen_image.pipeline import QwenLayout  # noqa: E402
from paradit.families.qwen_image.presets import QWEN_IMAGE_TINY_TRANSFORMER  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.pipelines.base import pad_rows  # noqa: E402
from paradit.request import ResolvedRequest  # noqa: E402
from paradit.runtime import load_transformer  # noqa: E402
from paradit.spec import RandomWeights  # noqa: E402

MODELS = ["qwen-image-edit-2511", "qwen-image-edit-2509", "flux2-klein-4b", "flux2-dev"]
# The cases run without --models / --refs, most wanted first (the 1 and 2 references of Qwen-Image-Edit-2511):
# compiled, each new sequence length compiles once per side and shape, ~1-2 minutes a case on an H100; those past
# --deadline-s are skipped, to be run by a second command.
DEFAULT_CASES = [
    ("qwen-image-edit-2511", 1),
    ("qwen-image-edit-2511", 2),
    ("flux2-klein-4b", 1),
    ("flux2-klein-4b", 3),
    ("qwen-image-edit-2511", 0),
    ("qwen-image-edit-2509", 1),
    ("flux2-dev", 1),
    ("flux2-klein-4b", 0),
]
GPU_DEADLINE_S = 330  # on GPUs without --deadline-s: no case starts past it, so the command ends within ~8 minutes
DEFAULT_BLOCKS = {"flux2-dev": 14}  # of 56 (8 double + 48 single): 2 + 12, a quarter of its 64 GB
TINY_MODELS = [*MODELS, "flux2-tiny"]  # flux2-tiny: the klein layout with true CFG (the branches' batching)
# An edit checkpoint's text-to-image sibling (the same transformer): its step without references.
TEXT_TO_IMAGE = {"qwen-image-edit-2511": "qwen-image", "qwen-image-edit-2509": "qwen-image"}

PROMPT = "the subject of the first image in the room of the second"
# Qwen2.5-VL's tokens past the template's dropped prefix: the prompt's (one a word here; the negative " " one), then
# "<|im_end|>\n<|im_start|>assistant\n" (5). Edit-Plus puts "Picture N: <|vision_start|>", the image's merged
# patches and "<|vision_end|>" before the prompt: 5 + 2 tokens, and 196 for a 1024x1024 reference (its 384x384
# condition size, which Qwen2-VL's processor rounds to 392x392, 28 pixels a merged token).
PROMPT_TOKENS, NEGATIVE_TOKENS, TEMPLATE_TAIL_TOKENS = 12, 1, 5
VISION_TOKENS, PICTURE_MARKER_TOKENS = 196, 7
FLUX2_TEXT_TOKENS = 512  # every FLUX.2 prompt is padded to max_sequence_length
MID_T = 500.0  # the scheduler's timestep the step runs at (sigma 0.5)

COLUMNS = [
    ("model", "model", "s"),
    ("refs", "refs", "d"),
    ("config", "config", "s"),
    ("blocks", "blocks", "s"),
    ("text_tokens", "text tokens (cond/uncond)", "s"),
    ("image_tokens", "image tokens", "d"),
    ("cfg", "guidance", "s"),
    ("precision", "paradit precision", "s"),
    ("text_mask", "paradit text", "s"),
    ("compiled", "compiled", "s"),
    ("paradit_ms", "paradit ms/step", ".1f"),
    ("diffusers_ms", "diffusers ms/step", ".1f"),
    ("ratio", "paradit/diffusers", ".2f"),
    ("paradit_every_row_ms", "paradit ms, last block every row", ".1f"),
    ("paradit_branch_ms", "paradit ms/branch", ".1f"),
    ("diffusers_branch_ms", "diffusers ms/branch", ".1f"),
    ("paradit_full_ms", "paradit full ms (proj.)", ".1f"),
    ("diffusers_full_ms", "diffusers full ms (proj.)", ".1f"),
    ("paradit_peak_gib", "paradit peak GiB", ".1f"),
    ("diffusers_peak_gib", "diffusers peak GiB", ".1f"),
    ("max_abs_diff", "max |diff|", ".1e"),
    ("rel_l2", "rel L2", ".1e"),
    ("fp8_rel_l2", "FP8 vs bf16 rel L2", ".1e"),
    ("error", "note", "s"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def qwen_text_tokens(refs: int, prompt_tokens: int) -> int:
    return refs * (PICTURE_MARKER_TOKENS + VISION_TOKENS) + prompt_tokens + TEMPLATE_TAIL_TOKENS


def block_counts(family: str, config: dict) -> dict[str, int]:
    if family == "qwen_image":
        return {"num_layers": config["num_layers"]}
    return {"num_layers": config["num_layers"], "num_single_layers": config["num_single_layers"]}


def truncated(family: str, config: dict, blocks: int) -> dict[str, int]:
    """``blocks`` blocks in all, shared between the kinds as the full model shares them (at least one of each)."""
    full = block_counts(family, config)
    total = sum(full.values())
    if blocks >= total:
        return full
    kept = {key: max(1, round(count * blocks / total)) for key, count in full.items()}
    if len(kept) > 1:  # the rounding's excess or shortfall taken from the larger kind
        largest = max(kept, key=kept.get)
        kept[largest] = max(1, kept[largest] + blocks - sum(kept.values()))
    return kept


def model_spec(name: str, args, blocks_of: str):
    """The preset's spec, random weights; ``--tiny``: its family's tiny transformer with the preset's switches;
    ``--blocks`` as given for ``blocks_of``."""
    spec = PRESETS[name]
    config = dict(spec.transformer)
    if args.tiny and spec.family == "qwen_image":
        config = {**QWEN_IMAGE_TINY_TRANSFORMER, "zero_cond_t": config.get("zero_cond_t", False)}
    elif args.tiny:
        config = {**FLUX2_TINY_TRANSFORMER, "guidance_embeds": config["guidance_embeds"]}
    blocks = args.blocks.get(blocks_of, args.blocks.get("*"))
    full_blocks = sum(block_counts(spec.family, config).values())
    if blocks is not None:
        config.update(truncated(spec.family, config, blocks))
    kept = sum(block_counts(spec.family, config).values())
    return dataclasses.replace(spec, transformer=config, weights=RandomWeights()), kept, full_blocks


class Recorder(torch.nn.Module):
    """Stands in for the transformer in paradit's pipeline: records the call, answers ones of the output's shape."""

    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.out_channels, self.calls = out_channels, []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return torch.ones(*args[0].shape[:2], self.out_channels, device=args[0].device, dtype=args[0].dtype)


def paradit_call(pipeline, runtime, request, conditioning, layout, latents, t):
    """The exact calls, as (args, kwargs), paradit's pipeline makes of the transformer for one step of ``request``
    (two where CFG's branches run apart)."""
    recorder = Recorder(runtime.model.proj_out.out_features)
    finite = [torch.ones((), dtype=torch.bool, device=latents.device)]
    pipeline.predictor(request, conditioning, layout, finite)(latents, t, recorder)
    return recorder.calls


def qwen_inputs(spec, refs: int, args, pipeline, runtime, device, dtype):
    """paradit's calls (CFG step, one branch) and diffusers' per-branch keyword arguments for one Qwen-Image step."""
    config = runtime.model.config
    side = args.size // 16
    gen = torch.Generator(device).manual_seed(0)
    edit = spec.details is not None
    # Edit-Plus resizes a square reference of 1024x1024 to 1024x1024 (its input area): the output's grid.
    grids = ((side, side),) * refs
    lengths = [qwen_text_tokens(refs, PROMPT_TOKENS), qwen_text_tokens(refs, NEGATIVE_TOKENS)]
    if not edit:
        lengths = [PROMPT_TOKENS + TEMPLATE_TAIL_TOKENS, NEGATIVE_TOKENS + TEMPLATE_TAIL_TOKENS]
    rows = [torch.randn(n, config.joint_attention_dim, device=device, generator=gen).to(dtype) for n in lengths]
    latents = torch.randn(1, side * side, config.in_channels, device=device, generator=gen).to(dtype)
    references = None
    if refs:
        references = torch.randn(1, refs * side * side, config.in_channels, device=device, generator=gen).to(dtype)
    layout = QwenLayout(side, side, references, grids)
    t = torch.tensor(MID_T, device=device)
    request = resolved_request(args, refs, negative=[" "], guidance=4.0)
    embeds, mask = pad_rows(rows)  # encode_rows: the branches' rows padded to the longest, and the mask
    step = paradit_call(pipeline, runtime, request, {"embeds": embeds, "mask": mask}, layout, latents, t)
    cond_only = dataclasses.replace(request, negative_prompts=None)
    embeds, mask = pad_rows(rows[:1])
    branch = paradit_call(pipeline, runtime, cond_only, {"embeds": embeds, "mask": mask}, layout, latents, t)

    # QwenImageEditPlusPipeline / QwenImagePipeline: latents then the references' latents, timestep / 1000 in the
    # latents' dtype, each branch's embeddings with mask None (batch 1: nothing padded), img_shapes of every grid.
    hidden = latents if references is None else torch.cat([latents, references], dim=1)
    timestep = t.expand(1).to(dtype) / 1000
    img_shapes = [[(1, side, side), *[(1, *grid) for grid in grids]]]
    branches = [
        dict(
            hidden_states=hidden,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=None,
            encoder_hidden_states=row[None],
            img_shapes=img_shapes,
            attention_kwargs={},
            return_dict=False,
        )
        for row in rows
    ]
    return step, branch, branches, lengths, side * side * (1 + refs)


def flux2_inputs(spec, refs: int, args, pipeline, runtime, device, dtype):
    """paradit's calls and diffusers' per-branch keyword arguments for one FLUX.2 step."""
    from diffusers import Flux2Pipeline as DiffusersFlux2

    config = runtime.model.config
    side = args.size // 16
    gen = torch.Generator(device).manual_seed(0)
    cfg = spec.guidance_mode == "cfg"
    branch_count = 2 if cfg else 1
    rows = [
        torch.randn(1, FLUX2_TEXT_TOKENS, config.joint_attention_dim, device=device, generator=gen).to(dtype)
        for _ in range(branch_count)
    ]
    latents = torch.randn(1, side * side, config.in_channels, device=device, generator=gen).to(dtype)
    reference_latents = [
        torch.randn(1, config.in_channels, side, side, device=device, generator=gen).to(dtype) for _ in range(refs)
    ]
    references = reference_ids = None
    if refs:
        # encode_references: each reference packed, its own time coordinate 10, 20, ...
        references = torch.cat([ref.flatten(2).transpose(1, 2) for ref in reference_latents], dim=1)
        reference_ids = torch.cat(
            [
                torch.cartesian_prod(
                    torch.tensor([10 * (i + 1)]), torch.arange(side), torch.arange(side), torch.arange(1)
                )
                for i in range(refs)
            ]
        ).to(device)
    layout = Flux2Layout(side, side, references, reference_ids)
    t = torch.tensor(MID_T, device=device)
    request = resolved_request(args, refs, negative=[""] if cfg else None, guidance=spec.guidance)
    step = paradit_call(pipeline, runtime, request, {"embeds": torch.cat(rows)}, layout, latents, t)
    cond_only = dataclasses.replace(request, negative_prompts=None)
    branch = step if not cfg else paradit_call(pipeline, runtime, cond_only, {"embeds": rows[0]}, layout, latents, t)

    # Flux2Pipeline / Flux2KleinPipeline: ids from its own static helpers, guidance (dev's) as float32 of batch 1.
    latent_ids = DiffusersFlux2._prepare_latent_ids(latents.transpose(1, 2).unflatten(2, (side, side))).to(device)
    hidden, img_ids = latents, latent_ids
    if refs:
        hidden = torch.cat([latents, references], dim=1)
        img_ids = torch.cat([latent_ids, DiffusersFlux2._prepare_image_ids(reference_latents).to(device)], dim=1)
    guidance = torch.full([1], spec.guidance, device=device, dtype=torch.float32) if config.guidance_embeds else None
    branches = [
        dict(
            hidden_states=hidden,
            timestep=t.expand(1).to(dtype) / 1000,
            guidance=guidance,
            encoder_hidden_states=row,
            txt_ids=DiffusersFlux2._prepare_text_ids(row).to(device),
            img_ids=img_ids,
            joint_attention_kwargs=None,
            return_dict=False,
        )
        for row in rows
    ]
    return step, branch, branches, [FLUX2_TEXT_TOKENS] * branch_count, side * side * (1 + refs)


def resolved_request(args, refs: int, negative, guidance) -> ResolvedRequest:
    from PIL import Image

    images = tuple(Image.new("RGB", (args.size, args.size)) for _ in range(refs))
    return ResolvedRequest(
        prompts=[PROMPT],
        negative_prompts=negative,
        height=args.size,
        width=args.size,
        steps=1,
        guidance=guidance,
        seed=0,
        images_per_prompt=1,
        images=images,
    )


def diffusers_model(spec, paradit_model: torch.nn.Module) -> torch.nn.Module:
    """diffusers' transformer of ``spec``'s config on the meta device, handed paradit's weight tensors."""
    from diffusers import Flux2Transformer2DModel, QwenImageTransformer2DModel

    cls = QwenImageTransformer2DModel if spec.family == "qwen_image" else Flux2Transformer2DModel
    with torch.device("meta"):
        model = cls(**spec.transformer)
    model.load_state_dict(paradit_model.state_dict(), assign=True, strict=True)
    if spec.family == "qwen_image":
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

        # kept as plain attributes made in __init__ (no buffers): rebuilt off the meta device
        axes = list(spec.transformer["axes_dims_rope"])
        model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=axes, scale_rope=True)
    return model.eval()


def measure(fn, args, device, label: str) -> tuple[float, float | None]:
    """(median ms, peak GiB during the runs), without autograd."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    # As diffusers' pipelines call their transformer (under no_grad): its parameters, handed over by
    # load_state_dict(assign=True), keep requires_grad, so outside this its forward would record a graph for backward.
    with torch.inference_mode():
        ms = median_ms(fn, device, args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    log(f"  {label}: {ms:.1f} ms (measured in {time.perf_counter() - start:.0f} s incl. compile)")
    return ms, peak


def run_case(name: str, refs: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    config_name = TEXT_TO_IMAGE.get(name, name) if refs == 0 else name
    spec, kept, full_blocks = model_spec(config_name, args, name)
    family = FAMILIES[spec.family]
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    fp8 = args.quantize == "fp8"
    log(f"{name} refs={refs}: building paradit's transformer ({config_name}, {kept}/{full_blocks} blocks)")
    # paradit's side first, then (with --quantize fp8) it goes before the bf16 transformer loads that diffusers'
    # side shares: Qwen-Image's FP8 copy, its 41 GB of bf16 weights and diffusers' compiled blocks do not fit 80 GB.
    options = ExecutionOptions(quantize=args.quantize, compile=compiled, cuda_graphs=False)
    runtime = load_transformer(family, spec, device, dtype, None, options)
    pipeline = family.pipeline(spec)(family, spec, runtime, None, None, device, dtype)
    inputs = qwen_inputs if spec.family == "qwen_image" else flux2_inputs
    step, branch, branches, lengths, image_tokens = inputs(spec, refs, args, pipeline, runtime, device, dtype)
    pipeline = None
    cfg = len(branches) == 2
    target = image_tokens // (1 + refs)

    def ours(calls=step):
        return torch.cat([runtime.forward(*call[0], **call[1]) for call in calls])

    row = dict(
        model=name,
        refs=refs,
        config=config_name,
        blocks=f"{kept}/{full_blocks}",
        text_tokens="/".join(str(n) for n in lengths),
        image_tokens=image_tokens,
        cfg="CFG" if cfg else ("embedded" if spec.guidance_mode == "embedded" else "none"),
        precision="FP8 linears" if fp8 else "bf16",
        compiled="yes" if compiled else "no",
        # paradit's text: the branches padded to one length and masked (Qwen-Image), or of one length already
        text_mask="apart, unmasked"
        if len(step) == 2
        else "padded, masked"
        if spec.family == "qwen_image" and step[0][0][5] is not None
        else "none",
    )
    row["paradit_ms"], row["paradit_peak_gib"] = measure(ours, args, device, "paradit step")
    if cfg and args.per_branch:
        row["paradit_branch_ms"], _ = measure(lambda: ours(branch), args, device, "paradit one branch")
    if args.every_row and spec.family == "flux2":  # the variant before the last block kept only the target's rows
        every_row = [(call_args[:7] + (None,), kwargs) for call_args, kwargs in step]
        row["paradit_every_row_ms"], _ = measure(lambda: ours(every_row), args, device, "paradit step, every row")
    with torch.inference_mode():
        ours_out = ours().float()[:, :target]
        branch_out = ours(branch).float()[:, :target] if args.check and cfg and args.per_branch else None
    if fp8:  # the bf16 transformer (uncompiled: not timed) is the FP8 prediction's reference and diffusers' weights
        runtime = None
        free(device)
        bf16_options = ExecutionOptions(quantize="none", compile=False, cuda_graphs=False)
        runtime = load_transformer(family, spec, device, dtype, None, bf16_options)
        with torch.inference_mode():
            row["fp8_rel_l2"] = relative_l2(ours_out, ours().float()[:, :target])
        log(f"  FP8: rel L2 {row['fp8_rel_l2']:.2e} against paradit's bf16 prediction (target rows)")
    reference = diffusers_model(spec, runtime.model)
    runtime = None
    if compiled:
        reference.compile_repeated_blocks(dynamic=False)  # as paradit's compile_blocks: static shapes per block

    def theirs(kwargs=None):
        if kwargs is not None:
            return reference(**kwargs)[0]
        return [reference(**branch_kwargs)[0] for branch_kwargs in branches]

    row["diffusers_ms"], row["diffusers_peak_gib"] = measure(theirs, args, device, "diffusers step")
    if cfg and args.per_branch:
        row["diffusers_branch_ms"], _ = measure(lambda: theirs(branches[0]), args, device, "diffusers one branch")
    elif not cfg:
        row["paradit_branch_ms"], row["diffusers_branch_ms"] = row["paradit_ms"], row["diffusers_ms"]
    row["ratio"] = row["paradit_ms"] / row["diffusers_ms"]
    if kept < full_blocks:
        row["paradit_full_ms"] = row["paradit_ms"] * full_blocks / kept
        row["diffusers_full_ms"] = row["diffusers_ms"] * full_blocks / kept
        row["paradit_ms_per_block"] = row["paradit_ms"] / kept
        row["diffusers_ms_per_block"] = row["diffusers_ms"] / kept
    if args.check:
        with torch.inference_mode():
            theirs_out = torch.cat([out.float()[:, :target] for out in theirs()])
        diff = (ours_out - theirs_out).abs().max().item()
        row["max_abs_diff"], row["rel_l2"] = diff, relative_l2(ours_out, theirs_out)
        if branch_out is not None:
            row["branch_max_abs_diff"] = (branch_out - theirs_out[:1]).abs().max().item()
        log(f"  check: max |paradit - diffusers| {diff:.2e}, rel L2 {row['rel_l2']:.2e} (per branch, target rows)")
    return row


def relative_l2(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def cases(args) -> list[tuple[str, int]]:
    """(model, references) in run order: ``DEFAULT_CASES`` unless ``--models`` or ``--refs`` is given (then every
    model's every count; a model's count by default the ones ``DEFAULT_CASES`` gives it, else 1)."""
    if args.tiny and args.models is None and args.refs is None:
        return [(name, refs) for name in TINY_MODELS for refs in (0, 1, 2, 3)]
    if args.models is None and args.refs is None:
        return list(DEFAULT_CASES)
    chosen = []
    for name in args.models or MODELS:
        default = sorted(refs for model, refs in DEFAULT_CASES if model == name) or [1]
        chosen += [(name, refs) for refs in (args.refs if args.refs is not None else default)]
    return chosen


def free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        log(f"  freed: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB still allocated")


def parse_blocks(values: list[str] | None) -> dict[str, int]:
    """``--blocks 8`` (every model) or ``--blocks flux2-dev=14 qwen-image-edit-2511=30`` (over ``DEFAULT_BLOCKS``;
    ``flux2-dev=56``: the whole model)."""
    blocks = {}
    for value in values or ():
        name, _, count = value.rpartition("=")
        blocks[name or "*"] = int(count)
    return blocks if "*" in blocks else {**DEFAULT_BLOCKS, **blocks}


def environment(device: torch.device) -> dict:
    import diffusers
    import transformers

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--refs", nargs="+", type=int, default=None, help="default: per model, what fits 8 minutes")
    parser.add_argument(
        "--quantize",
        default="none",
        choices=["none", "fp8"],
        help="paradit's linears (fp8: as the engine's --quantize fp8; diffusers' side stays bf16)",
    )
    parser.add_argument(
        "--every-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FLUX.2: time paradit's step with its last block over every row too (the variant it replaced)",
    )
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on GPUs")
    parser.add_argument(
        "--per-branch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CFG models: time each side's single branch too (paradit: its batch-1 call, one more compile)",
    )
    parser.add_argument("--blocks", nargs="+", default=None, help="N or MODEL=N: build N blocks (default flux2-dev=14)")
    parser.add_argument("--size", type=int, default=None, help="output and reference side, px (1024; --tiny 64)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs, median (5; --tiny 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (2; --tiny 0)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help=f"start no case past this many seconds, listing the rest as skipped (default on GPUs: {GPU_DEADLINE_S})",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 on GPUs, fp32 on CPU")
    parser.add_argument("--tiny", action="store_true", help="each model's tiny stand-in (a CPU check of the script)")
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare the two predictions per branch (default: with --tiny)",
    )
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    args.size = args.size or (64 if args.tiny else 1024)
    args.iters = args.iters or (1 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    args.check = args.tiny if args.check is None else args.check
    args.blocks = parse_blocks(args.blocks) if not args.tiny or args.blocks else {}
    device = torch.device(args.device)
    if args.deadline_s is None and device.type == "cuda":
        args.deadline_s = GPU_DEADLINE_S
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    env = environment(device)
    log(f"{env} dtype {dtype_name}")
    started = time.perf_counter()
    rows: list[dict] = []
    payload = {"environment": env, "args": {**vars(args), "dtype": dtype_name}, "rows": rows}
    for name, refs in cases(args):
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            log(f"{name} refs={refs}: skipped, past --deadline-s {args.deadline_s:g}")
            rows.append({"model": name, "refs": refs, "error": "skipped: past --deadline-s"})
            continue
        try:
            rows.append(run_case(name, refs, args, device, dtype))
        except Exception as exc:  # noqa: BLE001 - one case failing (memory) must not lose the others' figures
            log(f"{name} refs={refs}: FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
            rows.append({"model": name, "refs": refs, "error": f"{type(exc).__name__}: {exc}"})
        free(device)  # the case's models went with its frame; their compiled graphs and cached blocks go now
        print_table(rows[-1:], COLUMNS)
        write_json(args.out_dir, "edit_step.json", payload)
    print()
    log("all cases")
    print_table(rows, COLUMNS)
    print(
        "paradit ms/step: its step's forwards (CFG's branches in one batch, or apart, each text unpadded, where "
        "their lengths differ); diffusers ms/step: its pipeline's forwards per step (cond then uncond, batch 1, each "
        "its own text length). "
        "'full ms (proj.)': the truncated model's step scaled by blocks (full / built)."
    )
    write_json(args.out_dir, "edit_step.json", payload)


if __name__ == "__main__":
    main()
