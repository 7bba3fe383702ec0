"""Sparse VideoGen2's semantic-aware permutation (Yang et al. 2025, "Sparse VideoGen2: Accelerate Video Generation with
Sparse Attention via Semantic-Aware Permutation"): each head's queries and keys clustered by k-means, each query
cluster attending the key clusters that hold the top-p of its centroid's attention, the tokens permuted so that each
cluster is contiguous, which turns the cluster mask into a block mask. Plain torch, on the inputs' device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradit.layers import nearest_centroid
from paradit.layers.sparse_masks import TILE, tiles

# The settings of SVG2's Wan 2.1 720p script (svg-project/Sparse-VideoGen, wan_t2v_inference with --strategy sap):
# 300 query and 1,000 key clusters, top-p 0.9, every query cluster keeping at least 10% of the key clusters, 50 k-means
# iterations at the first sparse step and 2 a step after, started from the step before's centroids; the first 20% of
# the steps and 3% of the blocks dense.
SVG2_QUERY_CLUSTERS = 300
SVG2_KEY_CLUSTERS = 1000
SVG2_TOP_P = 0.9
SVG2_MIN_KEY_SHARE = 0.10
SVG2_FIRST_ITERATIONS = 50
SVG2_ITERATIONS = 2
SVG2_DENSE_STEP_SHARE = 0.2
SVG2_DENSE_BLOCK_SHARE = 0.03
# Distances computed at once, at most (rows x tokens x clusters): a head's 75,600 tokens x 1,000 key clusters at 720p
# is 0.3 GB in float32, all 40 heads 12 GB; the rows go through in groups under this (torch's passes only).
KMEANS_ELEMENTS = 2**28
# k-means' passes: "fused" (``nearest_centroid``'s kernel, where it runs) or "torch" (the passes where the kernel does
# not run, and the reference the benchmark measures the kernel against).
KMEANS_PASSES = "fused"


def kmeans(
    points: torch.Tensor, centroids: torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd's iterations on (N, L, D) points from (N, C, D) centroids: (labels (N, L), float32 centroids, cluster
    sizes (N, C)). The point-centroid products in the points' dtype (bf16 on GPUs: tensor cores, where float32
    would take tens of milliseconds a block at 720p), the centroids and their sums in float32. A cluster left empty
    keeps its centroid."""
    centroids = centroids.float()
    clusters, width = centroids.shape[1], points.shape[-1]
    for done in range(iterations + 1):
        # The squared distance less |x|², which does not change the nearest centroid.
        products = (points @ centroids.to(points.dtype).transpose(1, 2)).float()
        labels = (centroids.square().sum(-1)[:, None, :] - 2 * products).argmin(dim=-1)
        del products
        sizes = torch.zeros(points.shape[0], clusters, device=points.device).scatter_add_(
            1, labels, torch.ones_like(labels, dtype=torch.float32)
        )
        if done == iterations:
            break
        sums = torch.zeros_like(centroids).scatter_add_(1, labels[..., None].expand(-1, -1, width), points.float())
        centroids = torch.where(sizes[..., None] > 0, sums / sizes.clamp(min=1)[..., None], centroids)
    return labels, centroids, sizes


