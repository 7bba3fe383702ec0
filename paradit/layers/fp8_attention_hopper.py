"""FP8 attention's Hopper kernel, in Gluon (Triton's explicit-layout language), because plain Triton serializes the
kernel's two matrix products with its softmax: it waits for every outstanding ``wgmma`` before the softmax, so the
tensor cores idle while a tile's scores are exponentiated. Here each warp group issues the next tile's Q·Kᵀ and
this tile's P·V asynchronously and runs the softmax while they execute (FlashAttention-3's intra-warpgroup overlap),
and two warp groups share each K and V tile, halving the tiles' traffic from L2.

The arithmetic is ``fp8_attention``'s (INT8 Q·Kᵀ on smoothed keys, a scale per 128-key tile folded into the
multiply-add that feeds exp2, FP8 P·V on the pre-pass's transposed V, online softmax in base 2, the log-sum-exp out),
so the two kernels agree to rounding. V's keys come permuted within groups of 32 (``PERMUTED_KEYS``): the order in
which the score accumulator holds a thread's columns, so P goes from the softmax into the second product's registers
with no shuffle. Must not import torch.distributed."""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Gluon's names moved between Triton 3.6 (PyTorch 2.11's) and 3.9 (PyTorch 2.13's).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
except ImportError:  # Triton before Gluon's Hopper API (3.5), or none: the portable kernel runs instead
    gluon = None

BLOCK_N = 128  # keys per tile: K's scale block (``fp8_attention.KEY_TILE``)
# (queries per program, warps, K and V tiles in flight, P·V beside the softmax) to time: 128 queries share each
# tile between two warp groups; 64 leave two programs to an SM.
CONFIGS = ((128, 8, 4, False), (64, 4, 3, False), (128, 8, 3, False), (128, 8, 4, True))
HEAD_DIMS = (64, 128)  # head dims (padded) the kernel is built for; others take the portable kernel


def available(device: torch.device, width: int) -> bool:
    """Whether this kernel runs here: Triton with Gluon's Hopper API, an NVIDIA GPU of compute capability 9.0 (wgmma is
    Hopper's alone: Blackwell has tcgen05), and a head dim it is built for."""
    return (
        gluon is not None
        and device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) == (9, 0)
        and width in HEAD_DIMS
    )


# A 32-key group's index as digits (h, g, c, e) of sizes (2, 2, 4, 2): key 16h + 8g + 2c + e. The score accumulator
# gives thread c of a quad the keys 8j + 2c + e of each 8-key group j; the second product's 8-bit A operand wants it
# to hold 16h + 4c + f (f < 4). Swapping the digits g and c (f = 2g + e) maps one onto the other, so P's columns and
# V's keys are both put in the swapped order: the same registers, relabelled, and the products pair the same keys.
KEY_DIGITS = (2, 2, 4, 2)
SWAPPED_DIGITS = (0, 2, 1, 3)
if gluon is not None:  # as the kernel reads them: compile-time constants
    _KEY_DIGITS, _SWAPPED_DIGITS = gl.constexpr(KEY_DIGITS), gl.constexpr(SWAPPED_DIGITS)


