"""Weights sharded over N ranks (``--shard-weights``) compute what one process does: FLUX.2 (a folder written by
diffusers' ``save_pretrained``, in fp32 and with FP8 linears) and Wan 2.2's two experts (the same, and random FP8
ones), sharded over 2, 3 and 4 gloo processes alone under Ulysses, Ring, USP and CFG, and over part of the group;
each rank keeps 1/N of the weights; the gathers' traffic is counted; whole requests through the CLI; the refusals."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from benchmarks.common import estimate
from paradit import InvalidRequest
from paradit.cli import main
from paradit.compile import model_blocks
from paradit.families import FAMILIES, PRESETS, spec_from_folder
from paradit.layers.fp8 import Fp8Linear
from paradit.options import ExecutionOptions
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.planner.choose import settings_for
from paradit.planner.plan import plan
from paradit.planner.profile import load_profile
from paradit.planner.report import generate_command
from paradit.planner.tuned import tuned_entry
from paradit.request import GenerationRequest
from paradit.runtime import load_transformer
from paradit.settings import Asked, settle
from tests.checkpoint_cache import cached
from tests.checkpoints import build_klein_checkpoint, relative_l2
from tests.distributed import run_on_processes
from tests.test_flux2_reference import transformer_inputs as flux2_inputs
from tests.test_wan import wan_checkpoint
from tests.test_wan_model import first_frame_timesteps

# (world, plan): sharded over the whole group, and (cfg 2 x ulysses 2, shard 2) over the Ulysses pairs only.
PLANS = [
    (2, ParallelConfig(ulysses=2, shard_weights=2)),
    (2, ParallelConfig(cfg=2, shard_weights=2)),
    (3, ParallelConfig(ring=3, shard_weights=3)),
    (4, ParallelConfig(ulysses=2, ring=2, shard_weights=4)),
    (4, ParallelConfig(cfg=2, ulysses=2, shard_weights=2)),
]


def cases() -> dict[str, tuple]:
    """name -> (spec, component, quantize, inputs): every transformer each rank loads and runs."""
    klein = spec_from_folder(cached(build_klein_checkpoint))
    wan = spec_from_folder(wan_checkpoint("t2v"))
    gen = torch.Generator().manual_seed(5)
    flux2 = flux2_inputs(klein.transformer, 2, 3, 5, 7, seed=3)

    def wan_inputs(config: dict) -> tuple:
        latents = torch.randn(2, config["in_channels"], 3, 6, 10, generator=gen)
        text = torch.randn(2, 7, config["text_dim"], generator=gen)
        return latents, torch.tensor([937.0, 281.5]), text

    wan_fp8 = PRESETS["wan-tiny"]  # random weights; its widths are multiples of 16, which FP8 needs
    fp8_latents, _, fp8_text = wan_inputs(wan_fp8.transformer)
    per_token = first_frame_timesteps((3, 3, 5), torch.tensor([900.0, 100.0]))
    return {
        "FLUX.2": (klein, "transformer", "none", flux2),
        "FLUX.2 FP8": (klein, "transformer", "fp8", flux2),
        "Wan high-noise": (wan, "transformer", "none", wan_inputs(wan.transformer)),
        "Wan low-noise": (wan, "transformer_2", "none", wan_inputs(wan.experts["transformer_2"])),
        "Wan FP8 high-noise": (wan_fp8, "transformer", "fp8", wan_inputs(wan_fp8.transformer)),
        "Wan FP8 low-noise per token": (wan_fp8, "transformer_2", "fp8", (fp8_latents, per_token, fp8_text)),
    }


def load_and_run(name: str, case: tuple, context: ParallelContext | None) -> tuple:
    spec, component, quantize, inputs = case
    config = spec.transformer if component == "transformer" else spec.experts[component]
    spec = dataclasses.replace(spec, transformer=config)
    options = ExecutionOptions(quantize=quantize)
    loaded = load_transformer(
        FAMILIES[spec.family], spec, torch.device("cpu"), torch.float32, context, options, component
    )
    with torch.inference_mode():
        out = loaded.forward(**inputs) if isinstance(inputs, dict) else loaded.forward(*inputs)
    return loaded.model, out


def held_bytes(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


@functools.cache
def one_process() -> dict[str, tuple[torch.Tensor, int, int]]:
    """name -> (output, bytes of the whole transformer, bytes of its largest block)."""
    found = {}
    for name, case in cases().items():
        model, out = load_and_run(name, case, None)
        found[name] = (out, held_bytes(model), max(held_bytes(block) for block in model_blocks(model)))
    return found


def sharded_results(plan: ParallelConfig) -> dict:
    context = ParallelContext.build(plan, torch.device("cpu"))
    results = {}
    for name, case in cases().items():
        context.stats.reset()
        model, out = load_and_run(name, case, context)
        results[name] = {
            "out": out,
            "held": held_bytes(model),
            "sent": sum(context.stats.bytes_sent.values()),
            "fp8 linears": sum(isinstance(m, Fp8Linear) for m in model.modules()),
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        }
        if "FP8" in name and plan.ring > 1:
            unsharded = dataclasses.replace(context, config=dataclasses.replace(plan, shard_weights=0))
            results[name]["unsharded"] = load_and_run(name, case, unsharded)[1]
    return results


@pytest.mark.parametrize("world,plan", [pytest.param(w, p, id=p.describe()) for w, p in PLANS])
def test_sharded_weights_equal_one_process_and_each_rank_keeps_its_share(world, plan):
    serial = one_process()
    results = run_on_processes(world, sharded_results, plan)
    degree = plan.shard_weights
    for name, (expected, whole, block) in serial.items():
        got = results[name]
        if "unsharded" in got:
            # FP8 rounds each token's activations on a grid its largest value sets; Ring's block-wise softmax moves
            # that value by ~1e-6, and the grid with it, so one process is matched to FP8's rounding, and the same
            # plan unsharded exactly.
            assert relative_l2(got["out"], got["unsharded"]) <= 1e-5, name
            assert relative_l2(got["out"], expected) <= 1e-2, name
        else:
            assert relative_l2(got["out"], expected) <= 1e-5, name
        assert got["sharded"], name
        # 1/N of every tensor (the first rank's rows of each, rounded up), within one block of the whole's 1/N.
        assert abs(got["held"] - whole / degree) <= block, (name, got["held"], whole)
        assert got["held"] < whole / degree + whole / 10 / degree, (name, got["held"], whole)
        assert (got["fp8 linears"] > 0) == ("FP8" in name), name
        assert got["sent"] > 0, name
    if plan == ParallelConfig(cfg=2, shard_weights=2):  # no sequence traffic: the gathers are all it sends
        for name, (_, whole, _) in serial.items():
            sent = results[name]["sent"]
            # Each gather sends this rank's half of the padded tensors once: about half the weights.
            assert whole / 2 <= sent <= whole / 2 * 1.05, (name, sent, whole)


def test_a_request_with_sharded_weights_gives_the_one_process_video(tmp_path, capsys):
    args = [
        "generate",
        "--model",
        "wan-tiny",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--prompt",
        "a fox",
        "--steps",
        "3",
        "--seed",
        "4",
        "--no-progress",
        "--out",
        str(tmp_path / "v.mp4"),
    ]
    assert (
        main([*args, "--gpus", "4", "--cfg-parallel", "--ulysses", "2", "--shard-weights", "4", "--verify-serial"]) == 0
    )
    out = capsys.readouterr().out
    assert "cfg 2 x ulysses 2, weights sharded over 4 (cfg x ulysses) video equals the 1-process video" in out
    assert float(re.search(r"max diff (\S+) on \[0, 1\]", out).group(1)) <= 1e-4


@pytest.mark.parametrize(
    "asked,message",
    [
        (
            Asked("flux2-tiny", "cpu", parallel=ParallelConfig(ulysses=2, shard_weights=3)),
            "shard weights 3 does not divide the plan's 2 GPUs",
        ),
        (
            Asked("flux2-tiny", "cpu", parallel=ParallelConfig(tensor=2, shard_weights=2)),
            "shard weights combines with ulysses, ring and cfg, not with tensor or pipefusion",
        ),
        (
            Asked(
                "wan-tiny",
                "cpu",
                parallel=ParallelConfig(ulysses=2),
                shard_weights=2,
                options=ExecutionOptions(swap_experts=True),
            ),
            "--shard-weights does not combine with --cuda-graphs or --swap-experts",
        ),
    ],
)
def test_what_sharding_cannot_run_is_refused(asked, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        settle(asked)


def test_the_plan_names_the_dimensions_it_shards_over():
    assert ParallelConfig(cfg=2, ulysses=2, shard_weights=2).shard_dims() == "ulysses"
    assert ParallelConfig(cfg=2, ulysses=2, shard_weights=4).shard_dims() == "cfg x ulysses"
    assert ParallelConfig(ulysses=4, shard_weights=2).shard_dims() == "2 of ulysses 4"
    assert ParallelConfig(ring=2, ulysses=2, shard_weights=4).describe() == (
        "ring 2 x ulysses 2, weights sharded over 4 (ring x ulysses)"
    )


def test_the_planner_shards_wan_a14b_over_four_32gb_cards_and_the_tuned_entry_runs_it():
    """Before: ``--tensor 4`` (259.6 GiB of all-reduces a step): CFG 2 x Ulysses 2 held both bf16 experts whole."""
    profile = load_profile("r9700s-pcie")
    spec = PRESETS["wan2.2-t2v-a14b"]
    choice = plan(spec, 4, profile, GenerationRequest(prompt="a", height=720, width=1280, frames=81))
    best = choice.best
    assert best.parallel == ParallelConfig(cfg=2, ulysses=2, shard_weights=4) and not best.fp8 and best.fits
    assert best.parallel.exact and not best.swap_experts and not best.cuda_graphs
    assert best.memory.total <= profile.memory_bytes
    tensor = next(o for o in choice.ranked if o.parallel == ParallelConfig(tensor=4) and not o.fp8)
    assert best.mean_ms * 1.2 < tensor.mean_ms
    # Each step gathers 3/4 of one expert's bf16 weights (the active one), hidden behind the step's compute.
    expert = estimate(spec, ParallelConfig(), torch.bfloat16, False, swap_experts=True).transformer
    (gather,) = [t for t in best.cost.transfers if t.strategy == "shard"]
    assert gather.bytes == pytest.approx(expert * 3 / 4) and gather.ms < best.cost.compute_ms
    quantize = "fp8" if best.fp8 else "none"
    options = ExecutionOptions(quantize=quantize, cuda_graphs=best.cuda_graphs, swap_experts=best.swap_experts)
    assert "--shard-weights 4" in generate_command(spec.name, best.parallel, options, best.placement)
    assert tuned_entry(spec.name, 4, profile.name).parallel == best.parallel  # what `generate --gpus 4` runs there
    assert settings_for(spec, 4, profile=profile).parallel == best.parallel


# Forward peaks of one transformer forward at the preset's size, sharded over a group of one, on an H200
# (docs/benchmarks.md, "Sharded weights (issue 24, session 9)"): (preset, FP8, compiled, GiB).
SHARD_ONE_PEAKS = [
    ("flux2-dev", False, False, 64.27),
    ("flux2-dev", True, False, 34.67),
    ("flux2-dev", False, True, 63.95),
    ("flux2-dev", True, True, 33.74),
]


@pytest.mark.parametrize("model,fp8,compiled,peak", SHARD_ONE_PEAKS)
def test_the_estimate_of_sharded_weights_is_above_the_measured_peak_and_near_it(model, fp8, compiled, peak):
    """The shares, the weights outside the blocks gathered for the forward, and two blocks gathered at a time."""
    planned = estimate(PRESETS[model], ParallelConfig(shard_weights=1), torch.bfloat16, fp8, compiled=compiled)
    forward = (planned.transformer + planned.activations) / 2**30
    assert peak <= forward <= 1.2 * peak, (forward, peak)
    halves = estimate(PRESETS[model], ParallelConfig(ulysses=2, shard_weights=2), torch.bfloat16, fp8)
    whole = estimate(PRESETS[model], ParallelConfig(), torch.bfloat16, fp8)
    assert halves.transformer - planned.transformer == pytest.approx(-whole.transformer / 2, abs=2**20)