def fused_kmeans(
    points: torch.Tensor, centroids: torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kmeans`` with each pass one kernel (``nearest_centroid``): no distances materialised, no float32 copy of
    the points, every row at once."""
    centroids = centroids.float()
    for done in range(iterations + 1):
        labels, sizes, sums = nearest_centroid.nearest_centroids(points, centroids, add_sums=done < iterations)
        if done == iterations:
            break
        centroids = torch.where(sizes[..., None] > 0, sums / sizes.clamp(min=1)[..., None], centroids)
    return labels, centroids, sizes


def grouped_kmeans(points: torch.Tensor, centroids: torch.Tensor, iterations: int):
    """``kmeans`` over groups of rows, so that no group's distances pass ``KMEANS_ELEMENTS``; the fused passes
    where their kernel runs."""
    if KMEANS_PASSES == "fused" and nearest_centroid.kernel_runs(points):
        return fused_kmeans(points, centroids, iterations)
    rows = max(1, KMEANS_ELEMENTS // (points.shape[1] * centroids.shape[1]))
    parts = [kmeans(p, c, iterations) for p, c in zip(points.split(rows), centroids.split(rows), strict=True)]
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def spread_centroids(points: torch.Tensor, clusters: int) -> torch.Tensor:
    """The first centroids: tokens evenly spaced along the sequence (deterministic, so every rank starts alike)."""
    picks = torch.linspace(0, points.shape[1] - 1, clusters, device=points.device).round().long()
    return points[:, picks].float()


@dataclass
class SemanticLayout:
    """Per (batch x head) row: the query and key orders (position -> token) and the block mask over the permuted
    tiles, (N, query tiles, key tiles)."""

    query_order: torch.Tensor
    key_order: torch.Tensor
    block_mask: torch.Tensor


def top_p_clusters(
    query_centroids: torch.Tensor, key_centroids: torch.Tensor, key_sizes: torch.Tensor, top_p: float, min_share: float
) -> torch.Tensor:
    """(N, Cq, Ck) bool: per query cluster the fewest key clusters, by their share of its centroid's attention
    (each key cluster weighted by its size), whose shares reach ``top_p``, and at least ``min_share`` of them."""
    scale = query_centroids.shape[-1] ** -0.5
    logits = query_centroids @ key_centroids.transpose(1, 2) * scale + key_sizes.log()[:, None, :]
    shares = logits.softmax(dim=-1)
    ordered, order = shares.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # the share of the clusters ranked above each
    least = max(1, round(min_share * key_centroids.shape[1]))
    ranks = torch.arange(ordered.shape[-1], device=ordered.device)
    keep_ranked = (before < top_p) | (ranks < least)
    return torch.zeros_like(keep_ranked).scatter_(-1, order, keep_ranked)


def tile_members(sorted_labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """(N, tiles, C) float 0/1: which clusters a tile of the permuted sequence holds tokens of."""
    rows, length = sorted_labels.shape
    padded = torch.nn.functional.pad(sorted_labels, (0, tiles(length) * TILE - length), value=-1)
    members = torch.zeros(rows, tiles(length), clusters + 1, device=sorted_labels.device)
    # Padding (-1) lands in an extra column, dropped.
    members.scatter_(2, (padded.view(rows, -1, TILE) % (clusters + 1)).long(), 1.0)
    return members[..., :clusters]


def semantic_layout(
    query: torch.Tensor,
    key: torch.Tensor,
    query_clusters: int,
    key_clusters: int,
    top_p: float,
    min_key_share: float,
    iterations: int,
    centroids: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[SemanticLayout, tuple[torch.Tensor, torch.Tensor]]:
    """``query``/``key`` (B, L, H, D). The layout and the centroids (to start the next step's k-means from)."""
    batch, length, heads, dim = query.shape
    q_points = query.permute(0, 2, 1, 3).reshape(batch * heads, length, dim)
    k_points = key.permute(0, 2, 1, 3).reshape(batch * heads, key.shape[1], dim)
    query_clusters, key_clusters = min(query_clusters, length), min(key_clusters, key.shape[1])
    if centroids is None or centroids[0].shape[:2] != (batch * heads, query_clusters):
        centroids = spread_centroids(q_points, query_clusters), spread_centroids(k_points, key_clusters)
    q_labels, q_centroids, _ = grouped_kmeans(q_points, centroids[0], iterations)
    k_labels, k_centroids, k_sizes = grouped_kmeans(k_points, centroids[1], iterations)
    clusters = top_p_clusters(q_centroids, k_centroids, k_sizes, top_p, min_key_share)
    q_sorted, query_order = q_labels.sort(dim=-1, stable=True)
    k_sorted, key_order = k_labels.sort(dim=-1, stable=True)
    q_members, k_members = tile_members(q_sorted, query_clusters), tile_members(k_sorted, key_clusters)
    block_mask = (q_members @ clusters.float() @ k_members.transpose(1, 2)) > 0
    layout = SemanticLayout(
        query_order.view(batch, heads, -1),
        key_order.view(batch, heads, -1),
        block_mask.view(batch, heads, *block_mask.shape[1:]),
    )
    return layout, (q_centroids, k_centroids)


def permute_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) with each head's tokens in ``order`` (B, H, L)."""
    return x.gather(1, order.transpose(1, 2)[..., None].expand(-1, -1, -1, x.shape[-1]))


def unpermute_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``permute_tokens``."""
    out = torch.empty_like(x)
    return out.scatter_(1, order.transpose(1, 2)[..., None].expand(-1, -1, -1, x.shape[-1]), x)
