"""Whole requests on 2 GPUs capped at a per-GPU memory budget (32 GB cards emulated on H200s), against one uncapped
GPU running the same model with the same execution options.

For each model and each plan (default PipeFusion 2, tensor 2, Ulysses 2; any ParallelConfig, as
``--plans pipefusion=2,ulysses=2 ulysses=4`` on 4 GPUs), in bf16 and in FP8, the engine is built with
``max_gpu_memory``: a plan whose estimate does not fit is refused before anything loads, and the refusal (with its
numbers) is the row. A plan that runs reports the median denoise step, bytes rank 0 sent per step, every rank's peak
memory, where the prompt encoders were placed, text-encode and decode seconds, and its speed over the uncapped GPU.
Each plan runs with NVLink and with ``NCCL_P2P_DISABLE=1`` (the PCIe-like regime). Dummy weights, end to end: text
encoders, transformer and VAE.

    python benchmarks/memory_pooling.py --out-dir $OUT
    python benchmarks/memory_pooling.py --device cpu --models flux2-tiny --quantize none --cap 2GiB --size 64
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, write_json  # noqa: E402
from paradit import Engine, GenerationRequest  # noqa: E402
from paradit.errors import ParaditError  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402

DEFAULT_PLANS = ["pipefusion=2,patches=2", "tensor=2", "ulysses=2"]


def parse_plan(text: str) -> ParallelConfig:
    """'pipefusion=2,ulysses=2,patches=2' -> ParallelConfig; the keys are ParallelConfig's fields."""
    fields = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        fields[key.strip()] = value.strip() if key.strip() == "comm_dtype" else int(value)
    return ParallelConfig(**fields)


def run_one(model: str, parallel: ParallelConfig | None, quantize: str, cap: str | None, regime: str, args) -> dict:
    """One engine: built (or refused), one request timed, closed, and its memory in this process given back (the
    uncapped one-GPU engine runs here, beside the next plan's workers)."""
    try:
        return measure_one(model, parallel, quantize, cap, regime, args)
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def measure_one(model: str, parallel: ParallelConfig | None, quantize: str, cap: str | None, regime: str, args) -> dict:
    os.environ.pop("NCCL_P2P_DISABLE", None)
    if regime == "p2p-off":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # spawned workers inherit it before NCCL starts
    plan_name = parallel.describe() if parallel else "1 GPU"
    row = {"model": model, "plan": plan_name, "quantize": quantize, "cap": cap or "none", "regime": regime}
    request = GenerationRequest(
        prompt="a lighthouse on a cliff at dusk", height=args.size, width=args.size, steps=args.steps, seed=0
    )
    start = time.perf_counter()
    try:
        with Engine(
            model,
            device=args.device,
            load_format="dummy",
            parallel=parallel,
            options=ExecutionOptions(quantize=quantize),
            max_gpu_memory=cap,
        ) as engine:
            row["load_s"] = time.perf_counter() - start
            # The first request compiles the blocks for every shape they meet (PipeFusion's whole warm-up step and
            # each patch's shape, met in its first patched steps): the second is timed.
            start = time.perf_counter()
            engine.generate(request)
            row["first_request_s"] = time.perf_counter() - start
            result = engine.generate(request)
    except ParaditError as exc:  # a refused plan (with its numbers) or a failed worker is the row's result
        row["refused"] = str(exc).splitlines()[0]
        print(f"{model} {plan_name} {quantize} cap {cap} {regime}: {row['refused']}", flush=True)
        return row
    except Exception as exc:  # noqa: BLE001 - one plan failing in-process must not lose the other rows
        row["refused"] = f"failed: {type(exc).__name__}: {exc}"
        print(f"{model} {plan_name} {quantize} cap {cap} {regime}: {row['refused']}", flush=True)
        return row
    t = result.timings
    row.update(
        ms_per_step=t.median_step_ms,
        step_ms=t.step_ms,
        mib_sent=t.comm_bytes_per_step / 2**20,
        peak_gib=[b / 2**30 for b in t.peak_memory_per_rank] or [t.peak_memory_bytes / 2**30],
        text_encoders=t.text_encoders,
        text_encode_s=t.text_encode_s,
        decode_s=t.vae_decode_s,
        total_s=t.total_s,
    )
    peaks = " ".join(f"{p:.1f}" for p in row["peak_gib"])
    print(
        f"{model} {plan_name} {quantize} cap {cap} {regime}: {t.median_step_ms:.1f} ms/step, peak GiB {peaks}, "
        f"text encoders {t.text_encoders}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flux2-dev", "qwen-image"])
    parser.add_argument("--plans", nargs="+", default=DEFAULT_PLANS, help="ParallelConfig fields, e.g. tensor=2")
    parser.add_argument("--quantize", nargs="+", default=["none", "fp8"], choices=["none", "fp8"])
    parser.add_argument("--regimes", nargs="+", default=["nvlink", "p2p-off"], choices=["nvlink", "p2p-off"])
    parser.add_argument("--cap", default="32GiB")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on gloo")
    parser.add_argument("--tag", default="memory_pooling")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    env = environment() if args.device == "cuda" else {"gpu": "cpu"}
    rows = []
    for model in args.models:
        for quantize in args.quantize:
            baseline = run_one(model, None, quantize, None, "nvlink", args)
            rows.append(baseline)
            for regime in args.regimes:
                for plan in args.plans:
                    row = run_one(model, parse_plan(plan), quantize, args.cap, regime, args)
                    if row.get("ms_per_step") and baseline.get("ms_per_step"):
                        row["speedup_vs_1gpu_uncapped"] = baseline["ms_per_step"] / row["ms_per_step"]
                    rows.append(row)
                    write_json(args.out_dir, f"{args.tag}.json", {"env": env, "args": vars(args), "rows": rows})
    for row in rows:
        row["peaks"] = " ".join(f"{p:.1f}" for p in row.get("peak_gib", []))
        if "refused" in row:  # the table keeps the head of the reason; the JSON has all of it
            row["refused_head"] = row["refused"][:90]
    print(f"{env['gpu']}; cap {args.cap} per GPU; {args.size}x{args.size}, median of {args.steps} steps")
    print_table(
        rows,
        [
            ("model", "model", "s"),
            ("plan", "plan", "s"),
            ("quantize", "weights", "s"),
            ("cap", "cap", "s"),
            ("regime", "link", "s"),
            ("ms_per_step", "ms/step", ".1f"),
            ("speedup_vs_1gpu_uncapped", "vs 1 GPU", ".2f"),
            ("mib_sent", "MiB/step", ".0f"),
            ("peaks", "peak GiB per rank", "s"),
            ("text_encoders", "text enc.", "s"),
            ("text_encode_s", "encode s", ".1f"),
            ("refused_head", "refused", "s"),
        ],
    )


if __name__ == "__main__":
    main()
