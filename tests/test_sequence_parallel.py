"""The pieces of sequence parallelism on gloo: masked attention against SDPA at world sizes 3 and 4, FP8 transport's
error and bytes, and Ulysses' head chunks. Every family's transformer under every sequence plan is
test_parallel_matrix.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paradit.layers.attention import attention_with_lse, sdpa_attention
from paradit.parallel import ParallelConfig
from paradit.parallel.comm import all_gather_uneven, split_sizes
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import parallelize
from paradit.parallel.sequence import ULYSSES_CHUNKS, SequenceParallelAttention, merge_partials, sequence_layout
from tests.distributed import run_on_processes
from tests.transformer_cases import SEQUENCE


def _compare_masked_attention(plans: list[ParallelConfig]) -> dict[str, float]:
    """SequenceParallelAttention with a key mask against masked SDPA on the whole sequence; sequence rank 0's keys
    are all masked for one sample, so some blocks contribute nothing."""
    gen = torch.Generator().manual_seed(3)
    batch, length, heads, dim = 2, 13, 5, 8
    q, k, v = (torch.randn(batch, length, heads, dim, generator=gen) for _ in range(3))
    key_mask = torch.rand(batch, length, generator=gen) > 0.3
    key_mask[:, -1] = True
    errors = {}
    for plan in plans:
        sizes = split_sizes(length, plan.sequence_degree)
        key_mask_plan = key_mask.clone()
        key_mask_plan[0, : sizes[0]] = False
        expected = sdpa_attention(q, k, v, key_mask_plan)
        context = ParallelContext.build(plan, torch.device("cpu"))
        attention = SequenceParallelAttention(context)
        me = context.sequence_rank
        local = [t.split(sizes, dim=1)[me] for t in (q, k, v, key_mask_plan)]
        with sequence_layout({"tokens": sizes}):
            out = attention(*local, streams=("tokens",))
        out = all_gather_uneven(out, 1, sizes, context.sequence_group, context.stats)
        errors[plan.describe()] = ((out - expected).norm() / expected.norm()).item()
    return errors


@pytest.mark.parametrize(
    "world,plans",
    [
        (3, [ParallelConfig(ulysses=3), ParallelConfig(ring=3)]),
        (4, [ParallelConfig(ulysses=2, ring=2), ParallelConfig(ring=4), ParallelConfig(ulysses=4)]),
    ],
)
def test_masked_sequence_parallel_attention_equals_sdpa(world, plans):
    errors = run_on_processes(world, _compare_masked_attention, plans)
    for plan in plans:
        assert errors[plan.describe()] <= 1e-5, errors


@pytest.mark.parametrize("masked", [False, True])
def test_ring_merge_keeps_float64(masked):
    """Ring's blocks merged in float64 equal SDPA on the whole sequence to float64's digits, not float32's: a float64
    run (how the CPU tests tell a split's reordered sums from a wrong one) keeps its precision through the merge."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 11, 3, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    key_mask = torch.rand(2, 11, generator=gen) > 0.3 if masked else None
    if masked:
        key_mask[:, -1] = True
    out = lse = None
    for keys in (slice(0, 4), slice(4, 9), slice(9, 11)):
        block_mask = None if key_mask is None else key_mask[:, keys]
        out, lse = merge_partials(out, lse, *attention_with_lse(q, k[:, keys], v[:, keys], block_mask))
    expected = sdpa_attention(q, k, v, key_mask)
    assert out.dtype == torch.float64
    assert ((out - expected).norm() / expected.norm()).item() <= 1e-13


def _compare_fp8_transport(plans: list[ParallelConfig]) -> dict[str, float]:
    """FP8 transport against exact transport of the same plan: its error, and the bytes it saves."""
    model, cases = SEQUENCE["FLUX.2"]()
    inputs = cases["batch 2"]
    results = {}
    with torch.no_grad():
        serial = model(**inputs)
        for plan in plans:
            for comm_dtype in ("auto", "fp8"):
                context = ParallelContext.build(dataclasses.replace(plan, comm_dtype=comm_dtype), torch.device("cpu"))
                out = parallelize(model, None, context).forward(**inputs)
                key = f"{plan.describe()} {comm_dtype}"
                results[key] = ((out - serial).norm() / serial.norm()).item()
                results[key + " bytes"] = sum(context.stats.bytes_sent.values())
    return results


def test_fp8_transport_error_is_bounded_and_bytes_shrink():
    plans = [ParallelConfig(ulysses=2), ParallelConfig(ring=2)]
    results = run_on_processes(2, _compare_fp8_transport, plans)
    for plan in plans:
        name = plan.describe()
        assert results[f"{name} auto"] <= 1e-5
        # e4m3 keeps ~3 significant bits per value: a few percent on one forward of random weights, never more.
        assert 1e-4 < results[f"{name} fp8"] < 5e-2, results
        # fp32 model: 1 byte a value plus a 4-byte scale per 16-value row, against 4 bytes a value.
        assert results[f"{name} fp8 bytes"] <= 0.35 * results[f"{name} auto bytes"], results


@pytest.mark.parametrize("heads", [4, 5, 7, 48])
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_ulysses_head_chunks_cover_each_ranks_heads_once_in_order(heads, degree):
    """The overlapped exchange sends each rank its heads chunk by chunk: together, exactly the heads it attends."""
    attention = object.__new__(SequenceParallelAttention)  # only the degree matters here, no process group
    attention.ulysses = degree
    whole = attention._head_ranges(heads)
    assert [first for first, _ in whole] == [sum(split_sizes(heads, degree)[:r]) for r in range(degree)]
    chunks = [attention._head_ranges(heads, c, ULYSSES_CHUNKS) for c in range(ULYSSES_CHUNKS)]
    for rank, (first, count) in enumerate(whole):
        covered = [head for chunk in chunks for start, size in [chunk[rank]] for head in range(start, start + size)]
        assert covered == list(range(first, first + count))
