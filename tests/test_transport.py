"""FP8 transport's row codec: each row's e4m3 bytes and its float32 scale in one uint8 row."""

from __future__ import annotations

import torch

from paradit.layers.fp8 import quantize_rowwise
from paradit.parallel.transport import TRANSPORT_FP8, decode_fp8_rows, encode_fp8_rows


def test_rows_carry_their_scale_and_decode_to_the_rowwise_quantisation():
    torch.manual_seed(0)
    # Rows of very different magnitudes: each must keep its own resolution.
    x = torch.randn(2, 7, 3, 64) * torch.logspace(-3, 3, 7)[None, :, None, None]
    packed = encode_fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 7, 3, 68)
    payload, scale = quantize_rowwise(x, TRANSPORT_FP8)
    assert torch.equal(packed[..., :64], payload.view(torch.uint8))
    assert torch.equal(packed[..., 64:].contiguous().view(torch.float32), scale)
    decoded = decode_fp8_rows(packed, torch.float32)
    assert torch.equal(decoded, payload.float() * scale)
    # e4m3 keeps 3 mantissa bits: every row within 2^-4 of its own largest value, whatever its magnitude.
    row_error = (decoded - x).abs().amax(-1) / x.abs().amax(-1)
    assert row_error.max().item() <= 2**-4


def test_decoding_a_slice_of_rows_needs_no_other_rows():
    """What a collective delivers is some rows of some ranks: each decodes on its own."""
    x = torch.randn(1, 10, 2, 32, dtype=torch.bfloat16)
    packed = encode_fp8_rows(x)
    whole = decode_fp8_rows(packed, torch.bfloat16)
    assert torch.equal(decode_fp8_rows(packed[:, 3:6], torch.bfloat16), whole[:, 3:6])


def test_compiled_codec_matches_eager_bit_for_bit():
    """GPUs run the codec compiled; the scale's bytes must come out (and back) the same as in eager mode."""
    from paradit.parallel import transport

    x = torch.randn(1, 96, 4, 32, dtype=torch.bfloat16) * 5
    packed = transport._encode(x)
    assert torch.equal(torch.compile(transport._encode, dynamic=False)(x), packed)
    decode = torch.compile(transport._decode, dynamic=False)
    assert torch.equal(decode(packed, torch.bfloat16), transport._decode(packed, torch.bfloat16))
