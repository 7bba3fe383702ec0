"""Every family's transformer under every sequence plan (Ulysses and Ring at 2, 3 and 4 processes, USP at 4) and every
tensor plan (T = 4, and T = 2 with CFG, Ulysses or Ring) equals its one-process output: one parametrized matrix of
families x plans, each one-process output computed once in this process and compared in the gloo ranks."""

from __future__ import annotations

import functools

import pytest
import torch

from paradit.families import FAMILIES as REGISTRY
from paradit.layers.attention import AttentionDispatch, sdpa_attention
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import parallelize
from tests.checkpoints import relative_l2
from tests.distributed import SEQUENCE_PLANS, run_on_processes
from tests.transformer_cases import REGISTERED, SEQUENCE, TENSOR, call

TABLES = {"sequence": SEQUENCE, "tensor": TENSOR}
SEQUENCE_MATRIX = [pytest.param(world, plan, id=plan.describe()) for world, plans in SEQUENCE_PLANS for plan in plans]
# Under "cfg 2 x tensor 2" the transformer is sharded at T = 2 in each CFG half (both halves compute the whole batch
# here): plain T = 2, in a group of 4.
TENSOR_MATRIX = [
    pytest.param(4, plan, id=plan.describe())
    for plan in (
        ParallelConfig(cfg=2, tensor=2),
        ParallelConfig(tensor=4),
        ParallelConfig(ulysses=2, tensor=2),
        ParallelConfig(ring=2, tensor=2),
    )
]


@functools.cache
def one_process(table: str, family: str) -> dict[str, torch.Tensor]:
    model, cases = TABLES[table][family]()
    with torch.no_grad():
        return {name: call(model, inputs) for name, inputs in cases.items()}


def _plan_results(table: str, family: str, plan: ParallelConfig, serial: dict[str, torch.Tensor]) -> dict:
    """On each rank: the family's model split by ``plan``; rank 0's relative L2 per case against ``serial``, the
    bytes it sent, and whether the attention left out of the split (Wan's cross-attention to the whole text) kept
    plain SDPA."""
    model, cases = TABLES[table][family]()
    context = ParallelContext.build(plan, torch.device("cpu"))
    tensor_plan = REGISTRY[REGISTERED[family]].tensor_plan if plan.tensor > 1 else None
    forward = parallelize(model, tensor_plan, context).forward
    with torch.no_grad():
        errors = {name: relative_l2(call(forward, inputs), serial[name]) for name, inputs in cases.items()}
    local = [m for m in model.modules() if isinstance(m, AttentionDispatch) and m.sequence_streams == ()]
    return {
        "errors": errors,
        "bytes": sum(context.stats.bytes_sent.values()),
        "local attention kept SDPA": [m.attention_fn is sdpa_attention for m in local],
    }


def check(table: str, family: str, world: int, plan: ParallelConfig) -> None:
    serial = one_process(table, family)
    results = run_on_processes(world, _plan_results, table, family, plan, serial)
    assert results["errors"].keys() == serial.keys()
    assert max(results["errors"].values()) <= 1e-5, results
    assert results["bytes"] > 0  # it really communicated
    assert all(results["local attention kept SDPA"]), results
    if family == "Wan":
        assert results["local attention kept SDPA"], "Wan's cross-attention went missing"


@pytest.mark.parametrize("world,plan", SEQUENCE_MATRIX)
@pytest.mark.parametrize("family", SEQUENCE)
def test_sequence_plan_equals_one_process(family, world, plan):
    check("sequence", family, world, plan)


@pytest.mark.parametrize("world,plan", TENSOR_MATRIX)
@pytest.mark.parametrize("family", TENSOR)
def test_tensor_plan_equals_one_process(family, world, plan):
    check("tensor", family, world, plan)
