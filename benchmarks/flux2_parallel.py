"""FLUX.2 transformer step split across GPUs: paradit's Ulysses and Ring against diffusers' context parallelism.

Run under torchrun, one process per GPU; every rank holds the full-size model with random weights (the diffusers
model is handed the same tensors). For each plan it prints ms/step on rank 0, the speedup over one GPU, the bytes
rank 0 sent per step, and the relative L2 of the parallel output against paradit's one-GPU output.

    torchrun --nproc-per-node 2 benchmarks/flux2_parallel.py --out-dir $OUT
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/flux2_parallel.py --out-dir $OUT --tag p2p-off
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    environment,
    init_dummy_weights,
    local_attention_again,  # noqa: E402
    print_table,
    time_cuda_ms,
    write_json,
)
from benchmarks.flux2_step import step_inputs  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.flux2.model import Flux2Config, Flux2Transformer  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402
from paradit.parallel.mesh import ParallelContext, init_process_group  # noqa: E402
from paradit.parallel.parallelize import parallelize  # noqa: E402


def timed(run, args) -> float:
    dist.barrier()
    with torch.inference_mode():
        return time_cuda_ms(run, warmup=args.warmup, iters=args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux2-dev")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tag", default="nvlink")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_process_group(device, rank, world, "env://")
    config = Flux2Config.from_dict(PRESETS[args.model].transformer)
    with torch.device("meta"):
        model = Flux2Transformer(config)
    init_dummy_weights(model, device, torch.bfloat16)  # same seed on every rank: identical weights
    model.eval()
    inputs = step_inputs(config, args.height, args.width, args.text_len, device)
    rows = []

    def record(impl: str, plan: str, ms: float, output: torch.Tensor, reference: torch.Tensor, sent: int | None):
        error = ((output.float() - reference.float()).norm() / reference.float().norm()).item()
        rows.append({"impl": impl, "plan": plan, "ms_per_step": ms, "rel_l2_vs_1gpu": error, "mib_sent_per_step": sent})
        if rank == 0:
            print(f"{impl} {plan}: {ms:.1f} ms/step, rel L2 vs 1 GPU {error:.1e}", flush=True)

    with torch.inference_mode():
        serial = model(**inputs)
    record("paradit", "1 GPU", timed(lambda: model(**inputs), args), serial, serial, None)
    for plan in (ParallelConfig(ulysses=world), ParallelConfig(ring=world)):
        context = ParallelContext.build(plan, device)
        local_attention_again(model)
        parallel = parallelize(model, None, context).forward
        ms = timed(lambda parallel=parallel: parallel(**inputs), args)
        context.stats.reset()
        with torch.inference_mode():
            out = parallel(**inputs)
        record("paradit", plan.describe(), ms, out, serial, sum(context.stats.bytes_sent.values()) / 2**20)
    local_attention_again(model)

    from diffusers import ContextParallelConfig, Flux2Transformer2DModel

    def diffusers_model():
        with torch.device("meta"):
            reference = Flux2Transformer2DModel(**PRESETS[args.model].transformer)
        reference.load_state_dict(model.state_dict(), assign=True, strict=True)
        return reference.eval()

    ref_inputs = {**inputs, "img_ids": inputs["img_ids"][None], "txt_ids": inputs["txt_ids"][None]}
    reference = diffusers_model()
    with torch.inference_mode():
        out = reference(**ref_inputs, return_dict=False)[0]
    record("diffusers", "1 GPU", timed(lambda: reference(**ref_inputs, return_dict=False)[0], args), out, serial, None)
    diffusers_plans = {"ulysses": {"ulysses_degree": world}, "ring": {"ring_degree": world}}
    for name, degrees in diffusers_plans.items():
        reference = diffusers_model()
        # diffusers' ring needs a backend that returns the log-sum-exp; its cuDNN SDPA backend does, and cuDNN is
        # also what SDPA runs on Hopper, so both of its plans use it.
        reference.set_attention_backend("_native_cudnn")
        reference.enable_parallelism(config=ContextParallelConfig(**degrees))
        try:
            ms = timed(lambda reference=reference: reference(**ref_inputs, return_dict=False)[0], args)
            with torch.inference_mode():
                out = reference(**ref_inputs, return_dict=False)[0]
        except Exception as exc:  # a peer plan that fails is reported, and the table still printed
            rows.append({"impl": "diffusers", "plan": f"{name} {world}", "error": f"{type(exc).__name__}: {exc}"})
            if rank == 0:
                print(f"diffusers {name} {world} failed: {exc}", flush=True)
            break
        record("diffusers", f"{name} {world}", ms, out, serial, None)

    if rank == 0:
        one_gpu = {row["impl"]: row["ms_per_step"] for row in rows if row["plan"] == "1 GPU"}
        for row in rows:
            if "ms_per_step" in row:
                row["speedup_vs_1gpu"] = one_gpu[row["impl"]] / row["ms_per_step"]
            row["regime"] = args.tag
        env = environment()
        p2p = os.environ.get("NCCL_P2P_DISABLE", "unset")
        print(f"{env['gpu']} x{world} torch {env['torch']} diffusers {env['diffusers']}; NCCL_P2P_DISABLE={p2p}")
        print_table(
            rows,
            [
                ("impl", "impl", "s"),
                ("plan", "plan", "s"),
                ("ms_per_step", "ms/step", ".1f"),
                ("speedup_vs_1gpu", "vs 1 GPU", ".2f"),
                ("mib_sent_per_step", "MiB sent/step", ".0f"),
                ("rel_l2_vs_1gpu", "rel L2 vs 1 GPU", ".1e"),
            ],
        )
        write_json(args.out_dir, f"flux2_parallel_{args.tag}.json", {"env": env, "args": vars(args), "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
