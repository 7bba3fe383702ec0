"""Kernels that fuse a block's memory-bound steps where the data already is: the modulated LayerNorm, or the bias and
the tanh GELU, with the FP8 activation quantization of the linears they feed (one pass: the op, its absolute maximum
per row, the scale and the cast), and Wan's Q/K RMS norm with the rotary embedding. Each replaces several kernels
that each read and write the activations (Inductor's measured 1.6-4.4x their memory traffic at Wan 720p).

Each follows the unfused torch path's roundings (the activations rounded to their dtype where the model rounds, the
scale as ``quantize_rowwise`` divides it, the cast to nearest); only reductions' order and a few fp32 ulps of the
transcendental functions differ, so an activation's bf16 rounding, and then its FP8 code, moves by one step in a rare
element. The torch path stays the CPU's and every case a kernel does not take (tensor-parallel norms, LoRA side paths,
an erf GELU). Imports no ``torch.distributed``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paradit.layers.fp8 import QuantizedRows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path
    triton = None

if triton is not None:
    from paradit.layers.fp8_attention import _to_8bit, interpreting, rounding

FUSIONS = ("norm_quantize", "gelu_quantize", "qk_norm_rope")
# The fusions a GPU runs unless a module is given its own choice (``choose_fusions``). All three, by their memory
# traffic (one read and one write of the activations, against the several of Inductor's kernels), until measured:
# benchmarks/wan_fusions.py times each on and off on the Wan 2.2 A14B expert's blocks at 1280x720x81, and one that
# is not faster there leaves this set.
MEASURED_FASTER = frozenset(FUSIONS)


def uses_fusion(device: torch.device, fusion: str, chosen: frozenset[str] | None) -> bool:
    """``chosen`` None: a GPU's measured choice (the CPU runs the torch path); a set: those, on a GPU or in Triton's
    interpreter (the tests)."""
    if triton is None:
        return False
    if chosen is None:
        return device.type == "cuda" and fusion in MEASURED_FASTER
    return fusion in chosen and (device.type == "cuda" or interpreting())


def choose_fusions(model: nn.Module, chosen: frozenset[str] | None) -> None:
    """Every module of ``model`` that offers fusions runs ``chosen`` (None: the measured choice); for benchmarks and
    tests, which run each with and without."""
    unknown = set(chosen or ()) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; the fusions are {', '.join(FUSIONS)}")
    for module in model.modules():
        if hasattr(module, "fusions"):
            module.fusions = chosen


# The warps a row kernel may run with, measured on its first call (``_run_fastest``).
WARPS = (4, 8, 16)
# Rows a program of the quantizing kernels takes in turn: what every row shares (a sample's modulation, the bias; each
# as many bytes as a row or more) is read from L2 once for them.
ROWS = 4
_CHOSEN: dict[tuple, int] = {}


def _run_fastest(key: tuple, block: int, launch: Callable[[int], None]) -> None:
    """``launch(num_warps)`` with the warps measured fastest for ``key`` (the kernel, its shape, the device) the first
    time: how many lanes share a row's reductions pays differently on each GPU (warps of 32 or 64 lanes). Triton's
    interpreter runs the fewest."""
    candidates = [warps for warps in WARPS if warps * 32 <= block] or [1]
    if interpreting() or len(candidates) == 1:
        launch(candidates[0])
        return
    warps = _CHOSEN.get(key)
    if warps is None:
        timed = {
            warps: triton.testing.do_bench(lambda warps=warps: launch(warps), warmup=5, rep=20) for warps in candidates
        }
        warps = _CHOSEN[key] = min(timed, key=timed.get)
    launch(warps)


if triton is not None:

    @triton.jit
    def _rounded(x, DTYPE: tl.constexpr, ROUND: tl.constexpr):
        """fp32 ``x`` rounded to nearest in ``DTYPE`` (bf16, fp16 or fp32), still fp32. ``ROUND``: in fp32
        arithmetic, for Triton's interpreter, whose own conversion truncates; Veltkamp's split by 2^s + 1 keeps
        fp32's 24 - s leading bits, to nearest (fp16's subnormals aside)."""
        if ROUND and DTYPE == tl.bfloat16:
            split = x * 65537.0
            x = split - (split - x)
        elif ROUND and DTYPE == tl.float16:
            split = x * 8193.0
            x = split - (split - x)
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _store_quantized(y, real, valid, OUT, OUT_SCALE, row, width, cols, FMAX: tl.constexpr, ROUND, TINY):
        """``quantize_rowwise`` of one row ``y`` (fp32 holding values of the activations' dtype; ``valid``: a row
        there is): the scale divided as torch divides it (to nearest), each value multiplied by its reciprocal (within
        an fp32 ulp of torch's quotient: a different FP8 code only at a tie's ulp), clamped and cast to nearest."""
        y = tl.where(real, y, 0.0)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y), 0), 1e-12), FMAX)
        q = tl.minimum(tl.maximum(y * tl.div_rn(1.0, scale), -FMAX), FMAX)
        tl.store(OUT + row * width + cols, _to_8bit(q, OUT.dtype.element_ty, ROUND, TINY), mask=real)
        tl.store(OUT_SCALE + row, scale, mask=valid)

    @triton.jit
    def _layer_norm_modulate_quantize(
        X,
        SHIFT,
        SCALE,
        OUT,
        OUT_SCALE,
        width,
        tokens,
        stride_x,
        stride_shift_b,
        stride_shift_t,
        stride_scale_b,
        stride_scale_t,
        eps,
        PER_TOKEN: tl.constexpr,
        ROWS: tl.constexpr,
        FMAX: tl.constexpr,
        BLOCK: tl.constexpr,
        ROUND: tl.constexpr,
        TINY: tl.constexpr,
    ):
        """``layer_norm(x) * (1 + scale) + shift`` in fp32 (no affine), rounded to x's dtype, then quantized: ``ROWS``
        tokens of one sample a program, whose modulation (one per sample) is read once for all of them."""
        first, b = tl.program_id(0) * ROWS, tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < width
        scale = tl.load(SCALE + b * stride_scale_b + first * stride_scale_t + cols, mask=in_row, other=0.0)
        shift = tl.load(SHIFT + b * stride_shift_b + first * stride_shift_t + cols, mask=in_row, other=0.0)
        for step in range(ROWS):
            t = first + step
            valid = t < tokens
            real = cols < tl.where(valid, width, 0)  # (a scalar's & with a block is not the interpreter's)
            row = b * tokens + t
            if PER_TOKEN:
                scale = tl.load(SCALE + b * stride_scale_b + t * stride_scale_t + cols, mask=real, other=0.0)
                shift = tl.load(SHIFT + b * stride_shift_b + t * stride_shift_t + cols, mask=real, other=0.0)
            x = tl.load(X + row * stride_x + cols, mask=real, other=0.0).to(tl.float32)
            mean = tl.sum(x, 0) / width
            centered = tl.where(real, x - mean, 0.0)
            normed = centered * tl.math.rsqrt(tl.sum(centered * centered, 0) / width + eps)
            y = _rounded(normed * (1.0 + scale) + shift, X.dtype.element_ty, ROUND)
            _store_quantized(y, real, valid, OUT, OUT_SCALE, row, width, cols, FMAX, ROUND, TINY)

    @triton.jit
    def _gelu_quantize(
        H,
        BIAS,
        OUT,
        OUT_SCALE,
        rows,
        width,
        stride_h,
        HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr,
        FMAX: tl.constexpr,
        BLOCK: tl.constexpr,
        ROUND: tl.constexpr,
        TINY: tl.constexpr,
    ):
        """A GEMM's output plus its bias (rounded, as the linear returns it), the tanh GELU (rounded), quantized;
        ``ROWS`` rows a program, the bias read once for them. ``0.5 (1 + tanh(u))`` is ``sigmoid(2u)``: one exp, the
        same on every vendor (libdevice's tanh is not in Triton's interpreter)."""
        first = tl.program_id(0).to(tl.int64) * ROWS
        cols = tl.arange(0, BLOCK)
        in_row = cols < width
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=in_row, other=0.0).to(tl.float32)
        for step in range(ROWS):
            row = first + step
            valid = row < rows
            real = cols < tl.where(valid, width, 0)
            h = tl.load(H + row * stride_h + cols, mask=real, other=0.0).to(tl.float32)
            if HAS_BIAS:
                h = _rounded(h + bias, H.dtype.element_ty, ROUND)
            inner = 0.7978845608028654 * (h + 0.044715 * (h * h * h))
            y = _rounded(h / (1.0 + tl.exp(-2.0 * inner)), H.dtype.element_ty, ROUND)
            _store_quantized(y, real, valid, OUT, OUT_SCALE, row, width, cols, FMAX, ROUND, TINY)

    @triton.jit
    def _rms_norm_rope(
        X,
        WEIGHT,
        COS,
        SIN,
        OUT,
        tokens,
        heads,
        stride_x,
        stride_rope,
        eps,
        HAS_WEIGHT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_BLOCK: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        """One token's row of every head: the RMS norm over all of them, times the weight, rounded once to the
        activations' dtype (as torch's ``rms_norm``), then each pair (2i, 2i+1) rotated by the token's angles in
        fp32 and rounded. Read and written contiguously (pairs split and joined in registers): vector accesses."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS_BLOCK)[:, None]
        channel = tl.arange(0, 2 * HALF_BLOCK)[None, :]
        real = (head < heads) & (channel < HEAD_DIM)
        offsets = head * HEAD_DIM + channel
        x = tl.load(X + row * stride_x + offsets, mask=real, other=0.0).to(tl.float32)
        inverse = tl.math.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / (heads * HEAD_DIM) + eps)
        if HAS_WEIGHT:
            x *= tl.load(WEIGHT + offsets, mask=real, other=0.0).to(tl.float32)
        dtype = X.dtype.element_ty
        n_even, n_odd = tl.split(tl.reshape(_rounded(x * inverse, dtype, ROUND), [HEADS_BLOCK, HALF_BLOCK, 2]))
        angles = (row % tokens) * stride_rope + channel
        in_head = channel < HEAD_DIM
        cos_even, cos_odd = tl.split(tl.reshape(tl.load(COS + angles, mask=in_head, other=0.0), [1, HALF_BLOCK, 2]))
        sin_even, sin_odd = tl.split(tl.reshape(tl.load(SIN + angles, mask=in_head, other=0.0), [1, HALF_BLOCK, 2]))
        rotated = tl.join(n_even * cos_even - n_odd * sin_even, n_odd * cos_odd + n_even * sin_odd)
        rotated = tl.reshape(rotated, [HEADS_BLOCK, 2 * HALF_BLOCK])
        tl.store(OUT + row * heads * HEAD_DIM + offsets, _rounded(rotated, dtype, ROUND).to(dtype), mask=real)


