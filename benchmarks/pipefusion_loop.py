"""PipeFusion's two denoise loops on a FLUX.2 transformer: the plain loop (one call per step, the pipeline drained
at every step's end) against the patch-by-patch loop (``paradit.parallel.patch_loop``), with one process as the
reference.

Run under torchrun, one process per GPU (or CPU process): every rank builds the same random-weight model, the stages
split it. Each loop runs ``--steps`` Euler steps on the same inputs after one warm-up request; prints the median
step, the speedup over one process, what rank 0 sent per step, and the final latents' relative L2 between the loops
(they compute the same numbers, so it must be ~0) and against one process (the stale-K/V approximation).

    torchrun --nproc-per-node 2 benchmarks/pipefusion_loop.py --out-dir $OUT
    torchrun --nproc-per-node 2 benchmarks/pipefusion_loop.py --device cpu --model flux2-klein-4b --size 512 \\
        --blocks 4 --steps 6
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, init_dummy_weights, print_table, write_json  # noqa: E402
from benchmarks.flux2_step import step_inputs  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.flux2.model import Flux2Config, Flux2Transformer  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402
from paradit.parallel.mesh import ParallelContext, init_process_group  # noqa: E402
from paradit.parallel.parallelize import parallelize  # noqa: E402
from paradit.parallel.patch_loop import denoise_by_patches  # noqa: E402
from paradit.parallel.pipefusion import PipeFusion  # noqa: E402
from paradit.pipelines.base import (
    StepClock,  # noqa: E402
    token_band_mask,  # noqa: E402
)


def model_config(args) -> Flux2Config:
    config = dict(PRESETS[args.model].transformer)
    if args.blocks:  # a shorter stack (CPU smoke runs): the same block shapes, fewer of them
        config["num_layers"] = min(config["num_layers"], args.blocks)
        config["num_single_layers"] = args.blocks
    return Flux2Config.from_dict(config)


def build(config: Flux2Config, device: torch.device, dtype: torch.dtype) -> Flux2Transformer:
    with torch.device("meta"):
        model = Flux2Transformer(config)
    init_dummy_weights(model, device, dtype)  # same seed on every rank: identical weights
    if device.type == "cuda":
        compile_blocks(model)
    return model.eval()


def run_loop(model, inputs: dict, args, device, by_patches: bool) -> tuple[torch.Tensor, list[float]]:
    """One request of ``args.steps`` Euler steps; the final latents and each step's ms."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(args.steps, device=device)
    scheduler.set_begin_index(0)
    clock = StepClock(device)
    latents = inputs["hidden_states"]

    def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
        timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
        return transformer(**{**inputs, "hidden_states": latents, "timestep": timestep})

    if isinstance(model, PipeFusion):
        model.begin_request()
    with torch.inference_mode():
        if by_patches:
            latents = denoise_by_patches(
                predict, scheduler, latents, scheduler.timesteps, model, token_band_mask, clock.mark, False
            )
        else:
            clock.mark()
            for t in scheduler.timesteps:
                latents = scheduler.step(predict(latents, t, model), t, latents, return_dict=False)[0]
                clock.mark()
    return latents, clock.durations_ms()


def release_memory(device: torch.device) -> None:
    """The last model's weights go before the next one is built (two full-size copies would not fit)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux2-dev", choices=[n for n in PRESETS if n.startswith("flux2")])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=0, help="keep this many double and single blocks (0: all)")
    parser.add_argument("--patches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tag", default="pipefusion_loop")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    init_process_group(device, rank, world, "env://")
    config = model_config(args)
    inputs = step_inputs(config, args.size, args.size, args.text_tokens, device)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

    def measure(runner, by_patches: bool) -> tuple[torch.Tensor, float]:
        run_loop(runner, inputs, args, device, by_patches)  # warm-up request (compilation, buffers)
        dist.barrier()
        latents, steps_ms = run_loop(runner, inputs, args, device, by_patches)
        # Steps after the warm-up steps: the patched ones, whose speed the loop decides.
        return latents.float(), statistics.median(steps_ms[1:])

    serial, serial_ms = measure(build(config, device, dtype), False)
    release_memory(device)
    rows = [{"plan": "1 process", "loop": "-", "ms_per_step": serial_ms, "speedup": 1.0, "rel_l2_vs_1": 0.0}]
    for patches in args.patches:
        plan = ParallelConfig(pipefusion=world, patches=patches, warmup_steps=1)
        context = ParallelContext.build(plan, device)
        # A fresh model each time (the same seed: the same weights): the stages drop the blocks they do not run.
        pipelined = parallelize(build(config, device, dtype), None, context).forward
        results = {}
        for by_patches in (True, False):
            context.stats.reset()
            latents, ms = measure(pipelined, by_patches)
            results[by_patches] = latents
            rows.append(
                {
                    "plan": plan.describe(),
                    "loop": "patch by patch" if by_patches else "plain",
                    "ms_per_step": ms,
                    "speedup": serial_ms / ms,
                    "mib_sent": sum(context.stats.bytes_sent.values()) / 2**20 / args.steps / 2,
                    "rel_l2_vs_1": ((latents - serial).norm() / serial.norm()).item(),
                }
            )
            if rank == 0:  # as measured: a run cut short by a time limit still reports what it got
                print(
                    f"{rows[-1]['plan']}, {rows[-1]['loop']} loop: {ms:.1f} ms/step (1 process {serial_ms:.1f})",
                    flush=True,
                )
        rows[-1]["rel_l2_between_loops"] = ((results[True] - results[False]).norm() / results[False].norm()).item()
        del pipelined
        release_memory(device)
    if rank == 0:
        env = environment() if device.type == "cuda" else {"gpu": "cpu", "torch": torch.__version__}
        print(
            f"{env['gpu']} x{world}; {args.model}, {args.size}x{args.size}, {args.steps} steps (1 warm-up); "
            f"NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', 'unset')}"
        )
        print_table(
            rows,
            [
                ("plan", "plan", "s"),
                ("loop", "loop", "s"),
                ("ms_per_step", "ms/step", ".1f"),
                ("speedup", "vs 1 process", ".2f"),
                ("mib_sent", "MiB sent/step", ".1f"),
                ("rel_l2_vs_1", "rel L2 vs 1 process", ".1e"),
                ("rel_l2_between_loops", "rel L2 between loops", ".1e"),
            ],
        )
        write_json(args.out_dir, f"{args.tag}.json", {"env": env, "args": vars(args), "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
