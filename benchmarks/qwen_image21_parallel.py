"""Qwen-Image 2.1's transformer split over the group with its cached prefix: per plan (one GPU, Ulysses, Ring, USP)
and per count of condition images, the prefix encode (once per request: whole on every rank under Ulysses and USP,
split round the ring under Ring alone), one denoise step from the kept prefix, the prefix keys and values each rank
keeps, and the step's relative L2 against one GPU's.

Run under torchrun, one process per GPU; every rank builds the same full-size model with random weights:

    torchrun --nproc-per-node 2 benchmarks/qwen_image21_parallel.py --out-dir $OUT
    torchrun --nproc-per-node 4 benchmarks/qwen_image21_parallel.py --compile --out-dir $OUT
    torchrun --nproc-per-node 2 benchmarks/qwen_image21_parallel.py --tiny --device cpu --size 256  (a smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, init_dummy_weights, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.qwen_image21_prefix_cost import PROMPT_TOKENS, TINY  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families.qwen_image21.latents import TOKEN_PIXELS  # noqa: E402
from paradit.families.qwen_image21.model import TOKENS_PER_SLOT, QwenImage21Config, QwenImage21Transformer  # noqa: E402
from paradit.families.qwen_image21.presets import QWEN_IMAGE21_TRANSFORMER  # noqa: E402
from paradit.layers.attention import AttentionDispatch, sdpa_attention  # noqa: E402
from paradit.layers.prefix_attention import PrefixCaching  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402
from paradit.parallel.mesh import ParallelContext, init_process_group  # noqa: E402
from paradit.parallel.parallelize import parallelize  # noqa: E402

COLUMNS = [
    ("references", "refs", "d"),
    ("plan", "plan", "s"),
    ("prefix_ms", "prefix encode ms", ".1f"),
    ("step_ms", "step ms", ".1f"),
    ("speedup", "step vs 1 GPU", ".2f"),
    ("kept_mib", "prefix K/V kept MiB/rank", ".1f"),
    ("rel_l2", "rel L2 vs 1 GPU", ".1e"),
]


def plain_again(model: torch.nn.Module) -> None:
    """Every attention back to one device's, prefix hooks included (``parallelize`` swaps them in place)."""
    for module in model.modules():
        if isinstance(module, AttentionDispatch):
            module.set_attention_fn(sdpa_attention)
        if isinstance(module, PrefixCaching):
            for name in ("keep_prefix", "prefix_attention_fn", "masked_attention_fn"):
                module.__dict__.pop(name, None)  # the class's one-device default again


def timed_ms(run, device: torch.device, args) -> float:
    dist.barrier()
    if device.type == "cuda":
        return time_cuda_ms(run, warmup=args.warmup, iters=args.iters)
    run()
    start = time.perf_counter()
    for _ in range(args.iters):
        run()
    return (time.perf_counter() - start) / args.iters * 1000


def inputs(model: QwenImage21Transformer, references: int, size: int, device: torch.device, dtype: torch.dtype):
    side = size // TOKEN_PIXELS
    slots = torch.tensor([False] * PROMPT_TOKENS + [True] * (side * side // TOKENS_PER_SLOT) * references)
    gen = torch.Generator().manual_seed(0)  # on the host: every rank draws the same
    embeds = torch.randn(1, slots.shape[0], model.config.context_in_dim, generator=gen)
    condition = torch.randn(1, references * side * side, 64, generator=gen) if references else None
    target = torch.randn(1, side * side, 64, generator=gen)
    moved = [None if t is None else t.to(device, dtype) for t in (embeds, condition, target)]
    prefix_args = (moved[0], slots.to(device), None, moved[1], ((side, side),) * references)
    return prefix_args, (moved[2], torch.tensor([0.5], device=device), side, side)


def bench(model, plan: ParallelConfig | None, references: int, args, device, dtype, serial):
    plain_again(model)
    forward = model if plan is None else parallelize(model, None, ParallelContext.build(plan, device)).forward
    prefix_args, step_args = inputs(model, references, args.size, device, dtype)
    with torch.inference_mode():
        prefix = forward.encode_prefix(*prefix_args)
        prefix_ms = timed_ms(lambda: forward.encode_prefix(*prefix_args), device, args)
        step_ms = timed_ms(lambda: forward(*step_args, prefix), device, args)
        out = forward(*step_args, prefix).float()
    kept = sum(layer.key.nbytes + layer.value.nbytes for layer in prefix.kv) / 2**20
    error = 0.0 if serial is None else ((out - serial).norm() / serial.norm()).item()
    row = dict(
        references=references,
        plan="1 GPU" if plan is None else plan.describe(),
        prefix_ms=prefix_ms,
        step_ms=step_ms,
        kept_mib=kept,
        rel_l2=error,
    )
    return row, out


def plans_for(world: int) -> list[ParallelConfig]:
    plans = [ParallelConfig(ulysses=world), ParallelConfig(ring=world)]
    if world == 4:
        plans.append(ParallelConfig(ulysses=2, ring=2))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (the CPU)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", type=int, default=1024, help="the output's and each condition image's side")
    parser.add_argument("--references", nargs="+", type=int, default=[0, 1, 3])
    parser.add_argument("--compile", action="store_true", help="the blocks compiled (the serving default)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    init_process_group(device, rank, world, "env://")
    config = dict(QWEN_IMAGE21_TRANSFORMER, **(TINY if args.tiny else {}))
    with torch.device("meta"):
        model = QwenImage21Transformer(QwenImage21Config.from_dict(config)).eval()
    init_dummy_weights(model, device, dtype)  # the same seed on every rank: the same weights
    if args.compile:
        compile_blocks(model)
    rows = []
    for references in args.references:
        row, serial = bench(model, None, references, args, device, dtype, None)
        rows.append(row)
        for plan in plans_for(world):
            rows.append(bench(model, plan, references, args, device, dtype, serial)[0])
            rows[-1]["speedup"] = row["step_ms"] / rows[-1]["step_ms"]
        if rank == 0:
            print_table(rows[-1 - len(plans_for(world)) :], COLUMNS)
    if rank == 0:
        env = environment() if cuda else {"device": "cpu"}
        print(f"{env.get('gpu', 'cpu')} x{world}")
        print_table(rows, COLUMNS)
        write_json(args.out_dir, f"qwen_image21_parallel_{world}.json", {"env": env, "args": vars(args), "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
