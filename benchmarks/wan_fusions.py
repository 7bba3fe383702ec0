"""The fused kernels of ``paradit.layers.fp8_fused`` on the Wan 2.2 A14B expert (random weights, FP8 linears,
compiled blocks, FP8 attention), each on and off in the same call: the forward's time per variant, its kernels summed
by kind (the fused kernels named apart) and its slowest kernels, and each variant's output against the unfused one.

A 40-block forward at 720p compiled five times does not fit one call, so ``--blocks N`` (default 4) builds the expert
with its first N blocks only; the table scales them to the expert's 40: embed and head timed once, plus 40/N times
the blocks. Every variant compiles the blocks again (one graph per block kind); ``--deadline-s`` leaves out, by name,
a variant that would end past it if it took as long as the longest so far (the defaults end within 6 minutes on one
H100: compilation is most of each variant's time). ``--tiny`` runs a two-block miniature on the CPU (Triton's
interpreter, eager), for the tests.

    python benchmarks/wan_fusions.py --out-dir $OUT
    python benchmarks/wan_fusions.py --blocks 2 --variants none all --attention sdpa --out-dir $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the interpreter is chosen as the kernels are defined, at import
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import init_dummy_weights, print_table, write_json  # noqa: E402
from benchmarks.forward_profile import kind_of  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.wan.model import WanConfig, WanTransformer  # noqa: E402
from paradit.layers.fp8 import fp8_dtype  # noqa: E402
from paradit.layers.fp8_fused import FUSIONS, choose_fusions  # noqa: E402
from paradit.quantize import convert_fp8  # noqa: E402

EXPERT = "wan2.2-t2v-a14b"
EXPERT_BLOCKS = 40
# height, width, frames of the latents' video, and the umT5 prompt's padded tokens
SIZE, TINY_SIZE, TEXT_TOKENS = (720, 1280, 81), (16, 16, 5), 512
TINY_CONFIG = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32)
TOP_KERNELS = 12


def variants(names: list[str]) -> dict[str, frozenset[str]]:
    """``none``, ``all`` or one fusion's name -> the fusions that variant runs."""
    table = {"none": frozenset(), "all": frozenset(FUSIONS), **{name: frozenset({name}) for name in FUSIONS}}
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(table)}")
    return {name: table[name] for name in names}


def build(blocks: int, tiny: bool, device: torch.device):
    """The expert's first ``blocks`` blocks with random weights and FP8 linears, and one forward's inputs."""
    spec = PRESETS[EXPERT]
    config = WanConfig.from_dict({**spec.transformer, "num_layers": blocks, **(TINY_CONFIG if tiny else {})})
    with torch.device("meta"):
        model = WanTransformer(config)
    init_dummy_weights(model, device, torch.bfloat16)
    # FP8 on the CPU is the tiny run's, in OCP e4m3: ``quantize_fp8`` refuses a CPU.
    convert_fp8(model.eval(), fp8_dtype(device), FAMILIES[spec.family].keep_high_precision)
    height, width, frames = TINY_SIZE if tiny else SIZE
    generator = torch.Generator(device).manual_seed(0)
    shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, device=device, generator=generator).bfloat16()
    text = torch.randn(1, 8 if tiny else TEXT_TOKENS, config.text_dim, device=device, generator=generator)
    return model, (latents, torch.full((1,), 500.0, device=device), text.bfloat16())


