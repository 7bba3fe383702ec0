"""Sparse attention under the parallel plans: a tiny Wan transformer with radial and SVG2 masks (block 0 dense, block
1 sparse), through the masked-SDPA reference (test_sparse_attention.py holds the kernel to it), under Ulysses 2 and 3
(SVG2's heads balanced by their kept tiles), Ring 2 (each rank's tiles the mask's, its tokens starting at whole tiles)
and USP 2 x 2, against one process with the same mask; and the batch rows CFG parallel hands each rank, alone,
against the batch."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from paradit.families.wan.model import WanConfig, WanTransformer
from paradit.layers.sparse_attention import SparseSelfAttention, SparseSettings, apply_sparse_attention
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import parallelize
from tests.checkpoints import relative_l2
from tests.distributed import run_on_processes
from tests.test_wan_model import TEXT_DIM, tiny_config
from tests.transformer_cases import randomize

LATENT = (6, 16, 32)  # tokens (6, 8, 16): 768, six tiles, a frame a tile
SETTINGS = {
    "radial": SparseSettings.of("radial", 2, dense_steps=0, dense_blocks=1),
    "svg2": SparseSettings(
        "svg2", 0, 1, query_clusters=6, key_clusters=12, top_p=0.6, first_iterations=4, iterations=2
    ),
}


@contextlib.contextmanager
def reference_attention():
    """Masked SDPA rather than the kernel in Triton's interpreter (20 times slower here): the plans' placing of
    masks and heads is what these tests check."""
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        os.environ["TRITON_INTERPRET"] = "1"


def sparse_wan(method: str):
    torch.manual_seed(0)
    model = WanTransformer(WanConfig.from_dict(tiny_config(16, 16, heads=3, head_dim=12)))
    randomize(model, std=0.1)
    return model.eval(), apply_sparse_attention(model, SETTINGS[method])


def inputs():
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, *LATENT, generator=generator)
    text = torch.randn(2, 7, TEXT_DIM, generator=generator)
    return latents, torch.tensor([937.0, 281.5]), text


def two_steps(forward, run) -> list[torch.Tensor]:
    """Two calls of one request: SVG2's second starts its k-means from the first's centroids, and Ulysses balances
    its heads by the first's kept tiles."""
    run.begin_request(None)
    with torch.no_grad(), reference_attention():
        return [forward(*inputs()) for _ in range(2)]


@functools.cache
def one_process(method: str) -> tuple[list[torch.Tensor], float]:
    model, run = sparse_wan(method)
    outputs = two_steps(model, run)
    return outputs, run.density


def _on_ranks(method: str, plan: ParallelConfig, serial: list[torch.Tensor]) -> dict:
    model, run = sparse_wan(method)
    context = ParallelContext.build(plan, torch.device("cpu"))
    orders = []
    balance = SparseSelfAttention.head_order

    def recorded(self, *args):
        orders.append(order := balance(self, *args))
        return order

    SparseSelfAttention.head_order = recorded
    try:
        outputs = two_steps(parallelize(model, None, context).forward, run)
    finally:
        SparseSelfAttention.head_order = balance
    return {
        "errors": [relative_l2(got, want) for got, want in zip(outputs, serial, strict=True)],
        "density": run.density,
        "orders": orders,
    }


@pytest.mark.parametrize(
    "method, world, plan",
    [
        ("radial", 2, ParallelConfig(ulysses=2)),
        ("radial", 2, ParallelConfig(ring=2)),
        ("radial", 4, ParallelConfig(ulysses=2, ring=2)),
        ("svg2", 2, ParallelConfig(ulysses=2)),
        ("svg2", 3, ParallelConfig(ulysses=3)),
    ],
    ids=["radial-ulysses2", "radial-ring2", "radial-usp4", "svg2-ulysses2", "svg2-ulysses3"],
)
def test_a_plan_with_sparse_attention_equals_one_process(method, world, plan):
    serial, serial_density = one_process(method)
    results = run_on_processes(world, _on_ranks, method, plan, serial)
    assert max(results["errors"]) <= 1e-5, results
    assert 0.0 < serial_density < 1.0
    if method == "svg2":
        # Each rank's own heads' share of the density; the balanced order came from the first call's counts.
        assert any(order is not None for order in results["orders"]), results["orders"]
    if plan.ring == 1:
        assert results["density"] == pytest.approx(serial_density) or method == "svg2"


def test_cfg_parallel_rows_alone_equal_the_batch():
    """CFG parallel gives each rank its branch's rows: the masks are per row (radial's the same for all, SVG2's
    clusters each row's own), so the rows run alone equal the batch."""
    for method in ("radial", "svg2"):
        batch, _ = one_process(method)
        latents, timesteps, text = inputs()
        for row in range(2):
            model, run = sparse_wan(method)
            run.begin_request(None)
            with torch.no_grad(), reference_attention():
                alone = [model(latents[row : row + 1], timesteps[row : row + 1], text[row : row + 1]) for _ in range(2)]
            for got, want in zip(alone, batch, strict=True):
                assert relative_l2(got, want[row : row + 1]) <= 1e-5
