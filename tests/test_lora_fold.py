"""A fixed adapter's side path folded into its base GEMM (``LoraSidePath.fold``): ``[W, up]`` times ``[x, x @ down.T]``
against the side path's ``W x + up (down x)``, in float32 and bf16, and where it does not fold (FP8 linears among
them: folding measured slower there). The stated error: float32 and bf16 only reorder the GEMM's sums (bf16 also
rounds the low-rank product once more, before the GEMM)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear
from paradit.lora.apply import LoraSidePath, fold_side_paths

E4M3 = torch.float8_e4m3fn


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def side_path(in_features: int, out_features: int, rank: int, dtype: torch.dtype, switchable: bool = False):
    """A linear with one adapter chosen (as a run's fixed adapters: no factors kept, unless ``switchable``); its
    weights uniform within ±in^-0.5 (torch's default), ``up`` of 0.01."""
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(rank)  # the linear's own initialization
    linear = nn.Linear(in_features, out_features).to(dtype)
    down = (torch.randn(rank, in_features, generator=generator) * in_features**-0.5).to(dtype)
    up = (torch.randn(out_features, rank, generator=generator) * 0.01).to(dtype)
    path = LoraSidePath(linear, {"adapter": (down, up, None)})
    path.select({"adapter": 1.0})
    if not switchable:
        path.factors = {}
    return path, torch.randn(3, 7, in_features, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_a_folded_side_path_equals_the_side_path(dtype, bound):
    path, x = side_path(48, 80, 5, dtype)
    with torch.no_grad():
        unfolded = path(x)
        assert fold_side_paths(path) == 1
        folded = path(x)
    assert path.up is None and path.folded and path.linear.weight.shape == (80, 48 + 5)
    assert relative_l2(folded, unfolded) < bound


def test_a_narrowing_linear_and_a_servers_switchable_adapters_stay_side_paths():
    narrowing, _ = side_path(96, 48, 4, torch.float32)
    switchable, _ = side_path(48, 96, 4, torch.float32, switchable=True)
    assert not narrowing.folds() and not switchable.folds()
    assert fold_side_paths(nn.ModuleList([narrowing, switchable])) == 0


def test_an_fp8_linears_side_path_stays_unfolded():
    path, _ = side_path(64, 96, 5, torch.bfloat16)
    path.linear = Fp8Linear.from_linear(path.linear, E4M3)
    assert not path.folds() and fold_side_paths(path) == 0
