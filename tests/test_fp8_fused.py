"""The fused kernels of ``paradit.layers.fp8_fused``, run by Triton's interpreter on the CPU, against the unfused torch
path they replace: the modulated LayerNorm and the bias + tanh GELU each quantized to FP8 in one pass, and the Q/K RMS
norm with the rotary embedding; then a Wan block and a GELU MLP with FP8 linears, fused against unfused.

The stated error. The kernels round where the torch path rounds, but reduce in another order (a row's mean, variance,
mean square), compute exp where torch computes tanh and multiply by the scale's reciprocal where torch divides by it,
so an activation's fp32 value moves by a few ulps; where that moves its bf16 rounding, the activation moves by one
bf16 step, and its FP8 code by at most one step (e4m3 steps are 16 times bf16's). So: every FP8 code equal or one
step apart, almost all equal (0.07% apart at widths 5120 and 13824 here), the row scales within a bf16 step; the
rotated Q/K within one bf16 step of each value."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from paradit.families.wan import model as wan_model
from paradit.families.wan.model import WanBlock, WanConfig
from paradit.layers import feedforward
from paradit.layers.feedforward import GeluFeedForward
from paradit.layers.fp8 import Fp8Linear, QuantizedRows, quantize_rowwise
from paradit.layers.fp8_fused import (
    FUSIONS,
    choose_fusions,
    gelu_quantized,
    modulated_layer_norm_fp8,
    normed_rotated,
    uses_fusion,
)
from paradit.layers.rotary import apply_rope_interleaved, multi_axis_rope
from paradit.quantize import convert_fp8

E4M3 = torch.float8_e4m3fn
BF16_STEP = 2.0**-7  # bf16's largest relative rounding step (8 significand bits)


def ordinals(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed integers in the order of their values (sign and magnitude bits; both zeros 0)."""
    bits = codes.view(torch.uint8).int()
    return torch.where(bits >= 128, -(bits & 0x7F), bits)


def assert_within_one_code(fused: QuantizedRows, reference: torch.Tensor, reference_scale: torch.Tensor) -> None:
    """Every code equal or the next one, under 1% of them not equal; the scales within a bf16 step."""
    assert fused.values.shape == reference.shape and fused.values.dtype == reference.dtype
    apart = (ordinals(fused.values) - ordinals(reference)).abs()
    assert apart.max() <= 1
    assert apart.bool().float().mean() < 0.01
    assert torch.allclose(fused.scale, reference_scale, rtol=BF16_STEP, atol=0)


def modulation(batch: int, tokens: int, width: int, generator: torch.Generator):
    """(shift, scale) as Wan's blocks unbind them: strided float32 views of a (B, T, 6, W) table."""
    table = torch.randn(batch, tokens, 6, width, generator=generator) * 0.5
    return table[:, :, 0], table[:, :, 1]


@pytest.mark.parametrize(
    "batch, tokens, width, per_token",
    [(2, 7, 40, False), (1, 5, 24, True), (1, 3, 5120, False)],
    ids=["tiny", "per-token-odd-width", "wan-width"],
)
def test_modulated_layer_norm_quantized_in_one_pass_equals_the_torch_path(batch, tokens, width, per_token):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(batch, tokens, width, generator=generator) * 3 + 1).bfloat16()
    shift, scale = modulation(batch, tokens if per_token else 1, width, generator)
    norm = nn.LayerNorm(width, eps=1e-6, elementwise_affine=False)
    fused = modulated_layer_norm_fp8(x, norm, shift, scale, E4M3)
    modulated = (norm(x.float()) * (1 + scale) + shift).to(x.dtype)
    assert fused.leading == (batch, tokens)
    assert_within_one_code(fused, *quantize_rowwise(modulated.reshape(-1, width), E4M3))


@pytest.mark.parametrize("rows, width, bias", [(9, 48, True), (3, 13824, True), (4, 40, False)])
def test_bias_and_gelu_quantized_in_one_pass_equal_the_torch_path(rows, width, bias):
    generator = torch.Generator().manual_seed(width)
    hidden = (torch.randn(rows, width, generator=generator) * 2).bfloat16()
    bias_values = (torch.randn(width, generator=generator) * 0.3).bfloat16() if bias else None
    fused = gelu_quantized(hidden, bias_values, (rows,), E4M3)
    biased = hidden if bias_values is None else hidden + bias_values
    activated = nn.functional.gelu(biased, approximate="tanh")
    assert_within_one_code(fused, *quantize_rowwise(activated, E4M3))


@pytest.mark.parametrize("heads, head_dim, tokens, weight", [(3, 24, 7, True), (40, 128, 2, True), (2, 8, 5, False)])
def test_rms_norm_with_rotary_in_one_pass_equals_the_torch_path(heads, head_dim, tokens, weight):
    generator = torch.Generator().manual_seed(heads)
    x = (torch.randn(2, tokens, heads * head_dim, generator=generator) * 4).bfloat16()
    norm = nn.RMSNorm(heads * head_dim, eps=1e-6, elementwise_affine=weight).bfloat16()
    if weight:
        norm.weight.data = (1 + 0.2 * torch.randn(heads * head_dim, generator=generator)).bfloat16()
    third = head_dim // 6 * 2
    rope = multi_axis_rope(
        torch.randint(0, 30, (tokens, 3), generator=generator), (head_dim - 2 * third,) + (third,) * 2, 1e4
    )
    fused = normed_rotated(x, norm, rope, head_dim)
    reference = apply_rope_interleaved(norm(x).unflatten(-1, (-1, head_dim)), *rope)
    assert fused.shape == reference.shape and fused.dtype == reference.dtype
    step = BF16_STEP * reference.float().abs().clamp_min(2.0**-20)
    assert ((fused.float() - reference.float()).abs() <= step + 1e-6).all()


