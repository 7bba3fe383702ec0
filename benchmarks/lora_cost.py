"""What LoRA adapters cost on one GPU, with random full-size weights and a random adapter on every block linear
(diffusers' layout, bf16 factors): the transformer's load time with the adapter fused against without it, and one
forward's time with the adapter unfused (side paths at rank 32 and 64) against the plain transformer, eager and
compiled, bf16 and FP8 (fused weights cost nothing per step: they are the plain transformer's shape), each side path
folded into its base GEMM where the runtime folds it and, in the same call, left beside it (``--fold``). Also the FP8
run's relative L2 against bf16 with the same adapter fused, beside the same figure without an adapter, and a
server's switches between named adapters: side paths in bf16, and a cache of fused choices in FP8.

    python benchmarks/lora_cost.py --out-dir $OUT
    python benchmarks/lora_cost.py --models flux2-klein-4b --ranks 32 --out-dir $OUT
    python benchmarks/lora_cost.py --models flux2-dev --ranks 32 --modes compiled-bf16 compiled-fp8 --no-switches \
        --out-dir $OUT
    python benchmarks/lora_cost.py --models flux2-dev --switch-only --out-dir $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.parallel_step import BENCHES, with_batch  # noqa: E402
from paradit.compile import model_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.lora import LoraRef, LoraSet  # noqa: E402
from paradit.lora.variants import AdapterChoice  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.runtime import load_transformer  # noqa: E402
from paradit.spec import RandomWeights  # noqa: E402

WAN_INPUTS = (480, 832, 81, 512)  # height, width, frames, text tokens
# ``--fold``: the side paths as the runtime builds them (folded where ``LoraSidePath.folds``), left unfolded, or both
FOLDS = {"both": (False, True), "on": (True,), "off": (False,)}
MODES = {"eager-bf16": ("eager", "none"), "compiled-bf16": ("compiled", "none"), "compiled-fp8": ("compiled", "fp8")}


def write_adapter(model: nn.Module, rank: int, path: Path) -> int:
    """A random rank-``rank`` adapter on every linear of every block; returns its parameter count."""
    block_ids = {id(block) for block in model_blocks(model)}
    names = {id(module): name for name, module in model.named_modules()}
    state, generator = {}, torch.Generator().manual_seed(rank)
    for block in model.modules():
        if id(block) not in block_ids:
            continue
        for leaf, linear in block.named_modules():
            if isinstance(linear, nn.Linear):
                key = f"transformer.{names[id(block)]}.{leaf}"
                down = torch.randn(rank, linear.in_features, generator=generator) * linear.in_features**-0.5
                state[f"{key}.lora_A.weight"] = down.bfloat16()
                state[f"{key}.lora_B.weight"] = (
                    torch.randn(linear.out_features, rank, generator=generator) * 0.01
                ).bfloat16()
    save_file(state, str(path))
    return sum(t.numel() for t in state.values())


def forward_inputs(spec, model: nn.Module, device: torch.device):
    if spec.family == "wan":
        height, width, frames, text_len = WAN_INPUTS
        config = model.config
        gen = torch.Generator(device).manual_seed(0)
        shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
        latents = torch.randn(shape, device=device, generator=gen).bfloat16()
        text = torch.randn(1, text_len, config.text_dim, device=device, generator=gen).bfloat16()
        return with_batch((latents, torch.full((1,), 500.0, device=device), text), 2)
    bench_module, text_len = BENCHES[spec.family]
    inputs = importlib.import_module(bench_module).step_inputs(model.config, spec.height, spec.width, text_len, device)
    return with_batch(inputs, 2 if spec.guidance_mode == "cfg" else 1)


def measure(spec, lora: LoraSet | None, mode: str, quantize: str, device: torch.device, iters: int) -> dict:
    family = FAMILIES[spec.family]
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    options = ExecutionOptions(quantize=quantize, compile=mode == "compiled", lora=lora or LoraSet())
    loaded = load_transformer(family, spec, device, torch.bfloat16, None, options)
    torch.cuda.synchronize(device)
    load_s = time.perf_counter() - start
    row = {"load_s": load_s, "resident_gib": torch.cuda.memory_allocated(device) / 2**30}
    if mode == "load":
        return row
    forward = loaded.forward
    inputs = forward_inputs(spec, loaded.model, device)

    def run():
        with torch.inference_mode():
            return forward(**inputs) if isinstance(inputs, dict) else forward(*inputs)

    row["ms"] = time_cuda_ms(run, warmup=3, iters=iters)
    row["output"] = run().float().cpu()
    return row


def measured(spec, lora, mode, quantize, device, iters, fold: bool = True) -> dict:
    """``fold`` False: every side path left beside its linear (``fold_side_paths`` skipped), to time the fold."""
    unfolded = mock.patch("paradit.runtime.fold_side_paths", lambda model: 0)
    with contextlib.nullcontext() if fold else unfolded:
        row = measure(spec, lora, mode, quantize, device, iters)
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def switch_rows(
    name: str, spec, adapters: dict[int, Path], device: torch.device, iters: int, cache: int, quantize: str
) -> list[dict]:
    rows = switches(name, spec, adapters, device, iters, cache, quantize)
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows


def switches(
    name: str, spec, adapters: dict[int, Path], device: torch.device, iters: int, cache: int, quantize: str
) -> list[dict]:
    """A server's switch between named adapters (compiled): the time the choice takes (side paths, ``cache`` 0:
    concatenating the factors; a cache of fused choices: a merge on a miss, a copy on a hit or back to none), and
    the first forward after it against the steady one (side paths: a new total rank recompiles the blocks, until
    they run shape-generic; fused choices keep every shape)."""
    refs = tuple(LoraRef(str(path), name=f"r{rank}") for rank, path in adapters.items())
    lora = LoraSet(refs, (), "unfused", switchable=True, cache=cache)
    options = ExecutionOptions(quantize=quantize, compile=True, lora=lora)
    loaded = load_transformer(FAMILIES[spec.family], spec, device, torch.bfloat16, None, options)
    forward = loaded.forward
    inputs = forward_inputs(spec, loaded.model, device)
    resident_gib = torch.cuda.memory_allocated(device) / 2**30

    def run():
        with torch.inference_mode():
            return forward(**inputs) if isinstance(inputs, dict) else forward(*inputs)

    first, last = {refs[0].name: 1.0}, {refs[-1].name: 0.5}
    if cache:  # each kind of switch once: a miss, back to none, a hit, a miss that evicts, a miss after eviction
        rounds = [[{}, first, {}, first, last, first, {}]]
    else:  # the second round: every total rank compiled once already
        rounds = [[{}, first, last, {ref.name: 1.0 for ref in refs}, {refs[0].name: 0.7}]] * 2
    choose = next(hook for hook in loaded.hooks if isinstance(hook, AdapterChoice)).choose
    merged = getattr(choose, "__self__", None)
    rows = []
    for number, choices in enumerate(rounds, 1):
        for choice in choices:
            key = tuple(sorted(choice.items()))
            event = "side paths" if merged is None else "base" if not key else "hit" if key in merged.merged else "miss"
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            choose(choice)
            torch.cuda.synchronize(device)
            switch_ms = (time.perf_counter() - start) * 1000
            start = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            first_ms = (time.perf_counter() - start) * 1000
            chosen = "+".join(f"{key}x{scale:g}" for key, scale in choice.items()) or "none"
            steady = time_cuda_ms(run, warmup=1, iters=iters)
            rows.append(
                dict(
                    model=name,
                    kind="switch",
                    precision=quantize.replace("none", "bf16"),
                    cache=cache,
                    adapter=chosen,
                    event=event,
                    round=number,
                    switch_ms=switch_ms,
                    first_ms=first_ms,
                    ms=steady,
                    resident_gib=resident_gib,
                )
            )
            print_table(rows[-1:], SWITCH_COLUMNS)
    return rows


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def bench_model(name: str, args, device: torch.device, folder: Path) -> list[dict]:
    spec = dataclasses.replace(PRESETS[name], weights=RandomWeights())
    with torch.device("meta"):
        model = FAMILIES[spec.family].build_transformer(spec)
    adapters = {}
    for rank in args.ranks:
        adapters[rank] = folder / f"{name}-r{rank}.safetensors"
        params = write_adapter(model, rank, adapters[rank])
        print(f"{name}: rank {rank} adapter of {params / 1e6:.1f}M parameters", flush=True)
    rows = []
    if args.switch_only:
        side_paths = switch_rows(name, spec, adapters, device, args.iters, 0, "none")
        return side_paths + switch_rows(name, spec, adapters, device, args.iters, args.lora_cache, "fp8")

    def record(**row) -> dict:
        rows.append({"model": name, **{k: v for k, v in row.items() if k != "output"}})
        print_table(rows[-1:], COLUMNS)
        return row

    top = max(args.ranks)
    fused = LoraSet((LoraRef(str(adapters[top])),))
    plain = record(kind="load", adapter="none", **measured(spec, None, "load", "none", device, args.iters))
    with_adapter = measured(spec, fused, "load", "none", device, 1)
    record(kind="load", adapter=f"fused r{top}", fuse_s=with_adapter["load_s"] - plain["load_s"], **with_adapter)
    if spec.family == "wan" and not args.wan_forwards:
        return rows
    outputs = {}
    for mode, quantize in (MODES[chosen] for chosen in args.modes):
        precision = quantize.replace("none", "bf16")
        base = record(
            kind="forward",
            mode=mode,
            precision=precision,
            adapter="none",
            **measured(spec, None, mode, quantize, device, args.iters),
        )
        outputs[(mode, precision, "none")] = base["output"]
        for rank in args.ranks:
            side_paths, unfolded = LoraSet((LoraRef(str(adapters[rank])),), (), "unfused"), None
            for fold in FOLDS[args.fold]:
                unfused = measured(spec, side_paths, mode, quantize, device, args.iters, fold)
                record(
                    kind="forward",
                    mode=mode,
                    precision=precision,
                    adapter=f"unfused r{rank}" + ("" if fold else ", unfolded"),
                    overhead=unfused["ms"] / base["ms"] - 1,
                    rel_l2_vs_unfolded=None if unfolded is None else relative_l2(unfused["output"], unfolded),
                    **unfused,
                )
                unfolded = unfused["output"] if not fold else unfolded
        if mode == "compiled":
            row = record(
                kind="forward",
                mode=mode,
                precision=precision,
                adapter=f"fused r{top}",
                **measured(spec, fused, mode, quantize, device, args.iters),
            )
            outputs[(mode, precision, "fused")] = row["output"]
    if not args.no_switches:
        rows += switch_rows(name, spec, adapters, device, args.iters, 0, "none")
        rows += switch_rows(name, spec, adapters, device, args.iters, args.lora_cache, "fp8")
    for adapter in ("none", "fused") if {"compiled-bf16", "compiled-fp8"} <= set(args.modes) else ():
        error = relative_l2(outputs[("compiled", "fp8", adapter)], outputs[("compiled", "bf16", adapter)])
        record(kind="fp8 error", adapter=adapter if adapter == "none" else f"fused r{top}", fp8_rel_l2=error)
    return rows


COLUMNS = [
    ("model", "model", ""),
    ("kind", "kind", ""),
    ("mode", "mode", ""),
    ("precision", "precision", ""),
    ("adapter", "adapter", ""),
    ("load_s", "load s", ".2f"),
    ("fuse_s", "fuse s", ".2f"),
    ("ms", "ms/forward", ".1f"),
    ("overhead", "overhead", "+.1%"),
    ("rel_l2_vs_unfolded", "rel L2 vs unfolded", ".2e"),
    ("resident_gib", "resident GiB", ".2f"),
    ("fp8_rel_l2", "FP8 rel L2", ".2e"),
]


SWITCH_COLUMNS = [
    ("model", "model", ""),
    ("precision", "precision", ""),
    ("cache", "cache", "d"),
    ("adapter", "chosen", ""),
    ("event", "event", ""),
    ("round", "round", "d"),
    ("switch_ms", "switch ms", ".1f"),
    ("first_ms", "first forward ms", ".1f"),
    ("ms", "ms/forward", ".1f"),
    ("resident_gib", "resident GiB", ".2f"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["flux2-dev", "wan2.2-t2v-a14b"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--wan-forwards", action="store_true", help="time Wan's forwards too (load and fuse only)")
    parser.add_argument(
        "--lora-cache",
        type=int,
        default=1,
        help="fused choices kept in the FP8 switch rows (N of "
        "them hold the weights the adapters change N+1 times: FLUX.2-dev FP8 fits one)",
    )
    parser.add_argument("--switch-only", action="store_true", help="the server's switches alone")
    parser.add_argument("--no-switches", action="store_true", help="without the server's switches")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="forward rows timed")
    parser.add_argument(
        "--fold",
        default="both",
        choices=list(FOLDS),
        help="unfused rows with the side paths folded into the base GEMMs where they pay (on), beside them (off), "
        "or both in the same call",
    )
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows += bench_model(name, args, device, Path(folder))
    print()
    print_table([row for row in rows if row["kind"] != "switch"], COLUMNS)
    print_table([row for row in rows if row["kind"] == "switch"], SWITCH_COLUMNS)
    write_json(args.out_dir, "lora_cost.json", {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
