"""Single-GPU speed of the FLUX.2 transformer: paradit bf16 eager, bf16 compiled, FP8 compiled (each compiled variant
also replayed from CUDA graphs), against diffusers eager and compiled (``compile_repeated_blocks``) on the same
weights, in one run.

Prints ms/step, MFU against the bf16 matmul rate measured in the same run, compile seconds, weight memory, the GPU
time share of a step (kernel time over wall time, from the profiler), and FP8's relative L2 against paradit bf16.

    python benchmarks/flux2_speed.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, measured_bf16_matmul_tflops, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.flux2_step import TFLOP_PER_STEP_1024, shared_weight_models, step_inputs  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.cuda_graphs import GraphedModule  # noqa: E402
from paradit.quantize import quantize_fp8  # noqa: E402


def gpu_time_share(run) -> float:
    """Kernel time over wall time for one call: how much of the step the GPU is busy rather than waiting on Python."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernel_us = sum(event.self_device_time_total for event in prof.key_averages())
    return kernel_us * 1e-6 / wall


def weight_gib(module: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30


def bench_model(name: str, args, matmul_tflops: float) -> list[dict]:
    device = torch.device("cuda")
    config, ours, reference = shared_weight_models(name, device)
    inputs = step_inputs(config, args.height, args.width, args.text_len, device)
    ref_inputs = {**inputs, "img_ids": inputs["img_ids"][None], "txt_ids": inputs["txt_ids"][None]}
    tflop = TFLOP_PER_STEP_1024.get(name)
    rows = []
    baseline = None

    def measure(impl: str, run, prepare=None):
        nonlocal baseline
        compile_s = None
        if prepare is not None:
            prepare()
        with torch.inference_mode():
            start = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            ms = time_cuda_ms(run, warmup=args.warmup, iters=args.iters)
            share = gpu_time_share(run)
            out = run().float()
        if prepare is not None:
            compile_s = first_s
        if baseline is None:
            baseline = out
        row = {
            "model": name, "impl": impl, "ms_per_step": ms, "compile_s": compile_s, "gpu_share": share,
            "weights_gib": weight_gib(ours if impl.startswith("paradit") else reference),
            "rel_l2_vs_paradit_bf16": ((out - baseline).norm() / baseline.norm()).item(),
        }  # fmt: skip
        if tflop:
            row["tflops"] = tflop / (ms * 1e-3)
            row["mfu_measured"] = row["tflops"] / matmul_tflops
        rows.append(row)
        print(f"{name} {impl}: {ms:.1f} ms/step, GPU share {share:.1%}, compile {compile_s}", flush=True)

    measure("paradit bf16 eager", lambda: ours(**inputs))
    measure("diffusers eager", lambda: reference(**ref_inputs, return_dict=False)[0])
    measure(
        "diffusers compiled",
        lambda: reference(**ref_inputs, return_dict=False)[0],
        prepare=lambda: reference.compile_repeated_blocks(fullgraph=True),
    )
    measure("paradit bf16 compiled", lambda: ours(**inputs), prepare=lambda: compile_blocks(ours))
    graphed = GraphedModule(ours)
    measure("paradit bf16 compiled+graphs", lambda: graphed(**inputs), prepare=lambda: None)
    measure("paradit fp8 compiled", lambda: ours(**inputs), prepare=lambda: quantize_fp8(ours, device))
    graphed = GraphedModule(ours)
    measure("paradit fp8 compiled+graphs", lambda: graphed(**inputs), prepare=lambda: None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flux2-dev", "flux2-klein-4b"])
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    env = environment()
    matmul = measured_bf16_matmul_tflops()
    print(f"{env['gpu']} torch {env['torch']} diffusers {env['diffusers']}; bf16 matmul {matmul:.0f} TFLOP/s")
    rows = []
    for name in args.models:
        rows += bench_model(name, args, matmul)
        torch.cuda.empty_cache()
        write_json(args.out_dir, "flux2_speed.json", {"env": env, "matmul_tflops": matmul, "rows": rows})
    print_table(
        rows,
        [
            ("model", "model", "s"), ("impl", "impl", "s"), ("ms_per_step", "ms/step", ".1f"),
            ("mfu_measured", "MFU", ".1%"), ("gpu_share", "GPU share", ".1%"), ("compile_s", "1st call s", ".0f"),
            ("weights_gib", "weights GiB", ".1f"), ("rel_l2_vs_paradit_bf16", "rel L2 vs bf16", ".1e"),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
