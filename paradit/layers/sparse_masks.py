"""Block masks for sparse attention: per head, query tile x key tile, True where the tile is attended; the token mask
they stand for; Radial attention's static mask for a video's (frames, rows, columns) token grid, and that grid as
the model sets it. Plain torch: no Triton, no ``torch.distributed``."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# The video's token grid (frames, rows, columns) of the forward in flight, set by the model around its blocks: a
# context variable, as the sequence layout is, so that no state outlives its forward.
VIDEO_GRID: ContextVar[tuple[int, int, int] | None] = ContextVar("paradit_video_grid", default=None)


@contextlib.contextmanager
def video_grid(grid: tuple[int, int, int]) -> Iterator[None]:
    token = VIDEO_GRID.set(tuple(grid))
    try:
        yield
    finally:
        VIDEO_GRID.reset(token)


# Tiles of 128 queries by 128 keys: the FP8 kernel's key tile (its K scale block) and Radial attention's block size
# (Li et al. 2025, "Radial Attention", section 4: block-sparse masks of 128 x 128 blocks).
TILE = 128


def tiles(length: int) -> int:
    return -(-length // TILE)


def token_mask(block_mask: torch.Tensor, q_length: int, k_length: int) -> torch.Tensor:
    """(..., query tiles, key tiles) -> (..., q_length, k_length): each tile's value on its tokens."""
    expanded = block_mask.repeat_interleave(TILE, dim=-2).repeat_interleave(TILE, dim=-1)
    return expanded[..., :q_length, :k_length]


def density(block_mask: torch.Tensor, q_length: int, k_length: int) -> float:
    """The share of (query, key) pairs attended, counting each tile by the tokens it holds."""
    return kept_share(block_mask, q_length, k_length).item()


def kept_share(block_mask: torch.Tensor, q_length: int, k_length: int) -> torch.Tensor:
    """``density`` as a tensor on the mask's device (no wait for the device)."""
    q_sizes = _tile_sizes(q_length, block_mask.device)
    k_sizes = _tile_sizes(k_length, block_mask.device)
    per_tile = block_mask.reshape(-1, *block_mask.shape[-2:]).float().mean(dim=0)
    return (per_tile * q_sizes[:, None] * k_sizes[None, :]).sum() / (q_length * k_length)


def _tile_sizes(length: int, device: torch.device) -> torch.Tensor:
    sizes = torch.full((tiles(length),), float(TILE), device=device)
    sizes[-1] = length - TILE * (tiles(length) - 1)
    return sizes


# Radial attention (Li et al. 2025, "Radial Attention: O(n log n) Sparse Attention with Energy Decay for Long Video
# Generation", section 4.1 and its code, mit-han-lab/radial-attention radial_attn/attn_mask.py): a query of frame i
# attends frame j's keys within a band around its own position in the frame, the band halving each time the temporal
# distance |i - j| doubles, so the compute density decays exponentially with distance (O(n log n) in all). For Wan:
# the same frame whole, neighbouring frames within half a frame; from distance d >= 2 on, a band of
# 2^bitlen(S) / 2^bitlen(d) tokens (S the tokens per frame) times the decay factor, never narrower than one tile;
# once that band is narrower than a tile, only every (TILE / band)-th frame is attended. Frame 0 is attended whole by
# every query (an attention sink). A tile of the token mask is kept where more than 60% of its attended key columns
# are attended by more than a third of its queries (the code's "strict" reduction to blocks); and, ours, the diagonal.
# The paper's settings for Wan at its trained length (its code's wan_t2v_inference.py): decay factor 1, the first 12
# of 50 steps and the first block dense.
RADIAL_DECAY_FACTOR = 1.0
RADIAL_DENSE_STEPS = 12
RADIAL_DENSE_BLOCKS = 1


def _band(distance: int, frame_tokens: int, decay_factor: float) -> tuple[float, bool]:
    """(half-width of the band in tokens, whether the frame pair is attended at all)."""
    if distance == 0:
        return float(frame_tokens), True
    if distance == 1:
        return float(frame_tokens // 2), True
    decayed = 2 ** frame_tokens.bit_length() / 2 ** distance.bit_length()
    attended = decayed >= TILE or distance % int(TILE / decayed) == 0
    return max(decayed * decay_factor, float(TILE)), attended


@functools.lru_cache(maxsize=8)
def radial_block_mask(
    grid: tuple[int, int, int], decay_factor: float = RADIAL_DECAY_FACTOR, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(tiles, tiles) bool on ``device`` for a video of ``grid`` tokens (frames, rows, columns) in raster order; the
    same for every head. Built there (seconds on a CPU at 720p, milliseconds on a GPU) and cached: a run's videos
    share a few grids."""
    frames, rows, columns = grid
    per_frame, length = rows * columns, frames * rows * columns
    mask = torch.zeros(tiles(length), tiles(length), dtype=torch.bool, device=device)
    positions = torch.arange(per_frame, device=device)
    key_tiles = (torch.arange(frames, device=device)[:, None] * per_frame + positions) // TILE  # (frames, per_frame)
    for i in range(frames):
        first_tile, last_tile = i * per_frame // TILE, ((i + 1) * per_frame - 1) // TILE
        query_tiles = torch.arange(first_tile, last_tile + 1, device=device)
        # Each query tile's rows within frame i, as positions in the frame: [start, stop).
        start = (query_tiles * TILE).clamp(min=i * per_frame) - i * per_frame
        stop = ((query_tiles + 1) * TILE).clamp(max=(i + 1) * per_frame) - i * per_frame
        bands = [_band(abs(i - j), per_frame, decay_factor) for j in range(frames)]
        attended = torch.tensor([j == 0 or keep for j, (_, keep) in enumerate(bands)], device=device)
        # Frame 0, the sink, whole: a band wider than any frame.
        widths = [float(2 * per_frame) if j == 0 else band for j, (band, _) in enumerate(bands)]
        width = torch.tensor(widths, device=device)
        low = torch.maximum(start[None, :, None], (positions - width[:, None]).ceil().long()[:, None, :])
        high = torch.minimum(stop[None, :, None] - 1, (positions + width[:, None]).floor().long()[:, None, :])
        counts = (high - low + 1).clamp(min=0) * attended[:, None, None]  # (frames j, query tiles, positions)
        # Per frame pair, as the paper reduces each pair's mask to tiles and ORs the pairs' tiles.
        index = key_tiles[:, None, :].expand_as(counts)
        seen = torch.zeros(frames, len(query_tiles), mask.shape[1], device=device).scatter_add_(
            2, index, (counts > 0).float()
        )
        dense = torch.zeros_like(seen).scatter_add_(2, index, (counts > TILE / 3).float())
        mask[first_tile : last_tile + 1] |= ((dense > 0.6 * seen) & (seen > 0)).any(dim=0)
    # Each query tile keeps its own tile, so that no query is left without keys (frames smaller than a tile).
    return mask | torch.eye(len(mask), dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=8)
def radial_kept_share(
    grid: tuple[int, int, int], decay_factor: float = RADIAL_DECAY_FACTOR, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``kept_share`` of ``radial_block_mask``: the same for every call on ``grid``, so made once."""
    length = math.prod(grid)
    return kept_share(radial_block_mask(grid, decay_factor, device), length, length)