def permuted_key(key: torch.Tensor) -> torch.Tensor:
    """Where key ``key`` (its index in a tile) sits in the swapped order (P's columns and V's keys alike)."""
    position = torch.arange(key.numel() // 32 * 32).view(-1, *KEY_DIGITS).permute(0, *(1 + d for d in SWAPPED_DIGITS))
    where = torch.empty_like(position.flatten())
    where[position.flatten()] = torch.arange(where.numel())
    return where[key]


if gluon is not None:

    @gluon.jit
    def _hopper_forward(Q, K_DESC, V_DESC, K_SCALE, V_SCALE, K_MEAN, KEY_MASK, OUT, LSE, q_length, k_length, heads,
                        dim, padded, stride_qb, stride_ql, stride_qh, stride_ob, stride_ol, stride_oh, sm_scale,
                        QMAX: gl.constexpr, P_EXPONENT: gl.constexpr, HAS_MASK: gl.constexpr,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, OVERLAP_PV: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        block, bh = gl.program_id(0), gl.program_id(1)
        b, h = bh // heads, bh % heads
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        keys_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows_of_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dims_of_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        # Q's load: 16 bytes a thread along the head dim.
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [num_warps, 1], [1, 0])

        # Q: loaded, smoothed keys' constant taken, quantized to INT8 with one scale for the block, into shared memory
        # (the first product's A operand, read there by every tile's wgmma).
        queries = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_load))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_load))
        real = (queries[:, None] < q_length) & (dims[None, :] < dim)
        q_ptrs = Q + b * stride_qb + h * stride_qh + queries[:, None] * stride_ql + dims[None, :]
        q = gl.load(q_ptrs, mask=real, other=0.0).to(gl.float32)
        q_mean = gl.sum(q * gl.load(K_MEAN + bh * HEAD_DIM + dims)[None, :], 1)
        q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0), 1e-30) / QMAX
        q = q / q_scale
        q8 = gl.where(q >= 0, q + 0.5, q - 0.5).to(gl.int8)  # to nearest, half away (the conversion truncates)
        q_smem = gl.allocate_shared_memory(
            gl.int8, [BLOCK_M, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.int8)
        )
        q_smem.store(q8)
        fence_async_shared()
        qk_scale = sm_scale * 1.4426950408889634 * q_scale  # softmax in base 2

        k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], K_DESC.layout)
        v_bufs = gl.allocate_shared_memory(V_DESC.dtype, [STAGES, HEAD_DIM, BLOCK_N], V_DESC.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        tiles = gl.cdiv(k_length, BLOCK_N)
        for i in gl.static_range(STAGES - 1):
            _load_tile(K_DESC, V_DESC, k_bufs, v_bufs, ready, bh, padded, i, i < tiles, HEAD_DIM, BLOCK_N, STAGES)
        # The int32 products come out as floats without a conversion: the accumulator starts at the bits of
        # 1.5 * 2^23, to which each product (|x| < 2^22) adds exactly; ``offset`` is subtracted in the multiply-add.
        magic = gl.full([BLOCK_M, BLOCK_N], 0x4B400000, gl.int32, s_layout)
        offset = 12582912.0
        keys = gl.arange(0, BLOCK_N, layout=keys_of_s)
        k_scales = K_SCALE + bh * (padded // BLOCK_N)
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), magic, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i = gl.full([BLOCK_M], -1e30, gl.float32, rows_of_s)  # finite: an all-masked row rescales by exp2(0)
        l_i = gl.zeros([BLOCK_M], gl.float32, rows_of_s)
        o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        # With OVERLAP_PV, the previous tile's P; before the first tile, zeros (their product with the first tile's V
        # adds nothing).
        p = gl.zeros([BLOCK_M, BLOCK_N], V_DESC.dtype, p_layout)
        if not OVERLAP_PV:
            for tile in range(tiles - 1):
                s, o, m_i, l_i = _step(s, o, m_i, l_i, tile, q_smem, k_bufs, v_bufs, ready, magic, K_DESC, V_DESC,
                                       qk_scale, k_scales, KEY_MASK + b * padded, keys, bh, padded, tiles, k_length,
                                       offset, P_EXPONENT, HAS_MASK, HEAD_DIM, BLOCK_N, STAGES)  # fmt: skip
        else:
            for tile in range(tiles - 1):
                following = tile + 1
                mbarrier.wait(ready.index(following % STAGES), (following // STAGES) & 1)
                s_next = warpgroup_mma(q_smem, k_bufs.index(following % STAGES).permute((1, 0)), magic, is_async=True)
                if OVERLAP_PV:
                    # The previous tile's P·V too runs beside this tile's softmax.
                    o = warpgroup_mma(
                        p, v_bufs.index(gl.maximum(tile - 1, 0) % STAGES).permute((1, 0)), o, is_async=True
                    )
                probabilities, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, k_scales, KEY_MASK + b * padded,
                                                          keys, tile, k_length, offset, P_EXPONENT, False,
                                                          HAS_MASK)  # fmt: skip
                p = gl.convert_layout(_to_operand_order(probabilities.to(V_DESC.dtype)), p_layout)
                if OVERLAP_PV:
                    s, o = warpgroup_mma_wait(0, deps=(s_next, o))
                    o = o * gl.convert_layout(alpha, rows_of_o)[:, None]
                else:
                    s = warpgroup_mma_wait(0, deps=(s_next,))
                    o = o * gl.convert_layout(alpha, rows_of_o)[:, None]
                    o = warpgroup_mma(p, v_bufs.index(tile % STAGES).permute((1, 0)), o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=(o,))
                # The previous tile's stage is now free in both warp groups: refill it, STAGES - 1 tiles ahead.
                cta_barrier()
                refill = tile + STAGES - 1
                _load_tile(K_DESC, V_DESC, k_bufs, v_bufs, ready, bh, padded, refill, refill < tiles, HEAD_DIM, BLOCK_N,
                           STAGES)  # fmt: skip
        # The last tile, whose keys past the length (padding) are masked.
        last = tiles - 1
        if OVERLAP_PV:
            o = warpgroup_mma(p, v_bufs.index(gl.maximum(last - 1, 0) % STAGES).permute((1, 0)), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
        probabilities, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, k_scales, KEY_MASK + b * padded, keys, last,
                                                  k_length, offset, P_EXPONENT, True, HAS_MASK)  # fmt: skip
        p = gl.convert_layout(_to_operand_order(probabilities.to(V_DESC.dtype)), p_layout)
        o = o * gl.convert_layout(alpha, rows_of_o)[:, None]
        o = warpgroup_mma(p, v_bufs.index(last % STAGES).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        empty = l_i == 0.0  # every key masked: output 0, log-sum-exp -inf (nothing when merged)
        out_dims = gl.arange(0, HEAD_DIM, layout=dims_of_o)
        out_rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_of_o)
        norm = gl.convert_layout(gl.where(empty, 1.0, l_i), rows_of_o)
        out = o * gl.load(V_SCALE + bh * HEAD_DIM + out_dims)[None, :] / norm[:, None]
        o_ptrs = OUT + b * stride_ob + h * stride_oh + out_rows[:, None] * stride_ol + out_dims[None, :]
        gl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(out_rows[:, None] < q_length) & (out_dims[None, :] < dim))
        lse_rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_of_s)
        q_mean = gl.convert_layout(q_mean, rows_of_s)
        lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - P_EXPONENT) * 0.6931471805599453 + q_mean * sm_scale
        gl.store(LSE + bh * q_length + lse_rows, gl.where(empty, float("-inf"), lse), mask=lse_rows < q_length)

    @gluon.jit
    def _step(s, o, m_i, l_i, tile, q_smem, k_bufs, v_bufs, ready, magic, K_DESC, V_DESC, qk_scale, k_scales,
              key_mask, keys, bh, padded, tiles, k_length, offset, P_EXPONENT: gl.constexpr, HAS_MASK: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Tile ``tile`` (not the last) folded into (o, m, l): the next tile's Q·Kᵀ issued first, so that the tensor
        cores run it beside this tile's softmax; then this tile's P·V. Nothing stays in flight across the step: ptxas
        serializes every wgmma of a kernel whose accumulators it cannot prove idle at a loop's head. Returns the next
        tile's scores."""
        following = tile + 1
        mbarrier.wait(ready.index(following % STAGES), (following // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_bufs.index(following % STAGES).permute((1, 0)), magic, is_async=True)
        probabilities, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, k_scales, key_mask, keys, tile, k_length,
                                                  offset, P_EXPONENT, False, HAS_MASK)  # fmt: skip
        p = gl.convert_layout(
            _to_operand_order(probabilities.to(V_DESC.dtype)), gl.DotOperandLayout(0, o.type.layout, 4)
        )
        s_next = warpgroup_mma_wait(0, deps=(s_next,))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None]
        o = warpgroup_mma(p, v_bufs.index(tile % STAGES).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o,))
        # The previous tile's stage is free in every warp group: refill it, STAGES - 1 tiles ahead.
        cta_barrier()
        refill = tile + STAGES - 1
        _load_tile(K_DESC, V_DESC, k_bufs, v_bufs, ready, bh, padded, refill, refill < tiles, HEAD_DIM, BLOCK_N,
                   STAGES)  # fmt: skip
        return s_next, o, m_i, l_i

    @gluon.jit
    def _load_tile(K_DESC, V_DESC, k_bufs, v_bufs, ready, bh, padded, tile, pred, HEAD_DIM: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Key tile ``tile`` of K and of V into its stage by TMA, signalling the stage's barrier (if ``pred``)."""
        stage = tile % STAGES
        mbarrier.expect(ready.index(stage), BLOCK_N * HEAD_DIM * 2, pred=pred)
        tma_load(K_DESC, [bh * padded + tile * BLOCK_N, 0], ready.index(stage),
                                        k_bufs.index(stage), pred=pred)  # fmt: skip
        tma_load(V_DESC, [bh * HEAD_DIM, tile * BLOCK_N], ready.index(stage),
                                        v_bufs.index(stage), pred=pred)  # fmt: skip

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, k_scales, key_mask, keys, tile, k_length, offset, P_EXPONENT: gl.constexpr,
                 CHECK: gl.constexpr, HAS_MASK: gl.constexpr):  # fmt: skip
        """One tile's online-softmax step, as the portable kernel's ``_attend_tile``: one multiply-add a score into
        exp2, the tile's K scale (positive even where Q or K is all zeros, so that masked scores stay -inf) taking the
        products to scores after the max, P scaled to ``2^P_EXPONENT`` in the exponent."""
        scale = gl.maximum(qk_scale * gl.load(k_scales + tile), 1e-30)
        raw = s.to(gl.float32, bitcast=True)
        start = tile * keys.shape[0]
        if CHECK:
            raw = gl.where((start + keys)[None, :] < k_length, raw, float("-inf"))
        if HAS_MASK:
            raw = gl.where((gl.load(key_mask + start + keys) != 0)[None, :], raw, float("-inf"))
        m_new = gl.maximum(m_i, (gl.max(raw, 1) - offset) * scale)
        alpha = gl.exp2(m_i - m_new)
        probabilities = gl.exp2(raw * scale - (offset * scale + m_new - P_EXPONENT)[:, None])
        return probabilities, alpha, m_new, l_i * alpha + gl.sum(probabilities, 1)

    @gluon.jit
    def _to_operand_order(p):
        """P's columns (each tile's keys) reordered as ``permuted_key`` orders V: a relabelling of the registers each
        thread already holds, so that the conversion to the operand layout moves nothing."""
        rows: gl.constexpr = p.shape[0]
        cols: gl.constexpr = p.shape[1]
        p = gl.reshape(p, [rows, cols // 32, _KEY_DIGITS[0], _KEY_DIGITS[1], _KEY_DIGITS[2], _KEY_DIGITS[3]])
        p = gl.permute(p, [0, 1, 2 + _SWAPPED_DIGITS[0], 2 + _SWAPPED_DIGITS[1], 2 + _SWAPPED_DIGITS[2],
                           2 + _SWAPPED_DIGITS[3]])  # fmt: skip
        return gl.reshape(p, [rows, cols])


def shared_layout(block: list[int], dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def launch(query, k_length, k8, k_scale, v8, v_scale, k_mean, mask, out, lse, *, heads, dim, has_mask, qmax,
           p_exponent, config):  # fmt: skip
    """The kernel over the pre-pass's K (tiles of keys × dims) and transposed, key-permuted V (dims × keys), with
    ``config`` (queries per program, warps, stages, P·V beside the softmax)."""
    block_m, warps, stages, overlap = config
    batch, q_length = query.shape[0], query.shape[1]
    padded, width = k8.shape[2], k8.shape[-1]
    k_desc = TensorDescriptor.from_tensor(
        k8.view(-1, width), [BLOCK_N, width], shared_layout([BLOCK_N, width], gl.int8)
    )
    v_desc = TensorDescriptor.from_tensor(
        v8.view(-1, padded), [width, BLOCK_N], shared_layout([width, BLOCK_N], gl.float8e4nv)
    )
    grid = (-(-q_length // block_m), batch * heads)
    _hopper_forward[grid](query, k_desc, v_desc, k_scale, v_scale, k_mean, mask, out, lse, q_length, k_length, heads,
                          dim, padded, query.stride(0), query.stride(1), query.stride(2), out.stride(0),
                          out.stride(1), out.stride(2), dim**-0.5, QMAX=qmax, P_EXPONENT=p_exponent,
                          HAS_MASK=has_mask, HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=BLOCK_N, STAGES=stages,
                          OVERLAP_PV=overlap, num_warps=warps)  # fmt: skip
