"""Shared pieces of the GPU benchmarks: the measured matmul ceiling, event timing, and the result table.

Run on the device machine; these scripts print a table last and write JSON under the folder they are given.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from paradit.families import FAMILIES
from paradit.layers.attention import AttentionDispatch, sdpa_attention
from paradit.layers.fp8 import check_fp8_supported, fp8_dtype
from paradit.machine import Machine
from paradit.memory import MemoryPlan, estimates
from paradit.parallel import ParallelConfig
from paradit.quantize import convert_fp8
from paradit.request import GenerationRequest
from paradit.settings import Asked, choices
from paradit.spec import ModelSpec
from paradit.weights import DummyTensors, ModelNames, materialize

# The noise level every single-step measurement runs at (the middle of a flow-matching schedule).
MID_SIGMA = 0.5


@dataclass
class ModelPair:
    """paradit's transformer and diffusers' on the very same weights, with one step's inputs bound.

    ``step_ours(model, latents, sigma)`` calls ``model`` (paradit's transformer, or a compiled, graphed or
    parallel wrapper of it) on ``latents`` at noise level ``sigma`` with the bound text inputs; ``run_reference``
    runs diffusers on ``latents`` at ``MID_SIGMA``; both return the prediction in the layout of ``latents``.
    ``tflop`` is the exact FLOPs of one step at the reference workload, else None.
    """

    name: str
    ours: nn.Module
    reference: nn.Module
    run_reference: Callable[[], torch.Tensor]
    step_ours: Callable[[nn.Module, torch.Tensor, float], torch.Tensor]
    latents: torch.Tensor
    tokens: int
    tflop: float | None

    def run_ours(self, model: nn.Module | None = None) -> torch.Tensor:
        """One step of ``model`` (default: paradit's plain transformer) on the bound inputs."""
        return self.step_ours(self.ours if model is None else model, self.latents, MID_SIGMA)


def local_attention_again(model: nn.Module) -> None:
    """Every attention of ``model`` back to local SDPA. ``parallelize`` acts on a model in place and for good; the
    benchmarks time several plans on one full-size model (a copy per plan would not fit), so they undo its swap."""
    for module in model.modules():
        if isinstance(module, AttentionDispatch):
            module.set_attention_fn(sdpa_attention)


def init_dummy_weights(module: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Random weights (``DummyTensors``) for a plain module: the same on every rank for the same seed."""
    buffers = {name for name, _ in module.named_buffers()}
    materialize(module, ModelNames(module), DummyTensors(device, dtype, buffers, seed))


def quantize_fp8(model: nn.Module, device: torch.device, keep: tuple[str, ...]) -> list[str]:
    """``convert_fp8`` into the format ``device`` multiplies (a loaded model)."""
    check_fp8_supported(device)
    return convert_fp8(model, fp8_dtype(device), keep)


def measured_bf16_matmul_tflops(size: int = 8192, iters: int = 10) -> float:
    """The device's bf16 matmul rate on random data: the ceiling MFU is reported against."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = time_cuda_ms(lambda: a @ b, warmup=0, iters=iters)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def time_cuda_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """``time_cuda_ms`` on a GPU; on the CPU the median of ``iters`` wall-clock runs after ``warmup`` runs."""
    if device.type == "cuda":
        return time_cuda_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def kernel_ms(run, include_communication: bool = True) -> float:
    """Milliseconds of kernels one call launches (the profiler's device time): busy time, not wall time. NCCL's
    kernels count as busy while they wait for a peer, so a parallel step's share of *computing* leaves them out."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if include_communication or "nccl" not in e.key.lower()]
    return sum(event.self_device_time_total for event in events) / 1000


def environment() -> dict:
    import diffusers
    import transformers

    return {
        "gpu": torch.cuda.get_device_name(),
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """``columns``: (key, header, format spec)."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([format(row[key], spec) if row.get(key) is not None else "-" for key, _, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def write_json(out_dir: str | None, name: str, payload: dict) -> None:
    if out_dir:
        path = Path(out_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def compare_pair(pair: ModelPair, matmul_tflops: float, warmup: int, iters: int) -> list[dict]:
    """Time paradit and diffusers on the same weights and compare their outputs: one row each with ms/step,
    TFLOP/s and MFU (when the step's FLOPs are known), peak memory, and the relative L2 between them."""
    name, tokens, tflop = pair.name, pair.tokens, pair.tflop
    runners = {"paradit": pair.run_ours, "diffusers": pair.run_reference}
    rows, outputs = [], {}
    for impl, run in runners.items():
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            ms = time_cuda_ms(run, warmup=warmup, iters=iters)
            outputs[impl] = run().float()
        row = {
            "model": name,
            "impl": impl,
            "tokens": tokens,
            "ms_per_step": ms,
            "tflop_per_step": tflop,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        if tflop:
            row["tflops"] = tflop / (ms * 1e-3)
            row["mfu_measured"] = row["tflops"] / matmul_tflops
        rows.append(row)
    diff = (outputs["paradit"] - outputs["diffusers"]).norm() / outputs["diffusers"].norm()
    for row in rows:
        row["rel_l2_vs_diffusers"] = diff.item()
    rows[0]["speedup_vs_diffusers"] = rows[1]["ms_per_step"] / rows[0]["ms_per_step"]
    return rows


def single_gpu_parser(description: str, models: list[str]):
    """The options every single-GPU benchmark takes: models, image size, warm-up and timed iterations, output."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=models)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out-dir", default=None)
    return parser


def announce_device() -> tuple[dict, float]:
    """The environment and the measured bf16 matmul rate, printed as the run's first line."""
    env = environment()
    matmul = measured_bf16_matmul_tflops()
    print(f"{env['gpu']} torch {env['torch']} diffusers {env['diffusers']}; bf16 matmul {matmul:.0f} TFLOP/s")
    return env, matmul


def step_benchmark_main(description: str, model_pair, models: list[str], text_len: int, json_name: str) -> None:
    """The command line every per-family step script shares: build ``model_pair(name, args, device)`` for each
    model, compare paradit with diffusers on it, print the table, write ``json_name`` under ``--out-dir``."""
    parser = single_gpu_parser(description, models)
    parser.add_argument("--text-len", type=int, default=text_len)
    args = parser.parse_args()
    env, matmul = announce_device()
    rows = []
    for name in args.models:
        rows += compare_pair(model_pair(name, args, torch.device("cuda")), matmul, args.warmup, args.iters)
        torch.cuda.empty_cache()  # the pair's weights are freed once it is dropped
    print_table(
        rows,
        [
            ("model", "model", "s"),
            ("impl", "impl", "s"),
            ("ms_per_step", "ms/step", ".1f"),
            ("tflops", "TFLOP/s", ".0f"),
            ("mfu_measured", "MFU", ".1%"),
            ("peak_gib", "peak GiB", ".1f"),
            ("speedup_vs_diffusers", "vs diffusers", ".2f"),
            ("rel_l2_vs_diffusers", "rel L2", ".1e"),
        ],
    )
    write_json(args.out_dir, json_name, {"env": env, "matmul_tflops": matmul, "args": vars(args), "rows": rows})


def estimate(
    spec: ModelSpec,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    fp8: bool,
    placement: str = "gpu",
    swap_experts: bool = False,
    compiled: bool = False,
    extra_tokens: int = 0,
) -> MemoryPlan:
    """One placement's ``memory.estimates`` (``extra_tokens``: what a request's inputs add, its references)."""
    return estimates(spec, parallel, dtype, fp8, swap_experts, compiled=compiled, extra_tokens=extra_tokens)[placement]


def default_plan_for(
    spec: ModelSpec, gpus: int, request: GenerationRequest | None = None, device: str | torch.device | None = None
) -> ParallelConfig:
    """The plan ``--gpus N`` alone gets (``settings.choices``)."""
    resolved = None if request is None else FAMILIES[spec.family].resolve_request(spec, request)
    return choices(Asked(spec, device, gpus=gpus), spec, resolved, Machine.detect())[0]