def test_the_cpu_runs_the_torch_path_unless_a_fusion_is_chosen():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not uses_fusion(cpu, "norm_quantize", None)
    assert uses_fusion(gpu, "norm_quantize", None)
    assert uses_fusion(cpu, "norm_quantize", frozenset(FUSIONS))  # the interpreter, as these tests run
    assert not uses_fusion(gpu, "norm_quantize", frozenset())
    with pytest.raises(ValueError, match="unknown fusions \\['norm'\\]; the fusions are norm_quantize"):
        choose_fusions(nn.Module(), frozenset({"norm"}))


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def counted(monkeypatch, module, name: str) -> list:
    calls, kernel = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(name) or kernel(*args))
    return calls


def test_a_wan_block_with_fp8_linears_runs_fused_as_unfused(monkeypatch):
    """Every fusion at once in a block of two heads: the FP8 GEMMs see codes one step apart at most, so the block's
    output stays within a small fraction of FP8's own error of the unfused one (here it is equal)."""
    calls = [counted(monkeypatch, wan_model, name) for name in ("modulated_layer_norm_fp8", "normed_rotated")]
    calls.append(counted(monkeypatch, feedforward, "gelu_quantized"))
    torch.manual_seed(0)
    config = WanConfig(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, text_dim=32)
    block = WanBlock(config)
    for parameter in block.parameters():
        nn.init.normal_(parameter, std=0.2)
    with torch.no_grad():
        block = block.bfloat16()
        x = torch.randn(2, 12, 32).bfloat16()
        context = torch.randn(2, 5, 32).bfloat16()
        mod = torch.randn(2, 1, 6, 32) * 0.3
        rope = multi_axis_rope(torch.cartesian_prod(torch.arange(3), torch.arange(2), torch.arange(2)), (6, 4, 6), 1e4)
        bf16 = block(x, context, None, mod, rope)
        convert_fp8(block, E4M3, keep=())
        assert all(isinstance(layer, Fp8Linear) for layer in (block.attn1.to_q, block.ffn.net[2]))
        choose_fusions(block, frozenset())
        unfused = block(x, context, None, mod, rope)
        choose_fusions(block, frozenset(FUSIONS))
        fused = block(x, context, None, mod, rope)
    assert [len(made) for made in calls] == [2, 2, 1]  # norm1 and norm3; Q and K; the MLP's hidden activations
    assert relative_l2(fused, unfused) < 0.2 * relative_l2(unfused, bf16)


def test_the_gelu_mlp_quantizes_its_hidden_activations_in_the_fused_kernel(monkeypatch):
    calls = counted(monkeypatch, feedforward, "gelu_quantized")
    torch.manual_seed(1)
    mlp = GeluFeedForward(32, 96, 32).bfloat16()
    x = torch.randn(3, 4, 32).bfloat16()
    with torch.no_grad():
        convert_fp8(mlp, E4M3, keep=())
        choose_fusions(mlp, frozenset())
        unfused = mlp(x)
        choose_fusions(mlp, frozenset({"gelu_quantize"}))
        fused = mlp(x)
    assert fused.shape == (3, 4, 32) and calls == ["gelu_quantized"]
    assert relative_l2(fused, unfused) < 1e-2


def test_the_benchmark_runs_each_fusion_on_and_off_in_one_call(tmp_path, monkeypatch):
    """benchmarks/wan_fusions.py --tiny: the fused kernels appear in the fused variant's kernels only, its output
    equal to the unfused variant's within the stated error."""
    from benchmarks import forward_profile, wan_fusions

    argv = ["wan_fusions.py", "--tiny", "--blocks", "1", "--variants", "none", "all", "--iters", "1"]
    monkeypatch.setattr("sys.argv", [*argv, "--out-dir", str(tmp_path)])
    wan_fusions.main()
    result = json.loads((tmp_path / "wan_fusions.json").read_text())
    assert [row["variant"] for row in result["rows"]] == ["none", "all"] and not result["skipped"]
    assert result["rows"][1]["rel_l2_vs_first"] < 1e-2
    fused_kinds = {kind for kind, _ in forward_profile.KINDS if kind.startswith("fused")}
    calls = {(row["variant"], row["kind"]): row["calls"] for row in result["kernels"] if row["what"] == row["kind"]}
    assert {kind for variant, kind in calls if variant == "none"}.isdisjoint(fused_kinds)
    assert sorted(calls[("all", kind)] for kind in fused_kinds) == [1, 2, 2]


def test_a_kernel_runs_with_the_warps_measured_fastest_on_its_first_call(monkeypatch):
    import triton

    from paradit.layers import fp8_fused

    times = {4: 3.0, 8: 1.0, 16: 2.0}
    launched = []
    monkeypatch.setattr(fp8_fused, "interpreting", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda run, **_: run() or times[launched[-1]])
    monkeypatch.setattr(fp8_fused, "_CHOSEN", {})
    fp8_fused._run_fastest(("kernel", 5120), 8192, launched.append)
    assert launched == [4, 8, 16, 8]  # each timed, then the fastest
    fp8_fused._run_fastest(("kernel", 5120), 8192, launched.append)
    assert launched[4:] == [8]  # measured once per key
    fp8_fused._run_fastest(("kernel", 24), 32, launched.append)
    assert launched[5:] == [1]  # a block too short for 4 warps: one, untimed
