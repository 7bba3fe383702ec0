"""FP8 attention's Hopper kernel, in Gluon (Triton's explicit-layout language), warp-specialized as FlashAttention-3
is, because plain Triton serializes the kernel's two matrix products with its softmax: it waits for every outstanding
``wgmma`` before the softmax, so the tensor cores idle while a tile's scores are exponentiated. Here one warp loads
K and V tiles by TMA into a ring of stages, and two consumer warp groups of 64 queries each share every tile. The
consumers take turns on the tensor cores (ping-pong): one issues its P·V and next Q·Kᵀ while the other runs its
softmax, so the matrix units stay fed without either group keeping a product in flight across its loop's back edge
(ptxas serializes every wgmma of a kernel that does).

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
ROWS = 64  # queries per consumer warp group; a program has two
# A consumer's registers (at most 255 a thread): the two consumer warp groups and the loader's (24 for its one warp,
# granted by warp group) share the SM's 64K, one program to an SM.
CONSUMER_REGS = 240
# The kernel's register cap, from which the default partition (the first consumer) gets what the others leave: the
# SM's registers over its twelve warps (the loader's warp group is four warps, one of them working).
MAX_REGISTERS = (2 * CONSUMER_REGS + 24) // 3
# How a consumer orders a tile's work. TOGETHER: softmax, then P·V and the next Q·Kᵀ issued together and awaited.
# PING_PONG: the same, the two consumers issuing in turns, so that one's softmax runs beside the other's products.
# EARLY_QK: the next Q·Kᵀ issued before this tile's softmax, P·V after it, both awaited before the loop turns.
TOGETHER, PING_PONG, EARLY_QK = 0, 1, 2
# (K and V tiles in flight, schedule, tiles a stage barrier covers) to time.
CONFIGS = ((4, TOGETHER, 1), (4, TOGETHER, 2), (6, TOGETHER, 2), (4, PING_PONG, 2), (4, EARLY_QK, 2))
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
    _ROWS, _CONSUMER_REGS = gl.constexpr(ROWS), gl.constexpr(CONSUMER_REGS)
    _PING_PONG, _EARLY_QK = gl.constexpr(PING_PONG), gl.constexpr(EARLY_QK)


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
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        SCHEDULE: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        """One program: ``2 * ROWS`` queries of one (batch, head) against every key, in three partitions (the
        default one is the first consumer)."""
        k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], K_DESC.layout)
        v_bufs = gl.allocate_shared_memory(V_DESC.dtype, [STAGES, HEAD_DIM, BLOCK_N], V_DESC.layout)
        q_bufs = gl.allocate_shared_memory(
            gl.int8, [2, _ROWS, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([_ROWS, HEAD_DIM], gl.int8)
        )
        # One barrier pair for each GROUP tiles: the compiler puts a warp-group barrier before each wait and arrive.
        ready = gl.allocate_shared_memory(gl.int64, [STAGES // GROUP, 1], mbarrier.MBarrierLayout())  # loaded
        free = gl.allocate_shared_memory(gl.int64, [STAGES // GROUP, 1], mbarrier.MBarrierLayout())  # consumed
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a consumer's turn to issue
        for i in gl.static_range(STAGES // GROUP):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
        # Runtime values travel as one tuple; compile-time constants beside it (inside a tuple they would become
        # runtime values).
        values = (Q, K_DESC, V_DESC, K_SCALE, V_SCALE, K_MEAN, KEY_MASK, OUT, LSE, q_length, k_length, heads, dim,
                  padded, stride_qb, stride_ql, stride_qh, stride_ob, stride_ol, stride_oh, sm_scale, k_bufs, v_bufs,
                  q_bufs, ready, free, turns)  # fmt: skip
        gl.warp_specialize(
            [(_consume, (values, 0, QMAX, P_EXPONENT, HAS_MASK, HEAD_DIM, BLOCK_N, STAGES, SCHEDULE, GROUP)),
             (_consume, (values, 1, QMAX, P_EXPONENT, HAS_MASK, HEAD_DIM, BLOCK_N, STAGES, SCHEDULE, GROUP)),
             (_load, (values, 0, QMAX, P_EXPONENT, HAS_MASK, HEAD_DIM, BLOCK_N, STAGES, SCHEDULE, GROUP))],
            [_ROWS // 16, 1], [_CONSUMER_REGS, 24],
        )  # fmt: skip

    @gluon.jit
    def _load(values, WHICH: gl.constexpr, QMAX: gl.constexpr, P_EXPONENT: gl.constexpr, HAS_MASK: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCHEDULE: gl.constexpr,
              GROUP: gl.constexpr):  # fmt: skip
        """One warp: the key tiles of K and of V, ``GROUP`` at a time, into the next stages by TMA, once both
        consumers have freed them. A group past the last tile is loaded whole (its rows past the tensor as zeros) and
        never read."""
        _, K_DESC, V_DESC, _, _, _, _, _, _, _, k_length, _, _, padded, _, _, _, _, _, _, _, k_bufs, v_bufs, _, ready, \
            free, _ = values  # fmt: skip
        slots: gl.constexpr = STAGES // GROUP
        bh = gl.program_id(1)
        for group in range(gl.cdiv(gl.cdiv(k_length, BLOCK_N), GROUP)):
            slot = group % slots
            # A fresh barrier counts as having completed the phase before its first: the ring starts empty.
            mbarrier.wait(free.index(slot), ((group // slots) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), GROUP * BLOCK_N * HEAD_DIM * 2)
            for j in gl.static_range(GROUP):
                tile = group * GROUP + j
                tma_load(K_DESC, [bh * padded + tile * BLOCK_N, 0], ready.index(slot), k_bufs.index(tile % STAGES))
                tma_load(V_DESC, [bh * HEAD_DIM, tile * BLOCK_N], ready.index(slot), v_bufs.index(tile % STAGES))

    @gluon.jit
    def _wait_loaded(ready, tile, STAGES: gl.constexpr, GROUP: gl.constexpr):
        """Until key tile ``tile`` is in its stage: a wait at the first tile of each group."""
        group = tile // GROUP
        if tile % GROUP == 0:
            mbarrier.wait(ready.index(group % (STAGES // GROUP)), (group // (STAGES // GROUP)) & 1)

    @gluon.jit
    def _release(free, tile, STAGES: gl.constexpr, GROUP: gl.constexpr):
        """Key tile ``tile``'s stage freed for the loader: an arrival at the last tile of each group."""
        group = tile // GROUP
        if tile % GROUP == GROUP - 1:
            mbarrier.arrive(free.index(group % (STAGES // GROUP)), count=1)

    @gluon.jit
    def _wait_turn(turns, WHICH: gl.constexpr, turn, SCHEDULE: gl.constexpr):
        """Consumer ``WHICH``'s ``turn``-th issue waits for the other's previous one: the first consumer's first
        turn passes (a fresh barrier's phase before the first counts as complete), the second's waits for it."""
        if SCHEDULE == _PING_PONG:
            mbarrier.wait(turns.index(WHICH), (turn & 1) ^ (1 - WHICH))

    @gluon.jit
    def _pass_turn(turns, WHICH: gl.constexpr, SCHEDULE: gl.constexpr):
        if SCHEDULE == _PING_PONG:
            mbarrier.arrive(turns.index(1 - WHICH), count=1)

    @gluon.jit
    def _consume(values, WHICH: gl.constexpr, QMAX: gl.constexpr, P_EXPONENT: gl.constexpr, HAS_MASK: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCHEDULE: gl.constexpr,
                 GROUP: gl.constexpr):  # fmt: skip
        """A warp group's ``ROWS`` queries against every key tile: each tile's softmax on its scores (held in
        registers), and the products ordered by ``SCHEDULE``, all awaited before the loop turns, so that nothing is
        in flight across its back edge."""
        Q, _, V_DESC, K_SCALE, V_SCALE, K_MEAN, KEY_MASK, OUT, LSE, q_length, k_length, heads, dim, padded, stride_qb, \
            stride_ql, stride_qh, stride_ob, stride_ol, stride_oh, sm_scale, k_bufs, v_bufs, q_bufs, ready, free, \
            turns = values  # fmt: skip
        P_TYPE: gl.constexpr = V_DESC.dtype
        warps: gl.constexpr = _ROWS // 16
        block, bh = gl.program_id(0), gl.program_id(1)
        b, h = bh // heads, bh % heads
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_of_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # Q's load: 16 bytes a thread along the head dim.
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [_ROWS // 16, 1], [1, 0])
        first_row = (2 * block + WHICH) * _ROWS

        # Q: loaded, smoothed keys' constant taken, quantized to INT8 with one scale for the group's rows, into
        # shared memory (the first product's A operand, read there by every tile's wgmma).
        queries = first_row + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, q_load))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_load))
        q_ptrs = Q + b * stride_qb + h * stride_qh + queries[:, None] * stride_ql + dims[None, :]
        q = gl.load(q_ptrs, mask=(queries[:, None] < q_length) & (dims[None, :] < dim), other=0.0).to(gl.float32)
        q_mean = gl.sum(q * gl.load(K_MEAN + bh * HEAD_DIM + dims)[None, :], 1)
        q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0), 1e-30) / QMAX
        q = q / q_scale
        q_smem = q_bufs.index(WHICH)
        q_smem.store(gl.where(q >= 0, q + 0.5, q - 0.5).to(gl.int8))  # to nearest, half away (conversion truncates)
        fence_async_shared()
        qk_scale = sm_scale * 1.4426950408889634 * q_scale  # softmax in base 2

        # The int32 products come out as floats without a conversion: the accumulator starts at the bits of
        # 1.5 * 2^23, to which each product (|x| < 2^22) adds exactly; ``offset`` is subtracted in the multiply-add.
        magic = gl.full([_ROWS, BLOCK_N], 0x4B400000, gl.int32, s_layout)
        offset = 12582912.0
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        k_scales = K_SCALE + bh * (padded // BLOCK_N)
        key_mask = KEY_MASK + b * padded
        tiles = gl.cdiv(k_length, BLOCK_N)
        _wait_loaded(ready, 0, STAGES, GROUP)
        _wait_turn(turns, WHICH, 0, SCHEDULE)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), magic, is_async=True)
        _pass_turn(turns, WHICH, SCHEDULE)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i = gl.full([_ROWS], -1e30, gl.float32, rows_of_s)  # finite: an all-masked row rescales by exp2(0)
        l_i = gl.zeros([_ROWS], gl.float32, rows_of_s)
        o = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
        k_scale = gl.load(k_scales)
        for tile in range(tiles - 1):
            scale = gl.maximum(qk_scale * k_scale, 1e-30)
            # The next tile's K scale, loaded a tile ahead: its latency from L2 would otherwise stall the softmax.
            k_scale = gl.load(k_scales + tile + 1)
            following = tile + 1
            if SCHEDULE == _EARLY_QK:
                _wait_loaded(ready, following, STAGES, GROUP)
                s_next = warpgroup_mma(q_smem, k_bufs.index(following % STAGES).permute((1, 0)), magic, is_async=True)
            probabilities, alpha, m_i, l_i = _softmax(s, m_i, l_i, scale, key_mask, keys, tile, k_length, offset,
                                                      P_EXPONENT, False, HAS_MASK)  # fmt: skip
            p = gl.convert_layout(_to_operand_order(probabilities.to(P_TYPE)), p_layout)
            o = o * gl.convert_layout(alpha, rows_of_o)[:, None]
            if SCHEDULE == _EARLY_QK:
                o = warpgroup_mma(p, v_bufs.index(tile % STAGES).permute((1, 0)), o, is_async=True)
                o, s = warpgroup_mma_wait(0, deps=(o, s_next))
            else:
                _wait_loaded(ready, following, STAGES, GROUP)
                _wait_turn(turns, WHICH, following, SCHEDULE)
                o = warpgroup_mma(p, v_bufs.index(tile % STAGES).permute((1, 0)), o, is_async=True)
                s = warpgroup_mma(q_smem, k_bufs.index(following % STAGES).permute((1, 0)), magic, is_async=True)
                _pass_turn(turns, WHICH, SCHEDULE)
                o, s = warpgroup_mma_wait(0, deps=(o, s))
            _release(free, tile, STAGES, GROUP)
        # The last tile, whose keys past the length (padding) are masked.
        last = tiles - 1
        probabilities, alpha, m_i, l_i = _softmax(s, m_i, l_i, gl.maximum(qk_scale * k_scale, 1e-30), key_mask, keys,
                                                  last, k_length, offset, P_EXPONENT, True, HAS_MASK)  # fmt: skip
        p = gl.convert_layout(_to_operand_order(probabilities.to(P_TYPE)), p_layout)
        o = o * gl.convert_layout(alpha, rows_of_o)[:, None]
        _wait_turn(turns, WHICH, tiles, SCHEDULE)
        o = warpgroup_mma(p, v_bufs.index(last % STAGES).permute((1, 0)), o, is_async=True)
        _pass_turn(turns, WHICH, SCHEDULE)
        o = warpgroup_mma_wait(0, deps=(o,))

        empty = l_i == 0.0  # every key masked: output 0, log-sum-exp -inf (nothing when merged)
        out_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out_rows = first_row + gl.arange(0, _ROWS, layout=rows_of_o)
        norm = gl.convert_layout(gl.where(empty, 1.0, l_i), rows_of_o)
        out = o * gl.load(V_SCALE + bh * HEAD_DIM + out_dims)[None, :] / norm[:, None]
        o_ptrs = OUT + b * stride_ob + h * stride_oh + out_rows[:, None] * stride_ol + out_dims[None, :]
        gl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(out_rows[:, None] < q_length) & (out_dims[None, :] < dim))
        lse_rows = first_row + gl.arange(0, _ROWS, layout=rows_of_s)
        q_mean = gl.convert_layout(q_mean, rows_of_s)
        lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - P_EXPONENT) * 0.6931471805599453 + q_mean * sm_scale
        gl.store(LSE + bh * q_length + lse_rows, gl.where(empty, float("-inf"), lse), mask=lse_rows < q_length)

    @gluon.jit
    def _softmax(s, m_i, l_i, scale, key_mask, keys, tile, k_length, offset, P_EXPONENT: gl.constexpr,
                 CHECK: gl.constexpr, HAS_MASK: gl.constexpr):  # fmt: skip
        """One tile's online-softmax step, as the portable kernel's ``_attend_tile``: one multiply-add a score into
        exp2, ``scale`` (Q's and the tile's K scale with the softmax's, positive even where Q or K is all zeros, so
        that masked scores stay -inf) taking the products to scores after the max, P scaled to ``2^P_EXPONENT`` in
        the exponent."""
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
    ``config`` (stages, schedule, tiles a barrier covers)."""
    stages, schedule, group = config
    # A consumer frees a group only after issuing the next tile's Q·Kᵀ: with one group in the ring, that tile's load
    # would wait for the free, and the free for the load.
    if stages % group or stages // group < 2:
        raise ValueError(f"{stages} stages hold fewer than two groups of {group} tiles")
    batch, q_length = query.shape[0], query.shape[1]
    padded, width = k8.shape[2], k8.shape[-1]
    k_desc = TensorDescriptor.from_tensor(
        k8.view(-1, width), [BLOCK_N, width], shared_layout([BLOCK_N, width], gl.int8)
    )
    v_desc = TensorDescriptor.from_tensor(
        v8.view(-1, padded), [width, BLOCK_N], shared_layout([width, BLOCK_N], gl.float8e4nv)
    )
    grid = (-(-q_length // (2 * ROWS)), batch * heads)
    _hopper_forward[grid](query, k_desc, v_desc, k_scale, v_scale, k_mean, mask, out, lse, q_length, k_length, heads,
                          dim, padded, query.stride(0), query.stride(1), query.stride(2), out.stride(0),
                          out.stride(1), out.stride(2), dim**-0.5, QMAX=qmax, P_EXPONENT=p_exponent,
                          HAS_MASK=has_mask, HEAD_DIM=width, BLOCK_N=BLOCK_N, STAGES=stages, SCHEDULE=schedule,
                          GROUP=group, num_warps=ROWS // 16, maxnreg=MAX_REGISTERS,
                          enable_fp_fusion=True)  # fmt: skip