def timed_ms(run, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``run`` over ``iters`` calls after one."""
    run()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            run()
            times.append((time.perf_counter() - start_s) * 1000)
    return sorted(times)[len(times) // 2]


def kernel_times(run, device: torch.device) -> list[tuple[str, float, int]]:
    """(name, ms, calls) of one profiled call: GPU kernels, or on the CPU the operators."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [(e.key, getattr(e, field) / 1000, e.count) for e in prof.key_averages()]
    return [kernel for kernel in kernels if kernel[1] > 0]


def breakdown(variant: str, kernels: list[tuple[str, float, int]], scale: float) -> list[dict]:
    """Kinds, then the slowest kernels, each in ms of the measured blocks' forward and scaled to the expert."""
    total = sum(ms for _, ms, _ in kernels)
    by_kind: dict[str, list] = {}
    for name, ms, calls in kernels:
        entry = by_kind.setdefault(kind_of(name), [0.0, 0])
        entry[0] += ms
        entry[1] += calls
    rows = [
        dict(variant=variant, what=kind, kind=kind, ms=ms, calls=calls, share=ms / total)
        for kind, (ms, calls) in sorted(by_kind.items(), key=lambda item: -item[1][0])
    ]
    for name, ms, calls in sorted(kernels, key=lambda kernel: -kernel[1])[:TOP_KERNELS]:
        rows.append(dict(variant=variant, what=name[:80], kind=kind_of(name), ms=ms, calls=calls, share=ms / total))
    for row in rows:
        row["expert_ms"] = row["ms"] * scale
    return rows


def side_by_side(kernel_rows: list[dict], variants: list[str]) -> list[dict]:
    """One row per kind of kernel, its scaled milliseconds under each variant: the breakdown before and after."""
    table: dict[str, dict] = {}
    for row in kernel_rows:
        if row["what"] == row["kind"]:
            table.setdefault(row["kind"], {"kind": row["kind"]})[row["variant"]] = row["expert_ms"]
    return sorted(table.values(), key=lambda row: -max(row.get(variant) or 0.0 for variant in variants))


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4, help="blocks built and timed (scaled to the expert's 40)")
    parser.add_argument("--variants", nargs="+", default=["none", "all", *FUSIONS], help="none, all or a fusion")
    parser.add_argument("--attention", default="fp8", choices=["fp8", "sdpa"])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=330.0, help="seconds the variants must end within")
    parser.add_argument("--tiny", action="store_true", help="a two-block miniature on the CPU (the tests)")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    started = time.perf_counter()
    chosen = variants(args.variants)
    if args.blocks < 1:
        raise SystemExit(f"--blocks {args.blocks}: give at least 1")
    device = torch.device("cpu" if args.tiny else "cuda")
    model, inputs = build(args.blocks, args.tiny, device)
    if args.attention == "fp8" and not args.tiny:
        from paradit.layers.attention import apply_fp8_attention

        apply_fp8_attention(model, 0)
    environment = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        blocks=args.blocks,
        attention="sdpa" if args.tiny else args.attention,
        compiled=not args.tiny,
    )
    print(environment, flush=True)
    scale = EXPERT_BLOCKS / args.blocks
    with torch.inference_mode():
        outside_ms = timed_ms(lambda: model.head(model.embed(*inputs)), device, args.iters)
    rows, kernel_rows, skipped, reference, longest_s = [], [], [], None, 0.0
    for variant, fusions in chosen.items():
        variant_start = time.perf_counter()
        if variant_start - started + longest_s > args.deadline_s:
            skipped.append(variant)
            continue
        torch.compiler.reset()
        choose_fusions(model, fusions)
        if not args.tiny:
            compile_blocks(model)
        with torch.inference_mode():
            compile_start = time.perf_counter()
            out = model(*inputs).float()
            first_s = time.perf_counter() - compile_start
            forward_ms = timed_ms(lambda: model(*inputs), device, args.iters)
            kernels = kernel_times(lambda: model(*inputs), device)
        reference = out if reference is None else reference
        blocks_ms = forward_ms - outside_ms
        row = dict(
            variant=variant,
            fusions=sorted(fusions),
            forward_ms=forward_ms,
            blocks_ms=blocks_ms,
            expert_ms=outside_ms + blocks_ms * scale,
            first_s=first_s,
            rel_l2_vs_first=relative_l2(out, reference),
        )
        rows.append(row)
        kernel_rows += breakdown(variant, kernels, scale)
        print(f"{variant}: {forward_ms:.1f} ms for {args.blocks} blocks, {row['expert_ms']:.0f} ms scaled", flush=True)
        longest_s = max(longest_s, time.perf_counter() - variant_start)
        write_json(args.out_dir, "wan_fusions.json", dict(environment=environment, rows=rows, kernels=kernel_rows))
    first = rows[0]["expert_ms"]
    for row in rows:
        row["vs_first"] = row["expert_ms"] / first - 1
    print(
        f"\nThe expert's first {args.blocks} blocks, scaled to its {EXPERT_BLOCKS}: embed and head {outside_ms:.1f} ms "
        f"(once) + {scale:g} x the blocks' time; each variant against the first ({rows[0]['variant']})."
    )
    if skipped:
        print(f"Past --deadline-s {args.deadline_s:g}: not run {', '.join(skipped)}.")
    print_table(
        kernel_rows,
        [
            ("variant", "variant", "s"),
            ("what", "kernels", "s"),
            ("kind", "kind", "s"),
            ("ms", f"ms / {args.blocks} blocks", ".2f"),
            ("expert_ms", "ms scaled", ".1f"),
            ("calls", "calls", "d"),
            ("share", "share", ".3f"),
        ],
    )
    print_table(
        side_by_side(kernel_rows, list(chosen)),
        [("kind", "kind (ms, scaled)", "s")]
        + [(variant, variant, ".1f") for variant in chosen if variant not in skipped],
    )
    print_table(
        rows,
        [
            ("variant", "variant", "s"),
            ("forward_ms", f"ms / {args.blocks} blocks", ".1f"),
            ("expert_ms", f"ms / {EXPERT_BLOCKS} blocks (scaled)", ".0f"),
            ("vs_first", "vs first", "+.1%"),
            ("first_s", "first call s", ".1f"),
            ("rel_l2_vs_first", "rel L2 vs first", ".1e"),
        ],
    )
    payload = dict(environment=environment, outside_ms=outside_ms, rows=rows, kernels=kernel_rows, skipped=skipped)
    write_json(args.out_dir, "wan_fusions.json", payload)


if __name__ == "__main__":
    main()
