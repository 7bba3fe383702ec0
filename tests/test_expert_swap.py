"""Experts that take turns on the device: a swapped run gives the resident run's video bit for bit, the idle expert
really waits in host memory, the memory plan counts one expert, and a cap that leaves no room for both chooses the
swap by itself (and says so in the plan), refusing with the numbers when even one expert does not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.common import estimate
from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.families import PRESETS
from paradit.memory import gib
from paradit.options import ExecutionOptions, check_conflicts
from paradit.parallel import ParallelConfig

REQUEST = GenerationRequest(prompt="a heron", height=32, width=48, frames=5, steps=4, seed=2)


def test_swapped_experts_give_the_resident_video_and_wait_in_host_memory():
    with Engine("wan-tiny", device="cpu", dtype="fp32") as engine:
        resident = engine.generate(REQUEST).pixels
    swapped_engine = Engine("wan-tiny", device="cpu", dtype="fp32", options=ExecutionOptions(swap_experts=True))
    pipeline = swapped_engine.pipeline
    swap = pipeline.expert_swap
    low_noise = pipeline.experts["transformer_2"].model
    # Before the request, the high-noise expert is the resident one; the low-noise one's tensors are the host copies.
    assert swap.active == "transformer"
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(low_noise.parameters(), swap.host["transformer_2"]))
    swapped = swapped_engine.generate(REQUEST).pixels
    assert swap.active == "transformer_2"  # the boundary (0.875 of 1000) was crossed within the 4 steps
    assert torch.equal(swapped, resident)
    # The next request starts on the high-noise expert again, and still equals.
    assert torch.equal(swapped_engine.generate(REQUEST).pixels, resident)
    assert swap.bytes_per_expert()["transformer"] == swap.bytes_per_expert()["transformer_2"] > 0


def test_the_memory_plan_counts_one_expert_and_a_tight_cap_chooses_the_swap():
    spec = PRESETS["wan2.2-t2v-a14b"]
    both = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=True, placement="offload")
    one = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=True, placement="offload", swap_experts=True)
    assert both.transformer > 1.9 * one.transformer  # two 14B experts against one (embedders shared by neither)
    # A 480p video of 17 frames: activations small enough that one FP8 expert fits 32 GiB and two do not.
    small = dataclasses.replace(spec, height=480, width=832, frames=17)
    cap = 32 * 2**30
    assert estimate(small, ParallelConfig(), torch.bfloat16, True, "offload").total > cap
    assert estimate(small, ParallelConfig(), torch.bfloat16, True, "offload", swap_experts=True).total <= cap
    # The request's frames size the estimate: 81 frames at 720p need far more working memory than 17 at 480p.
    full = estimate(spec, ParallelConfig(), torch.bfloat16, True, "offload", swap_experts=True)
    assert full.activations > 4 * estimate(small, ParallelConfig(), torch.bfloat16, True, "offload", True).activations
    # On the tiny model, a cap between the two plans: the engine swaps by itself.
    tiny = PRESETS["wan-tiny"]
    tiny_swapped = estimate(tiny, ParallelConfig(), torch.float32, False, "gpu", swap_experts=True)
    assert estimate(tiny, ParallelConfig(), torch.float32, False, "gpu").total > tiny_swapped.total
    with Engine("wan-tiny", device="cpu", dtype="fp32", max_gpu_memory=f"{tiny_swapped.total}B") as engine:
        assert engine.options.swap_experts and engine.pipeline.expert_swap is not None
    # Under a cap that not even one expert fits, the refusal gives the swapped plan's numbers.
    swapped_bf16 = estimate(spec, ParallelConfig(), torch.bfloat16, False, "offload", swap_experts=True)
    with pytest.raises(InvalidRequest, match=rf"needs {gib(swapped_bf16.total)} GiB on rank 0"):
        Engine(
            spec,
            device="cpu",
            dtype="bf16",
            max_gpu_memory="32GiB",
            load_format="dummy",
            request=GenerationRequest(prompt="x"),
        )


def test_cuda_graphs_do_not_combine_with_swapped_experts():
    with pytest.raises(InvalidRequest, match="CUDA graphs do not combine with swapped experts"):
        check_conflicts(ParallelConfig(), ExecutionOptions(cuda_graphs=True, swap_experts=True), "cuda")
