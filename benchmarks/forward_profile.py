"""Where one transformer forward spends its GPU time: Wan 2.2's expert (random weights, FP8 linears, compiled blocks,
``--attention`` fp8 or sdpa) profiled over one forward after warm-up, its kernels summed by kind (self-attention,
its pre-pass, the FP8 GEMMs, cross-attention, Inductor's fused kernels, the rest), then the slowest kernels by name;
and each of the block's FP8 GEMM shapes timed alone at the forward's token count, in TFLOP/s.

    python benchmarks/forward_profile.py --out-dir $OUT
    python benchmarks/forward_profile.py --workload a14b-480p --attention sdpa fp8 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, quantize_fp8, time_cuda_ms, write_json  # noqa: E402
from benchmarks.wan_step import WORKLOADS, build_paradit  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES  # noqa: E402
from paradit.layers.attention import apply_fp8_attention  # noqa: E402
from paradit.layers.fp8 import Fp8Linear, fp8_dtype, quantize_rowwise  # noqa: E402

# The first pattern a kernel's name (on the CPU, an operator's) matches names its kind.
KINDS = [
    ("fused: norm + modulate + FP8 quantize", r"layer_norm_modulate"),  # paradit.layers.fp8_fused
    ("fused: bias + GELU + FP8 quantize", r"gelu_quantize|gelu_fp8"),
    ("fused: Q/K RMS norm + rotary", r"rms_norm_rope"),
    ("self-attention, FP8 kernel", r"_fp8_attention_forward"),
    # The pre-pass's torch reductions (K's mean, V's maxima) are the forward's only eager ones: compiled blocks reduce
    # in Inductor's kernels.
    ("self-attention pre-pass", r"_quantize_keys_values|reduce_kernel"),
    # Inductor names a kernel after the operations it fused (``_scaled_mm`` where it quantizes a GEMM's input).
    ("Inductor fused", r"^triton_"),
    ("FP8 GEMM", r"f8f8|cutlass|gemm|sm90_xmma|nvjet|_scaled_mm"),
    ("SDPA (cuDNN or flash)", r"fmha|flash|cudnn|sdpa|scaled_dot_product"),
]
TOP_KERNELS = 25


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def fp8_expert(workload: str, device: torch.device, blocks: int | None = None):
    """Wan's expert of ``workload`` with random weights and FP8 linears (its first ``blocks`` blocks, else all of
    them), one forward's inputs, and its token count."""
    spec, model, inputs, _, tokens = build_paradit(workload, device)
    if blocks is not None:
        model.blocks = model.blocks[:blocks]
    quantize_fp8(model, device, FAMILIES[spec.family].keep_high_precision)
    return model, inputs, tokens


def kernel_times(model, inputs, forwards: int) -> list[tuple[str, float, int]]:
    """Every GPU kernel of ``forwards`` profiled forwards: (name, ms per forward, calls per forward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            model(*inputs)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1000 / forwards, e.count // forwards) for e in prof.key_averages()]
    return [k for k in kernels if k[1] > 0]


def profile_forward(model, inputs, fp8_attention, attention: str, forwards: int) -> tuple[list[dict], float]:
    """Rows of (kind or kernel, ms per forward, share) and the measured forward time."""
    fp8_attention.fp8_now = attention == "fp8"
    with torch.inference_mode():
        model(*inputs)  # compiles for this attention
        forward_ms = time_cuda_ms(lambda: model(*inputs), warmup=1, iters=3)
        torch.cuda.synchronize()
        kernels = kernel_times(model, inputs, forwards)
    total = sum(ms for _, ms, _ in kernels)
    by_kind: dict[str, list[float]] = {}
    for name, ms, count in kernels:
        entry = by_kind.setdefault(kind_of(name), [0.0, 0])
        entry[0] += ms
        entry[1] += count
    rows = [
        {"attention": attention, "what": kind, "kind": kind, "ms": ms, "calls": calls, "share": ms / total}
        for kind, (ms, calls) in sorted(by_kind.items(), key=lambda item: -item[1][0])
    ]
    rows.append({"attention": attention, "what": "all kernels", "kind": "total", "ms": total, "share": 1.0})
    rows.append({"attention": attention, "what": "forward, timed", "kind": "wall", "ms": forward_ms})
    for name, ms, count in sorted(kernels, key=lambda k: -k[1])[:TOP_KERNELS]:
        rows.append(
            {
                "attention": attention,
                "what": name[:90],
                "kind": kind_of(name),
                "ms": ms,
                "calls": count,
                "share": ms / total,
            }
        )
    return rows, forward_ms


def gemm_rates(model, tokens: int, device: torch.device) -> list[dict]:
    """Each distinct FP8 linear shape of a block timed alone (activation quantization included, as the forward runs
    it, and without it), at ``tokens`` rows."""
    rows, seen = [], set()
    for name, module in model.blocks[0].named_modules():
        if not isinstance(module, Fp8Linear) or (module.in_features, module.out_features) in seen:
            continue
        seen.add((module.in_features, module.out_features))
        x = torch.randn(tokens, module.in_features, device=device, dtype=torch.bfloat16)
        x_q, x_scale = quantize_rowwise(x, fp8_dtype(device))
        flop = 2 * tokens * module.in_features * module.out_features
        with torch.inference_mode():
            whole = time_cuda_ms(lambda module=module, x=x: module(x), warmup=3, iters=10)
            gemm = time_cuda_ms(lambda module=module, x_q=x_q, s=x_scale: module.multiply(x_q, s), warmup=3, iters=10)
        rows.append(
            {
                "linear": name,
                "shape": f"{tokens}x{module.in_features}->{module.out_features}",
                "ms": whole,
                "gemm_ms": gemm,
                "tflops": flop / gemm / 1e9,
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="a14b-720p", choices=list(WORKLOADS))
    parser.add_argument("--attention", nargs="+", default=["fp8"], choices=["fp8", "sdpa"])
    parser.add_argument("--forwards", type=int, default=1, help="forwards profiled (their mean is reported)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment()
    print(env, flush=True)
    model, inputs, tokens = fp8_expert(args.workload, device)
    compile_blocks(model)
    fp8_attention = apply_fp8_attention(model, 0)
    rows = []
    for attention in args.attention:
        found, forward_ms = profile_forward(model, inputs, fp8_attention, attention, args.forwards)
        rows += found
        print(f"{attention}: forward {forward_ms:.0f} ms", flush=True)
    gemms = gemm_rates(model, tokens, device)
    write_json(
        args.out_dir,
        "forward_profile.json",
        {"environment": env, "workload": args.workload, "rows": rows, "gemms": gemms},
    )
    print_table(
        gemms,
        [
            ("linear", "linear", "s"),
            ("shape", "shape", "s"),
            ("ms", "quantize + GEMM ms", ".2f"),
            ("gemm_ms", "GEMM ms", ".2f"),
            ("tflops", "GEMM TFLOP/s", ".0f"),
        ],
    )
    print_table(
        rows,
        [
            ("attention", "attention", "s"),
            ("what", "kernels", "s"),
            ("kind", "kind", "s"),
            ("ms", "ms / forward", ".1f"),
            ("calls", "calls", "d"),
            ("share", "share", ".3f"),
        ],
    )


if __name__ == "__main__":
    main()
