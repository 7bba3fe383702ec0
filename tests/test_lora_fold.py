"""A fixed adapter's side path folded into its base GEMM (``LoraSidePath.fold``): ``[W, up]`` times ``[x, x @ down.T]``
against the side path's ``W x + up (down x)``, in float32, bf16 and FP8, and where it does not fold. The stated error:
float32 and bf16 only reorder the GEMM's sums (bf16 also rounds the low-rank product once more, before the GEMM); an
FP8 fold is within 1e-2 of the FP8 side path (FP8's own error against bf16 is 3.5e-2 here), and the update it adds to
the FP8 base within 1e-1 of the exact low-rank product (``up`` and the low-rank product are FP8 there too). CPU's
``torch._scaled_mm`` runs the FP8 GEMMs, as in the FP8 tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear
from paradit.lora.apply import LoraSidePath, fold_side_paths, fp8_fold_bytes

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


def fp8_side_path(in_features: int, out_features: int, up_scale: float = 1.0):
    """``side_path``'s bf16 linear made FP8 (as the loader swaps it in before folding), ``up`` times ``up_scale``."""
    path, x = side_path(in_features, out_features, 5, torch.bfloat16)
    path.linear, path.up = Fp8Linear.from_linear(path.linear, E4M3), path.up * up_scale
    return path, x


def test_an_fp8_side_path_folds_into_the_fp8_weight_its_depth_a_whole_tile():
    path, x = fp8_side_path(64, 96)
    with torch.no_grad():
        base, unfolded = path.linear(x), path(x)
        up, down = path.up.float(), path.down.float()
        assert fold_side_paths(path) == 1
        folded = path(x)
    assert path.folded and path.up is None
    assert path.linear.weight.shape == (96, 128) and path.linear.weight.dtype == E4M3 and path.linear.in_features == 128
    assert path.down.shape == (128 - 64, 64) and not path.down[5:].any()
    assert relative_l2(folded, unfolded) < 1e-2
    assert relative_l2(folded.float() - base.float(), (x.float() @ down.T) @ up.T) < 1e-1


def test_the_memory_check_counts_the_columns_an_fp8_fold_adds():
    path, _ = fp8_side_path(64, 96)
    before = path.linear.weight.numel()
    fold_side_paths(path)
    with torch.device("meta"):
        model = nn.ModuleDict({"wide": nn.Linear(64, 96), "narrowing": nn.Linear(96, 48)})
    keyed = {name: [("adapter", SimpleNamespace(down=torch.empty(5, 1)))] for name in model}
    assert fp8_fold_bytes(model, keyed) == path.linear.weight.numel() - before == 96 * (128 - 64)


def test_an_fp8_side_path_stays_beside_its_linear_where_up_would_leave_the_formats_range_or_the_width_does_not_pay():
    loud, _ = fp8_side_path(64, 96, up_scale=2000.0)  # up 20x the weights: folded, the update would set the row scale
    narrowing, _ = fp8_side_path(96, 48)
    assert not loud.folds() and not narrowing.folds()
    assert fold_side_paths(nn.ModuleList([loud, narrowing])) == 0


def test_a_folded_fp8_side_path_traces_into_one_compiled_graph():
    path, x = fp8_side_path(64, 96)
    fold_side_paths(path)
    with torch.no_grad():
        eager = path(x)
        torch._dynamo.reset()
        compiled = torch.compile(path, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)
