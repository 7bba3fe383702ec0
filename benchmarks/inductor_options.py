"""Inductor's options against the Wan expert's fused kernels: the first blocks of Wan 2.2 A14B (random weights, FP8
linears, compiled blocks, FP8 attention) compiled under each set of options in turn, timed, and profiled, with the
Inductor kernels listed by name. The row reductions of a block (layer norms, RMS norms, FP8 quantization of rows of
5,120 and 13,824) are past Inductor's persistent-reduction threshold of 1,024, so by default it loops over each row
two or three times; ``triton.multi_kernel`` also generates the single-pass kernel and keeps the faster by timing.

    python benchmarks/inductor_options.py --blocks 8 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.forward_profile import fp8_expert, kernel_times, kind_of  # noqa: E402
from benchmarks.wan_step import WORKLOADS  # noqa: E402
from paradit.compile import RECOMPILE_LIMIT, model_blocks  # noqa: E402
from paradit.layers.attention import apply_fp8_attention  # noqa: E402

VARIANTS = {
    "default": {"triton.multi_kernel": 0},
    "multi_kernel": {"triton.multi_kernel": 1},
    "coordinate_descent": {"coordinate_descent_tuning": True},
    "multi_kernel+coordinate_descent": {"triton.multi_kernel": 1, "coordinate_descent_tuning": True},
}
TOP_KERNELS = 10


def measure(model, inputs, options: dict, blocks: int) -> tuple[dict, list[dict]]:
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    for block in model_blocks(model):  # as ``compile_blocks`` does, with these options
        block.compile(dynamic=False, options=options)
    with torch.inference_mode():
        start = time.perf_counter()
        model(*inputs)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        forward_ms = time_cuda_ms(lambda: model(*inputs), warmup=1, iters=3)
        kernels = kernel_times(model, inputs, forwards=1)
    inductor = sorted((k for k in kernels if kind_of(k[0]) == "Inductor fused"), key=lambda k: -k[1])
    summary = {
        "forward_ms": forward_ms,
        "first_call_s": first_s,
        "per_block_ms": forward_ms / blocks,
        "inductor_ms_per_block": sum(ms for _, ms, _ in inductor) / blocks,
        "attention_ms_per_block": sum(ms for n, ms, _ in kernels if kind_of(n).startswith("self-attention")) / blocks,
        "gemm_ms_per_block": sum(ms for n, ms, _ in kernels if kind_of(n) == "FP8 GEMM") / blocks,
    }
    top = [{"kernel": name[:100], "ms_per_block": ms / blocks} for name, ms, _ in inductor[:TOP_KERNELS]]
    return summary, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="a14b-720p", choices=list(WORKLOADS))
    parser.add_argument("--blocks", type=int, default=8, help="the model's first blocks kept (40 in A14B)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment()
    print(env, flush=True)
    model, inputs, _ = fp8_expert(args.workload, device, args.blocks)
    apply_fp8_attention(model, 0).fp8_now = True
    rows, kernels = [], []
    for name in args.variants:
        summary, top = measure(model, inputs, VARIANTS[name], args.blocks)
        rows.append({"variant": name, **summary})
        kernels += [{"variant": name, **k} for k in top]
        print(rows[-1], flush=True)
        for k in top:
            print(f"    {k['ms_per_block']:7.3f} ms  {k['kernel']}", flush=True)
    write_json(
        args.out_dir,
        "inductor_options.json",
        {"environment": env, "workload": args.workload, "blocks": args.blocks, "rows": rows, "kernels": kernels},
    )
    print_table(
        kernels,
        [("variant", "variant", "s"), ("kernel", "Inductor kernel", "s"), ("ms_per_block", "ms / block", ".3f")],
    )
    print_table(
        rows,
        [
            ("variant", "variant", "s"),
            ("first_call_s", "first call s", ".1f"),
            ("per_block_ms", "ms / block", ".1f"),
            ("inductor_ms_per_block", "Inductor ms / block", ".2f"),
            ("attention_ms_per_block", "attention ms / block", ".1f"),
            ("gemm_ms_per_block", "GEMM ms / block", ".1f"),
        ],
    )


if __name__ == "__main__":
    main()
