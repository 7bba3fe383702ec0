"""One FLUX.3 [klein] transformer step on one GPU with 0, 1 and 3 references: paradit (bf16 and FP8 linears, compiled)
beside diffusers' compiled bf16 ``Flux3Transformer2DModel``, same weights, same run.

Full-size architectures with random weights. diffusers' model is built on the meta device and handed paradit's
tensors (identical parameter names): one copy in memory. A step is one forward of one guidance branch at batch 1 on
both sides. diffusers runs the references' and the text's per-mode blocks at every step; paradit, for the base model,
once per request (``encode_prefix``, outside the timed step, as its pipeline does); the flow map runs them each step
on both sides (its target embedding reaches them). Each reference is a 1024x1024 image (4096 tokens), the text one
window of ``--text-len`` tokens. Prints ms/step per side, paradit's speedup, the relative L2 between the two bf16
predictions, and writes flux3_step.json under ``--out-dir``.

    python benchmarks/flux3_step.py --out-dir $OUT                    (both presets, 0/1/3 references, bf16 and fp8)
    python benchmarks/flux3_step.py --models flux3-klein --refs 0 3 --out-dir $OUT
    python benchmarks/flux3_step.py --tiny                            (a tiny config on the CPU, fp32, eager: seconds)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import init_dummy_weights, median_ms, print_table, quantize_fp8, write_json  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.flux3.model import Flux3Config, Flux3Transformer  # noqa: E402
from paradit.families.flux3.pipeline import image_ids, text_ids  # noqa: E402

MODELS = ["flux3-klein-base", "flux3-klein"]
# --tiny: the presets' switches on a transformer of a few hundred thousand parameters.
TINY = dict(num_layers=2, num_single_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=64)
TINY.update(in_channels=16, cond_in_channels=16, timestep_channels=32, axes_dims_rope=[4, 4, 4, 4])
SIGMA, TARGET = 0.5, 0.4375  # a mid-schedule step and, for a flow map, the step it lands on


def transformer_config(name: str, tiny: bool) -> dict:
    return {**PRESETS[name].transformer, **(TINY if tiny else {})}


def step_inputs(
    config: Flux3Config,
    height: int,
    width: int,
    text_len: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    refs: int = 0,
) -> dict:
    """diffusers' forward arguments for a batch of 1: the target and each of ``refs`` references ``height`` x ``width``
    pixels (the planner's model facts count text-to-image's)."""
    rows, cols, gen = height // 16, width // 16, torch.Generator(device).manual_seed(0)

    def noise(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    inputs = dict(
        hidden_states=noise(1, rows * cols, config.in_channels),
        encoder_hidden_states=noise(1, text_len, config.joint_attention_dim),
        timestep=torch.full((1,), SIGMA, device=device, dtype=dtype),
        img_ids=image_ids(rows, cols, 0, device),
        txt_ids=text_ids(text_len, device),
    )
    if refs:
        inputs["image_cond_hidden_states"] = noise(1, refs * rows * cols, config.cond_in_channels)
        inputs["image_cond_ids"] = torch.cat([image_ids(rows, cols, n + 1, device) for n in range(refs)])
    if config.flow_map:
        inputs["target_timestep"] = torch.full((1,), TARGET, device=device, dtype=dtype)
    return inputs


def paradit_step(model: Flux3Transformer, inputs: dict):
    """The step paradit's pipeline runs: without a flow map, on the prefix its request computed once."""
    if model.config.flow_map:
        return lambda: model(**inputs)
    prefix = dict(inputs)
    txt, cond = model.encode_prefix(
        prefix.pop("encoder_hidden_states"),
        inputs["txt_ids"],
        prefix.pop("image_cond_hidden_states", None),
        inputs.get("image_cond_ids"),
    )
    return lambda: model(encoder_hidden_states=txt, image_cond_hidden_states=cond, prefixed=True, **prefix)


def diffusers_step(reference, inputs: dict):
    """diffusers' step: every mode through its blocks."""
    return lambda: reference(**inputs, return_dict=False)[0]


def bench_model(name: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    from diffusers import Flux3Transformer2DModel

    settings = transformer_config(name, args.tiny)
    config = Flux3Config.from_dict(settings)
    with torch.device("meta"):
        ours, reference = Flux3Transformer(config), Flux3Transformer2DModel(**settings)
    init_dummy_weights(ours, device, dtype)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    ours, reference = ours.eval(), reference.eval()
    if args.compile:
        reference.compile_repeated_blocks(dynamic=False)
    inputs = {refs: step_inputs(config, args.size, args.size, args.text_len, device, dtype, refs) for refs in args.refs}
    rows, expected = [], {}
    with torch.inference_mode():
        for refs in args.refs:
            run = diffusers_step(reference, inputs[refs])
            expected[refs] = run().float()
            ms = median_ms(run, device, args.warmup, args.iters)
            rows.append(dict(model=name, refs=refs, impl="diffusers", dtype=str(dtype).split(".")[-1], ms_per_step=ms))
        for linears in args.linears:
            if linears == "fp8":
                quantize_fp8(ours, device, FAMILIES["flux3"].keep_high_precision)
            if args.compile:
                torch.compiler.reset()
                compile_blocks(ours)
            for refs in args.refs:
                run = paradit_step(ours, inputs[refs])
                got = run().float()
                ms = median_ms(run, device, args.warmup, args.iters)
                diffusers_ms = next(r["ms_per_step"] for r in rows if r["impl"] == "diffusers" and r["refs"] == refs)
                rel_l2 = ((got - expected[refs]).norm() / expected[refs].norm()).item()
                rows.append(
                    dict(
                        model=name,
                        refs=refs,
                        impl="paradit",
                        dtype=linears if linears == "fp8" else str(dtype).split(".")[-1],
                        ms_per_step=ms,
                        speedup_vs_diffusers=diffusers_ms / ms,
                        rel_l2_vs_diffusers=rel_l2,
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--refs", nargs="+", type=int, default=[0, 1, 3])
    parser.add_argument("--linears", nargs="+", default=None, choices=["bf16", "fp8"], help="default: both (GPU)")
    parser.add_argument("--size", type=int, default=None, help="target and reference side, px (1024; --tiny 64)")
    parser.add_argument("--text-len", type=int, default=160, help="text tokens: FLUX.3 pads prompts to 80s")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on GPUs")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs (3; --tiny 1)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs, median (10; --tiny 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU in fp32: checks the script")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.size = args.size or (64 if args.tiny else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.iters = args.iters or (2 if args.tiny else 10)
    args.compile = args.compile if args.compile is not None else device.type == "cuda"
    args.linears = args.linears or (["fp32"] if args.tiny else ["bf16", "fp8"])
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; compiled: {args.compile}")
    rows = []
    for name in args.models:
        rows += bench_model(name, args, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the pair's weights are freed once it is dropped
    print_table(
        rows,
        [
            ("model", "model", "s"),
            ("refs", "refs", "d"),
            ("impl", "impl", "s"),
            ("dtype", "linears", "s"),
            ("ms_per_step", "ms/step", ".1f"),
            ("speedup_vs_diffusers", "vs diffusers", ".2f"),
            ("rel_l2_vs_diffusers", "rel L2", ".1e"),
        ],
    )
    write_json(args.out_dir, "flux3_step.json", {"args": vars(args), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
