"""A fixed adapter's side path folded into its base GEMM (``LoraSidePath.fold``): ``[W, up]`` times ``[x, x @ down.T]``
against the side path's ``W x + up (down x)``, in float32, bf16 and FP8, and where it does not fold. The stated error:
float32 and bf16 only reorder the GEMM's sums (bf16 also rounds the low-rank product once more, before the GEMM);
FP8 rounds ``up`` and the low-rank product to e4m3 (2^-4 of a value at most), so the update errs by a few percent of
itself, far inside FP8's own error on the base product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear
from paradit.lora.apply import MIN_FP8_FOLD, LoraSidePath, fold_side_paths

E4M3 = torch.float8_e4m3fn


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def side_path(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, switchable: bool = False, up_std: float = 0.01
):
    """A linear with one adapter chosen (as a run's fixed adapters: no factors kept, unless ``switchable``); its
    weights uniform within ±in^-0.5 (torch's default), ``up`` of ``up_std``."""
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(rank)  # the linear's own initialization
    linear = nn.Linear(in_features, out_features).to(dtype)
    down = (torch.randn(rank, in_features, generator=generator) * in_features**-0.5).to(dtype)
    up = (torch.randn(out_features, rank, generator=generator) * up_std).to(dtype)
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
    assert path.up is None and path.linear.weight.shape == (80, 48 + 5)
    assert relative_l2(folded, unfolded) < bound


def test_an_fp8_side_path_folds_its_up_projection_over_the_weights_row_scales():
    """``up`` well within the weights' range (as trained adapters are): the low-rank product, divided by ``c``, stays
    below the input's largest value, so the input's FP8 codes and scale are those of the side path and only the
    update's own rounding differs."""
    path, x = side_path(64, 96, 5, torch.bfloat16)
    path.linear = Fp8Linear.from_linear(path.linear, E4M3)
    with torch.no_grad():
        unfolded = path(x)
        update = (x @ path.down.T) @ path.up.T
        assert fold_side_paths(path) == 1
        folded = path(x)
    # The rank padded to the FP8 GEMM's depth with zeros; the base weights' codes and row scales unchanged.
    assert path.linear.weight.shape == (96, 64 + 16) and path.down.shape == (16, 64)
    assert path.folded_scale < 1
    assert (folded.float() - unfolded.float()).norm() < 0.1 * update.float().norm()


def test_an_fp8_update_larger_than_the_weights_folds_within_fp8s_error():
    """``up`` beyond the weights' row ranges: ``c`` < 1 enlarges the low-rank product past the input's largest value,
    which then sets the row's FP8 scale (coarser by 1 / c at most); the result errs as FP8 does, against the exact
    float32 side path."""
    path, x = side_path(64, 96, 5, torch.bfloat16, up_std=0.3)
    exact = nn.functional.linear(x.float(), path.linear.weight.float(), path.linear.bias.float())
    exact += (x.float() @ path.down.float().T) @ path.up.float().T
    path.linear = Fp8Linear.from_linear(path.linear, E4M3)
    with torch.no_grad():
        unfolded = path(x)
        fold_side_paths(path)
        folded = path(x)
    assert 1 < path.folded_scale <= 1 / MIN_FP8_FOLD
    assert relative_l2(folded, exact) < min(path.folded_scale * relative_l2(unfolded, exact), 0.1)


def test_a_narrowing_linear_and_a_servers_switchable_adapters_stay_side_paths():
    narrowing, _ = side_path(96, 48, 4, torch.float32)
    switchable, _ = side_path(48, 96, 4, torch.float32, switchable=True)
    assert not narrowing.folds() and not switchable.folds()
    assert fold_side_paths(nn.ModuleList([narrowing, switchable])) == 0


def test_an_fp8_update_far_beyond_the_weights_row_scales_stays_a_side_path():
    path, _ = side_path(64, 96, 5, torch.bfloat16, up_std=5.0)
    path.linear = Fp8Linear.from_linear(path.linear, E4M3)
    assert path.fp8_fold_factor() < MIN_FP8_FOLD and not path.folds()
