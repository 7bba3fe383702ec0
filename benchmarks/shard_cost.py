"""What the sharded-weights path costs on one GPU (``--shard-weights 1``): each block gathered by FSDP2 over a group
of one before it runs, against the same transformer unsharded. Both load through ``runtime.load_transformer`` with
random weights; one transformer forward at the preset's size (a batch of 2 for models with CFG), in eager and
compiled execution, bf16 and FP8. Prints ms per forward (median of ``--iters`` after 3 warm-up calls), the cost of
the gather path, the memory resident before a forward and the peak during one; the JSON holds the rows and the
environment.

    python benchmarks/shard_cost.py --out-dir $OUT
    python benchmarks/shard_cost.py --models flux2-klein-4b --modes eager
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.parallel_step import BENCHES, with_batch  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402
from paradit.parallel.mesh import ParallelContext, init_process_group  # noqa: E402
from paradit.runtime import load_transformer  # noqa: E402
from paradit.spec import RandomWeights  # noqa: E402


def forward_row(name: str, mode: str, quantize: str, sharded: bool, context: ParallelContext, iters: int) -> dict:
    row = measure(name, mode, quantize, sharded, context, iters)
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def measure(name: str, mode: str, quantize: str, sharded: bool, context: ParallelContext, iters: int) -> dict:
    device = context.device
    spec = dataclasses.replace(PRESETS[name], weights=RandomWeights())
    family = FAMILIES[spec.family]
    options = ExecutionOptions(quantize=quantize, compile=mode == "compiled")
    loaded = load_transformer(family, spec, device, torch.bfloat16, context if sharded else None, options)
    forward = loaded.forward
    bench_module, text_len = BENCHES[spec.family]
    inputs = importlib.import_module(bench_module).step_inputs(
        loaded.model.config, spec.height, spec.width, text_len, device
    )
    inputs = with_batch(inputs, 2 if spec.guidance_mode == "cfg" else 1)

    def run():
        with torch.inference_mode():
            return forward(**inputs) if isinstance(inputs, dict) else forward(*inputs)

    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = time_cuda_ms(run, warmup=3, iters=iters)
    row = dict(
        model=name,
        mode=mode,
        precision=quantize.replace("none", "bf16"),
        weights="shard 1" if sharded else "whole",
        ms=ms,
        resident_gib=resident / 2**30,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["flux2-dev", "qwen-image"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--precisions", nargs="+", default=["none", "fp8"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as folder:
        init_process_group(device, 0, 1, f"file://{folder}/rendezvous")
        context = ParallelContext.build(ParallelConfig(shard_weights=1), device)
        rows = []
        for name in args.models:
            for mode in args.modes:
                for quantize in args.precisions:
                    whole = forward_row(name, mode, quantize, False, context, args.iters)
                    sharded = forward_row(name, mode, quantize, True, context, args.iters)
                    sharded["cost"] = sharded["ms"] / whole["ms"] - 1
                    rows += [whole, sharded]
                    print_table(rows[-2:], COLUMNS)
        dist.destroy_process_group()
    print()
    print_table(rows, COLUMNS)
    write_json(args.out_dir, "shard_cost.json", {"environment": environment(), "rows": rows})


COLUMNS = [
    ("model", "model", ""),
    ("mode", "mode", ""),
    ("precision", "precision", ""),
    ("weights", "weights", ""),
    ("ms", "ms/forward", ".1f"),
    ("cost", "gather cost", "+.1%"),
    ("resident_gib", "resident GiB", ".2f"),
    ("peak_gib", "peak GiB", ".2f"),
]

if __name__ == "__main__":
    main()
