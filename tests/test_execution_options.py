"""FP8 linears and regional compilation, everything of them that runs on a CPU."""

from __future__ import annotations

import pytest
import torch

from paradit import Engine, InvalidRequest
from paradit.compile import compile_blocks
from paradit.families import FAMILIES
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.layers.fp8 import Fp8Linear, check_fp8_supported, quantize_rowwise, quantize_weight
from paradit.options import ExecutionOptions
from paradit.quantize import quantizable
from tests.checkpoints import randomize, relative_l2, tiny_transformer_config

E4M3 = torch.float8_e4m3fn


def test_rowwise_scales_map_each_rows_absmax_to_the_format_maximum():
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]  # rows six orders of magnitude apart
    q, scale = quantize_rowwise(x, E4M3)
    assert q.dtype == E4M3 and scale.shape == (6, 1)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((6,), 448.0))
    # Per-row scaling keeps every row's relative error at e4m3's resolution, however small the row.
    for row in range(6):
        assert relative_l2(q[row].float() * scale[row], x[row]) < 0.05


def test_fp8_linear_matches_its_dequantized_math_and_stays_near_bf16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=True).to(torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear, E4M3)
    assert fp8.weight.dtype == E4M3 and fp8.weight_scale.shape == (64, 1)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    out = fp8(x)
    assert out.shape == (3, 5, 64) and out.dtype == torch.bfloat16
    x_q, x_scale = quantize_rowwise(x.reshape(-1, 128), E4M3)
    emulated = (x_q.float() * x_scale) @ (fp8.weight.float() * fp8.weight_scale).T + linear.bias.float()
    assert relative_l2(out.reshape(-1, 64), emulated) < 1e-2  # only bf16 output rounding apart
    assert relative_l2(out, linear(x)) < 6e-2  # FP8's own error against bf16


def test_layer_selection_keeps_embedders_modulation_and_output_in_high_precision():
    model = Flux2Transformer(Flux2Config.from_dict(tiny_transformer_config(guidance_embeds=True)))
    keep = FAMILIES["flux2"].keep_high_precision
    chosen = {name for name, module in model.named_modules() if quantizable(name, module, keep)}
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    kept = linears - chosen
    assert kept == {
        "time_guidance_embed.timestep_embedder.linear_1",
        "time_guidance_embed.timestep_embedder.linear_2",
        "time_guidance_embed.guidance_embedder.linear_1",
        "time_guidance_embed.guidance_embedder.linear_2",
        "double_stream_modulation_img.linear",
        "double_stream_modulation_txt.linear",
        "single_stream_modulation.linear",
        "x_embedder",
        "context_embedder",
        "norm_out.linear",
        "proj_out",
    }
    assert "transformer_blocks.0.attn.to_q" in chosen and "single_transformer_blocks.1.attn.to_qkv_mlp_proj" in chosen


def test_fp8_is_refused_where_no_kernel_exists():
    with pytest.raises(InvalidRequest, match="FP8 execution needs a GPU, not cpu"):
        check_fp8_supported(torch.device("cpu"))
    with pytest.raises(InvalidRequest, match="run without --quantize fp8"):
        Engine("flux2-tiny", device="cpu", options=ExecutionOptions(quantize="fp8"))
    with pytest.raises(InvalidRequest, match="--quantize 'int4' is not allowed; choose one of none, fp8"):
        Engine("flux2-tiny", device="cpu", options=ExecutionOptions(quantize="int4"))


def test_regional_compile_equals_eager():
    torch.manual_seed(0)
    model = Flux2Transformer(Flux2Config.from_dict(tiny_transformer_config(guidance_embeds=False))).eval()
    randomize(model)
    gen = torch.Generator().manual_seed(0)
    one = torch.arange(1)
    inputs = dict(
        hidden_states=torch.randn(1, 12, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 5, model.config.joint_attention_dim, generator=gen),
        timestep=torch.rand(1, generator=gen),
        img_ids=torch.cartesian_prod(one, torch.arange(3), torch.arange(4), one),
        txt_ids=torch.cartesian_prod(one, one, one, torch.arange(5)),
    )
    with torch.no_grad():
        eager = model(**inputs)
        assert compile_blocks(model) == 4  # 2 double-stream + 2 single-stream blocks
        compiled = model(**inputs)
    assert relative_l2(compiled, eager) < 1e-5


@pytest.mark.parametrize(
    "family,name,expected",
    [
        ("sd3", "transformer_blocks.3.norm1.linear", False),  # SD3 AdaLN modulation
        ("qwen_image", "transformer_blocks.3.img_mod.1", False),  # Qwen-Image modulation
        ("zimage", "layers.0.adaLN_modulation.0", False),  # Z-Image modulation
        ("zimage", "all_final_layer.2-1.linear", False),  # Z-Image output layer
        ("qwen_image", "img_in", False),
        ("qwen_image", "transformer_blocks.3.attn.to_q", True),
        ("sd3", "transformer_blocks.3.attn.to_q", True),
        ("zimage", "layers.0.feed_forward.w1", True),
    ],
)
def test_layer_selection_across_families(family, name, expected):
    assert quantizable(name, torch.nn.Linear(32, 32), FAMILIES[family].keep_high_precision) is expected


def test_weights_convert_block_by_block_to_the_same_bits():
    """``quantize_weight`` works through 2^24 elements at a time (8 rows here): the same FP8 bits and scales as
    converting the whole weight at once."""
    weight = torch.randn(9, 2**21, dtype=torch.bfloat16) * torch.logspace(-2, 2, 9, dtype=torch.bfloat16)[:, None]
    blocks, block_scales = quantize_weight(weight, E4M3)
    whole, scales = quantize_rowwise(weight, E4M3)
    assert torch.equal(blocks.view(torch.uint8), whole.view(torch.uint8)) and torch.equal(block_scales, scales)
