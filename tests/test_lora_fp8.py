"""An FP8 linear's side path in each variant (``paradit.lora.fp8_side_paths``) against ``sum``, today's: the output
within 1e-2 of sum's (FP8's own error against bf16 is 3.5e-2 here), and the update it adds to the FP8 base within
1e-1 of the exact low-rank product (the stacked down projection is an FP8 GEMM: its row-wise error, 3.5e-2, on top
of the bf16 output's rounding of a small update). CPU's ``torch._scaled_mm`` runs the FP8 GEMMs, as in the FP8 tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear
from paradit.lora.apply import LoraSidePath, fold_side_paths
from paradit.lora.fp8_side_paths import FP8_SIDE_PATHS

E4M3 = torch.float8_e4m3fn


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp8_side_path(in_features: int, out_features: int, rank: int, switchable: bool = False):
    """An FP8 linear with a bias and one adapter chosen (a run's: no factors kept, unless ``switchable``), an input,
    and the exact low-rank update of it."""
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(rank)
    linear = nn.Linear(in_features, out_features).bfloat16()
    down = (torch.randn(rank, in_features, generator=generator) * in_features**-0.5).bfloat16()
    up = (torch.randn(out_features, rank, generator=generator) * 0.01).bfloat16()
    path = LoraSidePath(Fp8Linear.from_linear(linear, E4M3), {"adapter": (down, up, None)})
    path.select({"adapter": 1.0})
    if not switchable:
        path.factors = {}
    x = torch.randn(3, 7, in_features, generator=generator).bfloat16()
    return path, x, (x.float() @ down.float().T) @ up.float().T


# A widening linear (every variant applies) and a narrowing one (a fold does not pay: it runs ``sum``).
RUNS = {
    (64, 96): {variant: variant for variant in FP8_SIDE_PATHS},
    (96, 48): {variant: "sum" if variant == "fold" else variant for variant in FP8_SIDE_PATHS},
}


@pytest.mark.parametrize("shape", list(RUNS))
@pytest.mark.parametrize("variant", [variant for variant in FP8_SIDE_PATHS if variant != "sum"])
def test_each_fp8_side_path_equals_the_sum_within_fp8s_error(shape, variant):
    path, x, update = fp8_side_path(*shape, rank=5)
    with torch.inference_mode():
        base, summed = path.linear(x), path(x)
        fold_side_paths(path, variant)
        out = path(x)
    assert path.fp8_path == RUNS[shape][variant]
    assert out.shape == summed.shape
    assert relative_l2(out, summed) < 1e-2
    assert relative_l2(out.float() - base.float(), update) < 1e-1


def test_stacking_and_folding_widen_the_fp8_weight_to_whole_multiples():
    stacked, _, _ = fp8_side_path(64, 96, rank=5)
    folded, _, _ = fp8_side_path(64, 96, rank=5)
    fold_side_paths(stacked, "stacked")
    fold_side_paths(folded, "fold")
    assert stacked.linear.weight.shape == (96 + 16, 64) and stacked.linear.weight_scale.shape == (96 + 16, 1)
    assert stacked.up.shape == (96, 16) and not stacked.up[:, 5:].any()
    assert folded.linear.weight.shape == (96, 128) and folded.up is None and folded.down.shape == (128 - 64, 64)


def test_a_servers_adapters_keep_the_weight_and_an_accumulating_path_runs_after_a_choice():
    expected = {"stacked": "sum", "stacked-accumulate": "accumulate", "fold": "sum", "accumulate": "accumulate"}
    for variant, runs in expected.items():
        path, x, _ = fp8_side_path(64, 96, rank=5, switchable=True)
        path.select({})
        fold_side_paths(path, variant)
        assert path.fp8_path == runs and path.linear.weight.shape == (96, 64)
    with torch.inference_mode():
        plain = path(x)
        path.select({"adapter": 1.0})
        accumulated = path(x)
        path.fp8_path = "sum"
        summed = path(x)
    assert torch.equal(plain, path.linear(x))
    assert relative_l2(accumulated, summed) < 1e-2


def test_the_in_place_accumulation_traces_into_a_compiled_graph():
    path, x, _ = fp8_side_path(64, 96, rank=5)
    fold_side_paths(path, "stacked-accumulate")
    with torch.inference_mode():
        eager = path(x)
        torch._dynamo.reset()
        compiled = torch.compile(path, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_an_unknown_fp8_side_path_is_refused_naming_the_variants():
    path, _, _ = fp8_side_path(64, 96, rank=5)
    with pytest.raises(ValueError, match="unknown FP8 side path 'fused'.*sum, addmm"):
        fold_side_paths(path, "fused")
