"""FP8 attention by SageAttention's method: Q·Kᵀ in INT8, K smoothed by its token mean (a constant per query's scores,
which the log-sum-exp gets back), P·V in FP8 with V scaled per channel, an fp32 online softmax in base 2."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs (or a Triton before 3.4): ``check_fp8_attention`` names what to install
    triton = None

from paradit.errors import InvalidRequest
from paradit.layers.fp8 import fp8_dtype

# The key tile, also K's scale block: one scale per tile folds a score's scaling into the multiply-add feeding exp2
# (scales per 64 keys cost a fifth more time at Wan 720p). The keys are padded to whole tiles.
KEY_TILE = 128
INT8_MAX = 127.0


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_fp8_attention(device: torch.device) -> None:
    problem = None
    if triton is None:
        problem = "FP8 attention needs Triton 3.4 or newer (pip install triton; on ROCm, pytorch-triton-rocm)"
    elif device.type == "cpu" and not interpreting():
        problem = "FP8 attention needs a GPU; on the CPU only Triton's interpreter runs it (TRITON_INTERPRET=1)"
    elif device.type == "cuda" and torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if not arch.startswith(("gfx94", "gfx95", "gfx12")):
            problem = f"FP8 attention needs FP8 matrix cores (MI300-class or RDNA 4); this GPU is {arch}"
    elif device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < (8, 9):
        version = ".".join(map(str, capability))
        problem = f"FP8 attention needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); this GPU is {version}"
    if problem:
        raise InvalidRequest(f"{problem}; run with --attention sdpa", param="attention")


# Q·Kᵀ's 8-bit format: INT8 under a per-block scale errs by 0.040 per call against FP8's 0.054 (relative L2, Wan 720p,
# H200), for 1.5% more time; Hopper, MI300 and RDNA 4 multiply INT8 at FP8's rate.
QK_FORMAT = torch.int8


if triton is not None:

    @triton.jit
    def _to_8bit(x, DTYPE: tl.constexpr, ROUND: tl.constexpr, TINY: tl.constexpr):
        """INT8 rounded half away from zero (the conversion truncates), FP8 to nearest. ``ROUND``: in fp32 arithmetic,
        for Triton's interpreter, whose own conversion rounds wrongly (125.4 becomes 64)."""
        if DTYPE == tl.int8:
            x = tl.where(x >= 0, x + 0.5, x - 0.5)
        elif ROUND:
            split = x * 1048577.0  # 2^20 + 1: Veltkamp's split keeps fp32's 4 leading bits (FP8's), to nearest
            normal = split - (split - x)
            # Below the smallest normal ``TINY`` the grid is fixed (steps of TINY / 2^3: three mantissa bits), and
            # adding 1.5 * 2^23 steps rounds to a multiple of one.
            magic = TINY / 8.0 * 12582912.0
            x = tl.where(tl.abs(x) < TINY, (x + magic) - magic, normal)
        return x.to(DTYPE)

    @triton.jit
    def _quantize_keys_values(
        K,
        V,
        K_MEAN,
        V_SCALE,
        K_OUT,
        K_SCALE,
        V_OUT,
        length,
        heads,
        dim,
        stride_kb,
        stride_kl,
        stride_kh,
        stride_vb,
        stride_vl,
        stride_vh,
        padded,
        QMAX: tl.constexpr,
        VMAX: tl.constexpr,
        BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROUND: tl.constexpr,
        TINY: tl.constexpr,
    ):
        """V is stored transposed: FP8 tensor cores take the reduced dimension contiguous."""
        block, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rows = block * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, HEAD_DIM)
        real = (rows[:, None] < length) & (dims[None, :] < dim)
        k = tl.load(K + b * stride_kb + h * stride_kh + rows[:, None] * stride_kl + dims[None, :], mask=real, other=0.0)
        mean = tl.load(K_MEAN + bh * HEAD_DIM + dims)
        k = tl.where(real, k.to(tl.float32) - mean[None, :], 0.0)
        scale = tl.maximum(tl.max(tl.abs(k)), 1e-30) / QMAX
        k = _to_8bit(k / scale, K_OUT.dtype.element_ty, ROUND, TINY)
        tl.store(K_OUT + bh * padded * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :], k)
        tl.store(K_SCALE + bh * (padded // BLOCK) + block, scale)
        v = tl.load(V + b * stride_vb + h * stride_vh + rows[:, None] * stride_vl + dims[None, :], mask=real, other=0.0)
        v = v.to(tl.float32) / tl.load(V_SCALE + bh * HEAD_DIM + dims)[None, :]
        v = tl.minimum(tl.maximum(v, -VMAX), VMAX)
        tl.store(
            V_OUT + bh * HEAD_DIM * padded + dims[:, None] * padded + rows[None, :],
            _to_8bit(tl.trans(v), V_OUT.dtype.element_ty, ROUND, TINY),
        )

    @triton.jit
    def _load_tile(
        K_DESC, V_DESC, k_ptrs, v_ptrs, bh, padded, start, HEAD_DIM: tl.constexpr, DESCRIPTORS: tl.constexpr
    ):
        """Each (dim, keys), through TMA descriptors on Hopper (7% at Wan 720p) or through pointers elsewhere."""
        if DESCRIPTORS:
            return tl.trans(K_DESC.load([bh * padded + start, 0])), V_DESC.load([bh * HEAD_DIM, start])
        return tl.load(k_ptrs + start * HEAD_DIM), tl.load(v_ptrs + start)

    @triton.jit
    def _attend_tile(
        acc,
        m_i,
        l_i,
        q,
        k,
        v,
        scale,
        key_mask_ptrs,
        start,
        valid_length,
        QK_INT8: tl.constexpr,
        P_EXPONENT: tl.constexpr,
        CHECK: tl.constexpr,
        HAS_MASK: tl.constexpr,
        ROUND: tl.constexpr,
        TINY: tl.constexpr,
    ):
        """One key tile folded into the running (acc, max, sum). The softmax's work per score bounds this kernel, so
        ``scale`` and P's ``2^P_EXPONENT`` ride in the one multiply-add feeding exp2 (1.3x at Wan 720p)."""
        keys = tl.arange(0, k.shape[1])
        if QK_INT8:
            # int32 to fp32 without a conversion instruction: the bits of 1.5 * 2^23 added to a product (|x| < 2^22:
            # 127² * 256 at most) give the float 1.5 * 2^23 + x exactly. Subtracted after the scale, the offset's
            # rounding errs by under one product unit: far below INT8's own error (hundreds of units).
            raw = (tl.dot(q, k, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
            offset = 12582912.0
        else:
            raw = tl.dot(q, k)
            offset = 0.0
        if CHECK:
            raw = tl.where((start + keys)[None, :] < valid_length, raw, float("-inf"))
        if HAS_MASK:
            raw = tl.where(tl.load(key_mask_ptrs + start + keys)[None, :] != 0, raw, float("-inf"))
        m_new = tl.maximum(m_i, (tl.max(raw, 1) - offset) * scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(raw * scale - (offset * scale + m_new - P_EXPONENT)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(_to_8bit(p, v.dtype, ROUND, TINY), tl.trans(v), acc * alpha[:, None])
        return acc, m_new, l_i

    @triton.jit
    def _fp8_attention_forward(
        Q,
        K8,
        K_SCALE,
        V8,
        V_SCALE,
        K_MEAN,
        KEY_MASK,
        OUT,
        LSE,
        KEPT_TILES,
        K_DESC,
        V_DESC,
        q_length,
        k_length,
        heads,
        dim,
        padded,
        stride_qb,
        stride_ql,
        stride_qh,
        stride_ob,
        stride_ol,
        stride_oh,
        sm_scale,
        QMAX: tl.constexpr,
        P_EXPONENT: tl.constexpr,
        QK_INT8: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DESCRIPTORS: tl.constexpr,
        ROUND: tl.constexpr,
        TINY: tl.constexpr,
    ):
        block, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        queries = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        keys = tl.arange(0, BLOCK_N)
        q_ptrs = Q + b * stride_qb + h * stride_qh + queries[:, None] * stride_ql + dims[None, :]
        real = (queries[:, None] < q_length) & (dims[None, :] < dim)
        q = tl.load(q_ptrs, mask=real, other=0.0).to(tl.float32)
        # The constant that K's smoothing took from every score of a query, for its log-sum-exp.
        q_mean = tl.sum(q * tl.load(K_MEAN + bh * HEAD_DIM + dims)[None, :], 1)
        q_scale = tl.maximum(tl.max(tl.abs(q)), 1e-30) / QMAX
        q = _to_8bit(q / q_scale, K8.dtype.element_ty, ROUND, TINY)
        qk_scale = sm_scale * 1.4426950408889634 * q_scale  # softmax in base 2
        k_ptrs = K8 + bh * padded * HEAD_DIM + keys[None, :] * HEAD_DIM + dims[:, None]  # (dim, keys)
        v_ptrs = V8 + bh * HEAD_DIM * padded + dims[:, None] * padded + keys[None, :]  # (dim, keys)
        k_scale_ptrs = K_SCALE + bh * (padded // BLOCK_N)
        key_mask_ptrs = KEY_MASK + b * padded
        # Finite, so that a query with no key yet rescales by exp2(0) rather than NaN.
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if KEPT_TILES is None:
            whole = k_length // BLOCK_N * BLOCK_N  # tiles every key of which is real: no bounds check
            for start in range(0, whole, BLOCK_N):
                k, v = _load_tile(K_DESC, V_DESC, k_ptrs, v_ptrs, bh, padded, start, HEAD_DIM, DESCRIPTORS)
                # Positive even where Q or K is all zeros, so that masked scores stay -inf, not NaN.
                scale = tl.maximum(qk_scale * tl.load(k_scale_ptrs + start // BLOCK_N), 1e-30)
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k,
                    v,
                    scale,
                    key_mask_ptrs,
                    start,
                    k_length,
                    QK_INT8,
                    P_EXPONENT,
                    False,
                    HAS_MASK,
                    ROUND,
                    TINY,
                )
            if whole < k_length:
                k, v = _load_tile(K_DESC, V_DESC, k_ptrs, v_ptrs, bh, padded, whole, HEAD_DIM, DESCRIPTORS)
                scale = tl.maximum(qk_scale * tl.load(k_scale_ptrs + whole // BLOCK_N), 1e-30)
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k,
                    v,
                    scale,
                    key_mask_ptrs,
                    whole,
                    k_length,
                    QK_INT8,
                    P_EXPONENT,
                    True,
                    HAS_MASK,
                    ROUND,
                    TINY,
                )
        else:
            # Block-sparse: this query tile's row of kept key tiles, (count, ascending tile indices), the mask's
            # query tiles being BLOCK_N queries (BLOCK_M divides it). Only a kept tile past the last whole one (the
            # keys' end) needs the bounds check, and it is the row's last.
            key_tiles = padded // BLOCK_N
            row = KEPT_TILES + (bh * tl.cdiv(q_length, BLOCK_N) + block * BLOCK_M // BLOCK_N) * (key_tiles + 1)
            kept = tl.load(row)
            last = tl.load(row + tl.maximum(kept, 1))
            ragged = (kept > 0) & ((last + 1) * BLOCK_N > k_length)
            for index in range(kept - ragged.to(tl.int32)):
                start = tl.load(row + 1 + index) * BLOCK_N
                k, v = _load_tile(K_DESC, V_DESC, k_ptrs, v_ptrs, bh, padded, start, HEAD_DIM, DESCRIPTORS)
                scale = tl.maximum(qk_scale * tl.load(k_scale_ptrs + start // BLOCK_N), 1e-30)
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k,
                    v,
                    scale,
                    key_mask_ptrs,
                    start,
                    k_length,
                    QK_INT8,
                    P_EXPONENT,
                    False,
                    HAS_MASK,
                    ROUND,
                    TINY,
                )
            if ragged:
                start = last * BLOCK_N
                k, v = _load_tile(K_DESC, V_DESC, k_ptrs, v_ptrs, bh, padded, start, HEAD_DIM, DESCRIPTORS)
                scale = tl.maximum(qk_scale * tl.load(k_scale_ptrs + last), 1e-30)
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k,
                    v,
                    scale,
                    key_mask_ptrs,
                    start,
                    k_length,
                    QK_INT8,
                    P_EXPONENT,
                    True,
                    HAS_MASK,
                    ROUND,
                    TINY,
                )
        v_scale = tl.load(V_SCALE + bh * HEAD_DIM + dims)
        empty = l_i == 0.0  # every key masked: output 0, log-sum-exp -inf (nothing when merged)
        out = acc * v_scale[None, :] / tl.where(empty, 1.0, l_i)[:, None]
        o_ptrs = OUT + b * stride_ob + h * stride_oh + queries[:, None] * stride_ol + dims[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=real)
        lse = (m_i + tl.log2(tl.where(empty, 1.0, l_i)) - P_EXPONENT) * 0.6931471805599453 + q_mean * sm_scale
        tl.store(LSE + bh * q_length + queries, tl.where(empty, float("-inf"), lse), mask=queries < q_length)


def _configs(device: torch.device, sparse: bool = False) -> list[tuple[int, int, int, int]]:
    """(query tile, key tile, warps, stages) to try; the interpreter's cost is per operation, whatever the tile. A
    block mask's query tiles are ``KEY_TILE`` queries, which the kernel's query tile must divide."""
    if interpreting() or device.type == "cpu":
        return [(KEY_TILE if sparse else 256, KEY_TILE, 4, 1)]
    # On the H200 (64, 128, 4, 3) wins: two blocks of one warpgroup each share an SM, one's softmax beside the
    # other's matrix products. The others are there for GPUs that differ (RDNA 4).
    return [(64, KEY_TILE, 4, 3), (128, KEY_TILE, 8, 3), (64, KEY_TILE, 4, 2), (32, KEY_TILE, 4, 3)]


_CHOSEN: dict[tuple, tuple[int, int, int, int]] = {}  # (device, head dim, formats, sparse) -> the fastest config


def p_exponent(dtype: torch.dtype) -> int:
    """P is scaled to the largest power of two ``dtype`` holds (2^8 in e4m3fn, 2^7 in MI300's e4m3fnuz)."""
    return math.floor(math.log2(torch.finfo(dtype).max))


def rounding(dtype: torch.dtype) -> dict:
    return {"ROUND": interpreting(), "TINY": torch.finfo(dtype).tiny}


def uses_descriptors(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def eight_bit(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1


def format_limits(qk_dtype: torch.dtype, pv_dtype: torch.dtype) -> dict:
    """The kernel's constants for its formats. In the input's own precision (the kernel without FP8: bf16 on GPUs
    that lack it, fp32 in the interpreter) nothing is rounded to 8 bits: values scaled to [-1, 1], P not scaled."""
    if qk_dtype == torch.int8:
        qmax = INT8_MAX
    else:
        qmax = torch.finfo(qk_dtype).max if eight_bit(qk_dtype) else 1.0
    exact = not eight_bit(pv_dtype)
    rounding_ = {"ROUND": False, "TINY": 0.0} if exact else rounding(pv_dtype)
    return {"QMAX": qmax, "P_EXPONENT": 0 if exact else p_exponent(pv_dtype), **rounding_}


def quantize_keys_values(key: torch.Tensor, value: torch.Tensor, qk_dtype: torch.dtype, pv_dtype: torch.dtype):
    """The pre-pass: (K8 (B, H, padded, W), K's scale per tile, K's mean (B, H, W), V8 transposed (B, H, W, padded),
    V's channel scales (B, H, W)), W the head dim padded to a power of two (Triton) of at least 32 (INT8 MMA depth)."""
    batch, length, heads, dim = key.shape
    padded, width = -(-length // KEY_TILE) * KEY_TILE, max(32, triton.next_power_of_2(dim))
    k_mean = F.pad(key.mean(dim=1, dtype=torch.float32), (0, width - dim)).contiguous()  # (B, H, W)
    limits = format_limits(qk_dtype, pv_dtype)
    vmax = torch.finfo(pv_dtype).max if eight_bit(pv_dtype) else 1.0
    # The largest magnitude by one reduction: ``value.abs()`` first wrote a copy of V (0.5 ms at Wan 720p).
    v_scale = torch.linalg.vector_norm(value, ord=math.inf, dim=1).float().clamp(min=1e-30) / vmax
    v_scale = F.pad(v_scale, (0, width - dim), value=1.0).contiguous()
    k8 = torch.empty(batch, heads, padded, width, dtype=qk_dtype, device=key.device)
    k_scale = torch.empty(batch, heads, padded // KEY_TILE, dtype=torch.float32, device=key.device)
    v8 = torch.empty(batch, heads, width, padded, dtype=pv_dtype, device=key.device)
    _quantize_keys_values[padded // KEY_TILE, batch * heads](
        key,
        value,
        k_mean,
        v_scale,
        k8,
        k_scale,
        v8,
        length,
        heads,
        dim,
        *key.stride()[:3],
        *value.stride()[:3],
        padded,
        QMAX=limits["QMAX"],
        VMAX=vmax,
        BLOCK=KEY_TILE,
        HEAD_DIM=width,
        ROUND=limits["ROUND"],
        TINY=limits["TINY"],
    )
    return k8, k_scale, k_mean, v8, v_scale


def kept_tile_rows(block_mask: torch.Tensor) -> torch.Tensor:
    """A block mask (B, H, query tiles, key tiles), True where a tile is attended, as the kernel reads it: per
    (batch, head, query tile) the count of kept key tiles, then their indices ascending (int32)."""
    counts = block_mask.sum(dim=-1, dtype=torch.int32)
    # A stable sort of "dropped" puts the kept tiles first, in their order.
    order = torch.argsort((~block_mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return torch.cat([counts[..., None], order], dim=-1).flatten(0, 2).contiguous()


def attention_with_lse_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None,
    kept_tiles: torch.Tensor | None,
    qk_dtype: torch.dtype,
    pv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel in the given formats; ``kept_tiles`` (``kept_tile_rows``) skips the key tiles a block mask
    excludes, None attends every tile (the dense kernel, compiled as before the mask existed)."""
    batch, q_length, heads, dim = query.shape
    k_length = key.shape[1]
    if query.numel() == 0 or key.numel() == 0:  # a Ulysses rank's empty chunk of heads: no launch (a grid of 0)
        lse = torch.full((batch, heads, q_length), float("-inf"), device=query.device)
        return torch.zeros_like(query, memory_format=torch.contiguous_format), lse
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    k8, k_scale, k_mean, v8, v_scale = quantize_keys_values(key, value, qk_dtype, pv_dtype)
    padded = k8.shape[2]
    if kept_tiles is not None:
        expected = (batch * heads * -(-q_length // KEY_TILE), padded // KEY_TILE + 1)
        if tuple(kept_tiles.shape) != expected:
            raise ValueError(f"kept tiles {tuple(kept_tiles.shape)} do not match the inputs' tiles {expected}")
    # Without a mask, k_scale stands in: never read, HAS_MASK is off.
    mask = k_scale if key_mask is None else F.pad(key_mask.to(torch.uint8), (0, padded - k_length))
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, q_length, dtype=torch.float32, device=query.device)
    width = k8.shape[-1]
    descriptors = uses_descriptors(query.device)
    if descriptors:
        k_desc = TensorDescriptor.from_tensor(k8.view(-1, width), [KEY_TILE, width])
        v_desc = TensorDescriptor.from_tensor(v8.view(-1, padded), [width, KEY_TILE])
    else:
        k_desc = v_desc = k_scale  # never read: the kernel loads through pointers
    limits = format_limits(qk_dtype, pv_dtype)

    def launch(config: tuple[int, int, int, int]) -> None:
        # Fusion asked for, not assumed: a score's scaling is one multiply-add only if fused, and Triton 3.10 turns
        # fusion off by default.
        block_m, block_n, warps, stages = config
        grid = (triton.cdiv(q_length, block_m), batch * heads)
        _fp8_attention_forward[grid](
            query,
            k8,
            k_scale,
            v8,
            v_scale,
            k_mean,
            mask,
            out,
            lse,
            kept_tiles,
            k_desc,
            v_desc,
            q_length,
            k_length,
            heads,
            dim,
            padded,
            *query.stride()[:3],
            *out.stride()[:3],
            dim**-0.5,
            QMAX=limits["QMAX"],
            P_EXPONENT=limits["P_EXPONENT"],
            QK_INT8=qk_dtype == torch.int8,
            HAS_MASK=key_mask is not None,
            ROUND=limits["ROUND"],
            TINY=limits["TINY"],
            HEAD_DIM=width,
            DESCRIPTORS=descriptors,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
            enable_fp_fusion=True,
        )

    sparse = kept_tiles is not None
    chosen = _CHOSEN.get(tuning_key := (query.device, dim, qk_dtype, pv_dtype, sparse))
    if chosen is None:
        chosen = _CHOSEN[tuning_key] = fastest(launch, _configs(query.device, sparse))
    launch(chosen)
    return out, lse


# Operators of their own, so that compiled blocks call the kernel as one opaque step instead of breaking their graph
# (Dynamo cannot trace the tuning and the launch); the fakes give the shapes for tracing.
@torch.library.custom_op("paradit::fp8_attention", mutates_args=())
def fp8_attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    kept_tiles: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_with_lse_triton(query, key, value, key_mask, kept_tiles, QK_FORMAT, fp8_dtype(query.device))


@torch.library.custom_op("paradit::exact_triton_attention", mutates_args=())
def exact_triton_attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    kept_tiles: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same kernel in the inputs' precision (bf16: GPUs without FP8; fp32 in the interpreter): the block-sparse
    path where FP8 is not asked for, or not there."""
    return attention_with_lse_triton(query, key, value, key_mask, kept_tiles, query.dtype, query.dtype)


def _fake(query, key, value, key_mask=None, kept_tiles=None):
    lse = query.new_empty(query.shape[0], query.shape[2], query.shape[1], dtype=torch.float32)
    return torch.empty_like(query, memory_format=torch.contiguous_format), lse


fp8_attention_with_lse.register_fake(_fake)
exact_triton_attention_with_lse.register_fake(_fake)


def fastest(launch, configs: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """Measured, as tiles that suit Hopper do not suit RDNA 4; a config the compiler refuses is skipped."""
    if len(configs) == 1:
        return configs[0]
    timed, refusal = {}, None
    for config in configs:
        try:
            timed[config] = triton.testing.do_bench(lambda config=config: launch(config), warmup=5, rep=20)
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as error:
            refusal = error
    if not timed:
        raise RuntimeError(
            f"Triton compiled none of the FP8 attention configs {configs}; run with --attention sdpa"
        ) from refusal
    return min(timed, key=timed.get)