def _quantized_outputs(rows: int, width: int, dtype: torch.dtype, device: torch.device):
    return (
        torch.empty(rows, width, dtype=dtype, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def _rowwise(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Operators of their own, so that compiled blocks call each kernel as one opaque step (Dynamo cannot trace a launch);
# the fakes give the shapes for tracing. Exact float rounding wants no fused multiply-adds: fp fusion stays off.
@torch.library.custom_op("paradit::layer_norm_modulate_fp8", mutates_args=())
def layer_norm_modulate_fp8(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, W); shift and scale (B, 1 or T, W) float32 -> FP8 (B * T, W) and float32 scales (B * T, 1)."""
    batch, tokens, width = x.shape
    rows = _rowwise(x)
    shift, scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (shift, scale))
    out, out_scale = _quantized_outputs(rows.shape[0], width, dtype, x.device)
    block = triton.next_power_of_2(width)
    modulation_strides = [
        (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0) for t in (shift, scale)
    ]

    def launch(warps: int) -> None:
        _layer_norm_modulate_quantize[(triton.cdiv(tokens, ROWS), batch)](
            rows,
            shift,
            scale,
            out,
            out_scale,
            width,
            tokens,
            rows.stride(0),
            *modulation_strides[0],
            *modulation_strides[1],
            eps,
            PER_TOKEN=shift.shape[1] > 1 or scale.shape[1] > 1,
            ROWS=ROWS,
            FMAX=torch.finfo(dtype).max,
            BLOCK=block,
            **rounding(dtype),
            num_warps=warps,
            enable_fp_fusion=False,
        )

    _run_fastest(("layer_norm_modulate", x.device, width, x.dtype, dtype), block, launch)
    return out, out_scale


@layer_norm_modulate_fp8.register_fake
def _(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, dtype: torch.dtype):
    return _quantized_outputs(x.shape[0] * x.shape[1], x.shape[2], dtype, x.device)


@torch.library.custom_op("paradit::gelu_fp8", mutates_args=())
def gelu_fp8(hidden: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (rows, W), a GEMM's output before its bias -> FP8 gelu(hidden + bias) (rows, W), scales (rows, 1)."""
    hidden = _rowwise(hidden)
    out, out_scale = _quantized_outputs(*hidden.shape, dtype, hidden.device)
    block = triton.next_power_of_2(hidden.shape[1])

    def launch(warps: int) -> None:
        _gelu_quantize[(triton.cdiv(hidden.shape[0], ROWS),)](
            hidden,
            hidden if bias is None else bias,  # never read without a bias
            out,
            out_scale,
            hidden.shape[0],
            hidden.shape[1],
            hidden.stride(0),
            HAS_BIAS=bias is not None,
            ROWS=ROWS,
            FMAX=torch.finfo(dtype).max,
            BLOCK=block,
            **rounding(dtype),
            num_warps=warps,
            enable_fp_fusion=False,
        )

    _run_fastest(("gelu", hidden.device, hidden.shape[1], hidden.dtype, dtype, bias is None), block, launch)
    return out, out_scale


@gelu_fp8.register_fake
def _(hidden: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    return _quantized_outputs(*hidden.shape, dtype, hidden.device)


@torch.library.custom_op("paradit::rms_norm_rope", mutates_args=())
def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, eps: float
) -> torch.Tensor:
    """x (B, T, heads * head_dim), normed over its last dim; cos, sin (T, head_dim) float32, pairs interleaved ->
    (B, T, heads, head_dim)."""
    batch, tokens, width = x.shape
    rows = _rowwise(x)
    out = torch.empty(batch, tokens, width // head_dim, head_dim, dtype=x.dtype, device=x.device)
    if cos.shape != (tokens, head_dim) or sin.shape != (tokens, head_dim):
        raise ValueError(f"rotary tables {tuple(cos.shape)} for {tokens} tokens of head dim {head_dim}")
    heads_block, half_block = triton.next_power_of_2(width // head_dim), triton.next_power_of_2(head_dim // 2)
    cos, sin = cos.contiguous(), sin.contiguous()

    def launch(warps: int) -> None:
        _rms_norm_rope[(rows.shape[0],)](
            rows,
            rows if weight is None else weight,  # never read without a weight
            cos,
            sin,
            out,
            tokens,
            width // head_dim,
            rows.stride(0),
            cos.stride(0),
            eps,
            HAS_WEIGHT=weight is not None,
            HEAD_DIM=head_dim,
            HEADS_BLOCK=heads_block,
            HALF_BLOCK=half_block,
            ROUND=interpreting(),
            num_warps=warps,
            enable_fp_fusion=False,
        )

    key = ("rms_norm_rope", x.device, width, head_dim, x.dtype, weight is None)
    _run_fastest(key, 2 * heads_block * half_block, launch)
    return out


@rms_norm_rope.register_fake
def _(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, eps: float):
    return x.new_empty(*x.shape[:2], x.shape[2] // head_dim, head_dim)


def modulated_layer_norm_fp8(
    x: torch.Tensor, norm: nn.LayerNorm, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> QuantizedRows:
    """``(norm(x.float()) * (1 + scale) + shift).to(x.dtype)``, quantized row-wise to ``dtype``, in one pass."""
    values, row_scale = layer_norm_modulate_fp8(x, shift, scale, norm.eps, dtype)
    return QuantizedRows(values, row_scale, tuple(x.shape[:-1]))


def gelu_quantized(hidden: torch.Tensor, bias: torch.Tensor | None, leading, dtype: torch.dtype) -> QuantizedRows:
    values, row_scale = gelu_fp8(hidden, bias, dtype)
    return QuantizedRows(values, row_scale, tuple(leading))


def normed_rotated(
    x: torch.Tensor, norm: nn.RMSNorm, rope: tuple[torch.Tensor, torch.Tensor], head_dim: int
) -> torch.Tensor:
    """``apply_rope_interleaved(norm(x).unflatten(-1, (-1, head_dim)), *rope)`` in one pass."""
    eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
    return rms_norm_rope(x, norm.weight, *rope, head_dim, eps)
