"""One transformer step of each image family on 1 GPU and split over the group: CFG parallel, Ulysses, Ring, each
in eager, compiled, compiled + CUDA graphs, and FP8 (compiled + graphs) execution.

Run under torchrun, one process per GPU; every rank builds the same full-size model with random weights. Models
with classifier-free guidance run their two branches as a batch of 2 on one GPU and one branch per rank under CFG
parallel (one all-gather of the prediction); the sequence plans split that same batch's tokens. Prints ms/step on
rank 0, the speedup over one GPU in the same execution mode, the share of the step rank 0's GPU spends computing
(kernel time without NCCL's, over the step's time), what rank 0 sent per step, and the relative L2 against the
one-GPU output of that mode.

    torchrun --nproc-per-node 2 benchmarks/parallel_step.py --out-dir $OUT
    python benchmarks/parallel_step.py --device cpu --models qwen-image-tiny --modes eager  (a smoke run, 1 process)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    environment,
    init_dummy_weights,
    kernel_ms,
    local_attention_again,  # noqa: E402
    print_table,
    quantize_fp8,
    time_cuda_ms,
    write_json,
)
from paradit.compile import compile_blocks  # noqa: E402
from paradit.cuda_graphs import GraphedModule  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402
from paradit.parallel.cfg import SplitBranches  # noqa: E402
from paradit.parallel.mesh import ParallelContext, init_process_group  # noqa: E402
from paradit.parallel.parallelize import parallelize  # noqa: E402

# preset family -> (benchmark module with step_inputs, text tokens)
BENCHES = {
    "flux2": ("benchmarks.flux2_step", 512),
    "flux3": ("benchmarks.flux3_step", 160),
    "qwen_image": ("benchmarks.qwen_image_step", 256),
    "qwen_image21": ("benchmarks.qwen_image21_step", 32),
    "zimage": ("benchmarks.zimage_step", 256),
    "sd3": ("benchmarks.sd3_step", 333),
}


def build(name: str, device: torch.device, size: int):
    spec = PRESETS[name]
    bench_module, text_len = BENCHES[spec.family]
    family = FAMILIES[spec.family]
    with torch.device("meta"):
        model = family.build_transformer(spec)
    init_dummy_weights(model, device, torch.bfloat16)  # same seed on every rank: identical weights
    if family.after_dummy_init is not None:
        family.after_dummy_init(model)
    inputs = importlib.import_module(bench_module).step_inputs(model.config, size, size, text_len, device)
    batch = 2 if spec.guidance_mode == "cfg" else 1
    return model.eval(), inputs, batch


def with_batch(inputs, batch: int):
    """The inputs with ``batch`` copies of their first sample. Per-sample tensors lead with a batch of 1; the others
    (FLUX.2's position ids) are shared by the batch and stay as they are."""

    def grow(value):
        if not isinstance(value, torch.Tensor) or value.shape[0] != 1:
            return value
        return value[:1].expand(batch, *value.shape[1:]).contiguous()

    if isinstance(inputs, dict):
        return {key: grow(value) for key, value in inputs.items()}
    return tuple(grow(value) for value in inputs)


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def timed(run, args, device) -> float:
    dist.barrier()
    with torch.inference_mode():
        if device.type == "cuda":
            return time_cuda_ms(run, warmup=args.warmup, iters=args.iters)
        run()
        start = time.perf_counter()
        for _ in range(args.iters):
            run()
        return (time.perf_counter() - start) / args.iters * 1000


# Execution modes, in the order they run: each adds to the last (the blocks compiled once; graphs per runner; FP8
# linears swapped in last, for which the compiled blocks recompile).
MODES = ("eager", "compiled", "graphs", "fp8")


def sequence_plans(world: int, has_cfg: bool, comm_dtypes: list[str]) -> list[ParallelConfig]:
    """CFG parallel first where the model has two branches, then every Ulysses x Ring split of the rest (Ulysses
    alone, USP, Ring alone), each in every transport asked for."""
    plans = []
    for cfg in (2, 1) if has_cfg and world % 2 == 0 else (1,):
        sequence = world // cfg
        for ring in (r for r in range(1, sequence + 1) if sequence % r == 0):
            if sequence == 1:
                plans.append(ParallelConfig(cfg=cfg))
                continue
            plans += [ParallelConfig(cfg=cfg, ulysses=sequence // ring, ring=ring, comm_dtype=c) for c in comm_dtypes]
    return plans


def bench_model(name: str, args, device: torch.device, world: int) -> list[dict]:
    model, one_branch, batch = build(name, device, args.size)
    inputs = with_batch(one_branch, batch)
    rows = []
    plans = sequence_plans(world, batch == 2, args.comm_dtypes)

    def record(plan: str, mode: str, run, serial, context=None):
        try:
            ms = timed(run, args, device)
            compute = kernel_ms(run, include_communication=False) / ms if device.type == "cuda" else None
            if context is not None:
                context.stats.reset()
            with torch.inference_mode():
                out = run().float()
        except Exception as exc:  # noqa: BLE001 - one plan failing must not lose the others' figures
            if dist.get_rank() == 0:
                print(f"{name} {plan} {mode}: FAILED {type(exc).__name__}: {exc}", flush=True)
            rows.append({"model": name, "plan": plan, "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
            return None
        error = ((out - serial).norm() / serial.norm()).item() if serial is not None else 0.0
        # A graph replay skips the host code that counts bytes: graphed rows leave it to their compiled twin.
        counted = context is not None and mode in ("eager", "compiled")
        sent = sum(context.stats.bytes_sent.values()) / 2**20 if counted else None
        rows.append(
            {
                "model": name,
                "plan": plan,
                "mode": mode,
                "ms_per_step": ms,
                "mib_sent": sent,
                "compute_share": compute,
                "rel_l2_vs_1gpu": error,
            }
        )
        if dist.get_rank() == 0:
            print(f"{name} {plan} {mode}: {ms:.1f} ms/step, rel L2 {error:.1e}", flush=True)
        return out

    compiled = False
    for mode in sorted(args.modes, key=MODES.index):
        local_attention_again(model)
        if mode != "eager" and not compiled:
            compile_blocks(model)
            compiled = True
        if mode == "fp8":
            quantize_fp8(model, device, FAMILIES[PRESETS[name].family].keep_high_precision)
        graphs = mode in ("graphs", "fp8")
        single = GraphedModule(model) if graphs else model
        serial = record("1 GPU", mode, lambda single=single: call(single, inputs), None)
        for plan in plans:
            context = ParallelContext.build(plan, device)
            runner = single
            if plan.sequence_degree > 1:
                local_attention_again(model)  # the previous plan's attention swap, undone
                parallel = parallelize(model, None, context).forward
                runner = GraphedModule(parallel) if graphs else parallel
            if plan.cfg == 2:
                branches = SplitBranches(context)

                # each rank's half of the [cond; uncond] batch: one branch (both branches hold the same values here)
                def run(branches=branches, runner=runner):
                    return branches.combine(call(runner, one_branch))
            else:

                def run(runner=runner):
                    return call(runner, inputs)

            record(plan.describe(), mode, run, serial, context)
            del runner
        del single
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flux2-dev", "qwen-image", "z-image-turbo", "sd3.5-large"])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=list(MODES[1:]), choices=MODES)
    parser.add_argument(
        "--comm-dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", "fp8"],
        help="sequence plans' transport: each listed one is measured",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tag", default="nvlink")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    )
    init_process_group(device, rank, world, "env://")
    rows = []
    for name in args.models:
        rows += bench_model(name, args, device, world)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        one_gpu = {(row["model"], row["mode"]): row.get("ms_per_step") for row in rows if row["plan"] == "1 GPU"}
        for row in rows:
            if row.get("ms_per_step") and one_gpu.get((row["model"], row["mode"])):
                row["speedup_vs_1gpu"] = one_gpu[(row["model"], row["mode"])] / row["ms_per_step"]
        env = environment() if device.type == "cuda" else {}
        print(f"{env.get('gpu', 'cpu')} x{world}; NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', 'unset')}")
        print_table(
            rows,
            [
                ("model", "model", "s"),
                ("plan", "plan", "s"),
                ("mode", "mode", "s"),
                ("ms_per_step", "ms/step", ".1f"),
                ("speedup_vs_1gpu", "vs 1 GPU", ".2f"),
                ("compute_share", "GPU computing", ".1%"),
                ("mib_sent", "MiB sent/step", ".0f"),
                ("rel_l2_vs_1gpu", "rel L2 vs 1 GPU", ".1e"),
            ],
        )
        write_json(args.out_dir, f"parallel_step_{args.tag}.json", {"env": env, "args": vars(args), "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
