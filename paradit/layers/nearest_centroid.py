"""One k-means pass as one Triton kernel: each point's nearest centroid, and each cluster's sum of points and size
added up in the same pass. Written by hand because torch materialises every point-centroid distance (40 heads x
75,600 tokens x 1,000 key clusters at Wan 720p: 12 GB of float32, written and read three times a pass), where this
kernel keeps a tile's distances in registers and reads each point once. CUDA and ROCm alike; Triton's interpreter
runs it on the CPU for the tests."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: SVG2's k-means runs in torch (``kernel_runs`` says so)
    triton = None

from paradit.layers.fp8_attention import interpreting

POINT_TILE, CENTROID_TILE = 128, 64


def kernel_runs(points: torch.Tensor) -> bool:
    """Whether this kernel serves ``points``: on a GPU with Triton, or on the CPU under Triton's interpreter."""
    return triton is not None and (points.device.type == "cuda" or interpreting())


if triton is not None:

    @triton.jit
    def _nearest_centroid(
        POINTS,
        CENTROIDS,
        NORMS,
        LABELS,
        SUMS,
        SIZES,
        length,
        clusters,
        dim,
        ADD_SUMS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        block, row = tl.program_id(0), tl.program_id(1)
        points = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        real = (points[:, None] < length) & (dims[None, :] < dim)
        x = tl.load(POINTS + row * length * dim + points[:, None] * dim + dims[None, :], mask=real, other=0.0)
        best = tl.full([BLOCK_M], float("inf"), tl.float32)
        label = tl.zeros([BLOCK_M], tl.int32)
        for start in range(0, clusters, BLOCK_C):
            ids = start + tl.arange(0, BLOCK_C)
            there = ids < clusters
            c = tl.load(
                CENTROIDS + row * clusters * dim + ids[:, None] * dim + dims[None, :],
                mask=there[:, None] & (dims[None, :] < dim),
                other=0.0,
            )
            # The squared distance less |x|², which does not change the nearest centroid; a padding centroid's
            # norm is infinite, so it is never nearest.
            norms = tl.load(NORMS + row * clusters + ids, mask=there, other=float("inf"))
            score = norms[None, :] - 2.0 * tl.dot(x, tl.trans(c))
            tile_best = tl.min(score, 1)
            tile_label = tl.argmin(score, 1) + start
            nearer = tile_best < best  # strictly: the first nearest wins a tie, as torch's argmin
            best = tl.where(nearer, tile_best, best)
            label = tl.where(nearer, tile_label, label)
        inside = points < length
        tl.store(LABELS + row * length + points, label, mask=inside)
        tl.atomic_add(SIZES + row * clusters + label, tl.full([BLOCK_M], 1.0, tl.float32), mask=inside)
        if ADD_SUMS:
            sums = SUMS + row * clusters * dim + label[:, None] * dim + dims[None, :]
            tl.atomic_add(sums, x.to(tl.float32), mask=real)


def nearest_centroids(
    points: torch.Tensor, centroids: torch.Tensor, add_sums: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, L, D) points, (N, C, D) float32 centroids: (labels (N, L) int64, cluster sizes (N, C) float32, the
    clusters' float32 sums of points (N, C, D), None unless ``add_sums``). The products in the points' dtype
    (tensor cores), accumulated in float32."""
    points = points.contiguous()
    rows, length, dim = points.shape
    clusters = centroids.shape[1]
    norms = centroids.square().sum(-1).contiguous()
    labels = torch.empty(rows, length, dtype=torch.int32, device=points.device)
    sizes = torch.zeros(rows, clusters, dtype=torch.float32, device=points.device)
    sums = torch.zeros(rows, clusters, dim, dtype=torch.float32, device=points.device) if add_sums else sizes
    _nearest_centroid[(triton.cdiv(length, POINT_TILE), rows)](
        points,
        centroids.to(points.dtype).contiguous(),
        norms,
        labels,
        sums,
        sizes,
        length,
        clusters,
        dim,
        ADD_SUMS=add_sums,
        HEAD_DIM=max(16, triton.next_power_of_2(dim)),
        BLOCK_M=POINT_TILE,
        BLOCK_C=CENTROID_TILE,
        num_warps=8,
    )
    return labels.long(), sizes, sums if add_sums else None
