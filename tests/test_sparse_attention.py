"""Block-sparse attention (``--sparse-attention``): the Triton kernel skipping the tiles a block mask excludes, run by
Triton's interpreter, against masked SDPA over the same mask expanded to tokens (fp32: the kernel in the inputs'
precision; FP8: within the FP8 tests' bound); Radial attention's mask against a token-level construction of the
paper's rule; SVG2's clusters, permutation and top-p budget; the refusals."""

from __future__ import annotations

import pytest
import torch

from paradit.errors import InvalidRequest
from paradit.layers.fp8_attention import exact_triton_attention_with_lse, fp8_attention_with_lse, kept_tile_rows
from paradit.layers.semantic_permutation import (
    fused_kmeans,
    kmeans,
    semantic_layout,
    spread_centroids,
    top_p_clusters,
)
from paradit.layers.sparse_attention import (
    SparseRun,
    SparseSelfAttention,
    SparseSettings,
    balanced_head_order,
    block_masked_attention_with_lse,
)
from paradit.layers.sparse_masks import TILE, density, radial_block_mask, tiles, token_mask, video_grid
from paradit.options import ExecutionOptions, check_conflicts
from paradit.parallel.config import ParallelConfig
from tests.checkpoints import relative_l2
from tests.test_fp8_attention import inputs, output_bound


def random_block_mask(batch: int, heads: int, q_length: int, k_length: int, seed: int = 0) -> torch.Tensor:
    """About half the tiles kept, each query tile keeping at least its first key tile; the second batch row's first
    query tile keeps none (its queries get 0, log-sum-exp -inf)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, tiles(q_length), tiles(k_length), generator=generator) < 0.5
    mask[..., 0] = True
    if batch > 1:
        mask[1, :, 0] = False
    return mask


@pytest.mark.parametrize(
    "q_length, k_length, heads, dim, batch",
    [(300, 300, 2, 64, 2), (200, 333, 3, 32, 1), (129, 513, 1, 24, 1)],
    ids=["self-ragged", "cross-uneven", "odd-head-dim"],
)
def test_the_kernel_skipping_excluded_tiles_equals_masked_sdpa(q_length, k_length, heads, dim, batch):
    """fp32 in the interpreter: the kernel's arithmetic is exact attention's, so within float rounding."""
    q, k, v = inputs(q_length, k_length, heads, dim, batch)
    mask = random_block_mask(batch, heads, q_length, k_length)
    out, lse = exact_triton_attention_with_lse(q, k, v, None, kept_tile_rows(mask))
    want, want_lse = block_masked_attention_with_lse(q, k, v, mask)
    assert relative_l2(out, want) <= 1e-5
    kept = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), kept)
    assert (lse[kept] - want_lse[kept]).abs().max().item() <= 1e-4
    if batch > 1:
        assert torch.all(out[1, :TILE] == 0)


def test_a_mask_that_keeps_every_tile_is_dense_attention():
    q, k, v = inputs(300, 300, heads=2, dim=64, batch=1)
    every = kept_tile_rows(torch.ones(1, 2, 3, 3, dtype=torch.bool))
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert relative_l2(exact_triton_attention_with_lse(q, k, v, None, every)[0], dense) <= 1e-5
    # FP8 (Q quantized per query tile, the sparse kernel's of 128 queries): within FP8's bound of dense attention.
    assert relative_l2(fp8_attention_with_lse(q, k, v, None, every)[0], dense) < output_bound(q, k)


def test_fp8_skipping_tiles_is_within_the_fp8_bound_of_the_masked_reference():
    """Against the same masked attention in fp32, within the bound the FP8 tests derive (each query's kept keys
    are a subset of the keys that bound assumes)."""
    q, k, v = inputs(300, 300, heads=2, dim=64, batch=1)
    mask = random_block_mask(1, 2, 300, 300, seed=1)
    out, _ = fp8_attention_with_lse(q, k, v, None, kept_tile_rows(mask))
    want, _ = block_masked_attention_with_lse(q, k, v, mask)
    assert relative_l2(out, want) < output_bound(q, k)


def test_padding_key_mask_and_block_mask_together():
    q, k, v = inputs(200, 300, heads=2, dim=32, batch=2)
    mask = random_block_mask(2, 2, 200, 300, seed=2)
    key_mask = torch.ones(2, 300, dtype=torch.bool)
    key_mask[0, 250:] = False
    out, _ = exact_triton_attention_with_lse(q, k, v, key_mask, kept_tile_rows(mask))
    want, _ = block_masked_attention_with_lse(q, k, v, mask, key_mask)
    assert relative_l2(out, want) <= 1e-5


def paper_radial_token_mask(grid: tuple[int, int, int]) -> torch.Tensor:
    """The paper's rule built token by token, independently of ``radial_block_mask``'s interval counting: frame pairs'
    bands, frame 0 a sink, then each 128 x 128 tile kept where over 60% of its attended columns are attended by
    over a third of its rows (the reduction applied per frame pair, the pairs' tiles OR-ed), and the diagonal."""
    frames, rows, columns = grid
    per_frame = rows * columns
    length = frames * per_frame
    mask = torch.zeros(tiles(length), tiles(length), dtype=torch.bool)
    position = torch.arange(per_frame)
    band = (position[None, :] - position[:, None]).abs()
    for i in range(frames):
        for j in range(frames):
            distance = abs(i - j)
            if j == 0 or distance == 0:
                pair = torch.ones(per_frame, per_frame, dtype=torch.bool)
            elif distance == 1:
                pair = band <= per_frame // 2
            else:
                decayed = 2 ** per_frame.bit_length() / 2 ** distance.bit_length()
                if decayed < TILE and distance % int(TILE / decayed):
                    continue
                pair = band <= max(decayed, TILE)
            # The rows of the tiles frame i touches, every key column.
            first, last = i * per_frame // TILE, ((i + 1) * per_frame - 1) // TILE
            canvas = torch.zeros((last - first + 1) * TILE, tiles(length) * TILE, dtype=torch.bool)
            top = i * per_frame - first * TILE
            canvas[top : top + per_frame, j * per_frame : (j + 1) * per_frame] = pair
            column_counts = canvas.view(-1, TILE, canvas.shape[1]).sum(dim=1)
            columns_seen = (column_counts > 0).view(len(column_counts), -1, TILE).sum(-1)
            columns_dense = (column_counts > TILE / 3).view(len(column_counts), -1, TILE).sum(-1)
            mask[first : last + 1] |= (columns_dense > 0.6 * columns_seen) & (columns_seen > 0)
    return mask | torch.eye(len(mask), dtype=torch.bool)


def test_the_radial_mask_is_the_papers_rule_for_a_grid_that_exercises_every_case():
    """Frames of 192 tokens (tiles straddle frames) over 9 frames: whole frames at distance 0, half of one at 1, and
    from distance 2 on a band under one tile wide, so every second frame only, 128 tokens wide."""
    grid = (9, 8, 24)
    mask = radial_block_mask(grid)
    assert torch.equal(mask, paper_radial_token_mask(grid))
    length = 9 * 192
    assert mask[:, : 192 // TILE].all()  # frame 0: the sink
    query_tile, far_odd, far_even = 8 * 192 // TILE + 1, 3 * 192 // TILE + 1, 4 * 192 // TILE + 1
    assert not mask[query_tile, far_odd] and mask[query_tile, far_even]  # distances 5 and 4
    assert 0.3 < density(mask, length, length) < 0.8


def test_density_counts_tokens_not_tiles():
    mask = torch.tensor([[True, False], [False, False]])
    assert density(mask, 130, 130) == pytest.approx(128 * 128 / 130**2)
    assert torch.equal(token_mask(mask, 130, 130)[:128, :128], torch.ones(128, 128, dtype=torch.bool))


def planted_clusters(count: int, per_cluster: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points around ``count`` well-separated centres, shuffled: (1, L, dim) and each point's planted cluster."""
    generator = torch.Generator().manual_seed(seed)
    centres = 10 * torch.randn(count, dim, generator=generator)
    labels = torch.arange(count).repeat_interleave(per_cluster)
    shuffle = torch.randperm(len(labels), generator=generator)
    labels = labels[shuffle]
    return (centres[labels] + 0.1 * torch.randn(len(labels), dim, generator=generator))[None], labels


def test_kmeans_recovers_planted_clusters():
    points, planted = planted_clusters(4, 64, 8, seed=3)
    labels, _, sizes = kmeans(points, spread_centroids(points, 8), iterations=10)
    # Every found cluster lies within one planted cluster (more clusters than planted may split one).
    for found in labels[0].unique():
        assert planted[labels[0] == found].unique().numel() == 1
    assert sizes.sum().item() == points.shape[1]


def test_the_fused_kmeans_passes_equal_torchs():
    """One kernel a pass (Triton's interpreter) against torch's distances: the same labels and sizes, the same
    centroids within float32's rounding of their sums (added in another order), an empty cluster's kept."""
    generator = torch.Generator().manual_seed(6)
    points = torch.randn(3, 300, 24, generator=generator)
    start = spread_centroids(points, 20)
    start[0, 5] = 100.0  # far from every point: left empty, it keeps its centroid
    labels, centroids, sizes = kmeans(points, start, iterations=3)
    fused_labels, fused_centroids, fused_sizes = fused_kmeans(points, start, iterations=3)
    assert torch.equal(fused_labels, labels) and torch.equal(fused_sizes, sizes)
    assert (fused_centroids - centroids).abs().max().item() <= 1e-5
    assert sizes[0, 5].item() == 0 and torch.all(fused_centroids[0, 5] == 100.0)


def test_top_p_keeps_the_fewest_key_clusters_reaching_p_and_the_least_share():
    query = torch.tensor([[[1.0, 0.0]]])
    keys = torch.tensor([[[4.0, 0.0], [0.0, 4.0], [-4.0, 0.0], [0.0, -4.0]]])
    sizes = torch.ones(1, 4)
    kept = top_p_clusters(query * 2, keys, sizes, top_p=0.5, min_share=0.0)
    assert kept.tolist() == [[[True, False, False, False]]]
    kept = top_p_clusters(query * 2, keys, sizes, top_p=0.5, min_share=0.5)
    assert kept.sum().item() == 2


def test_svg2_attends_the_permuted_block_mask_and_returns_tokens_in_their_order(monkeypatch):
    """The whole call against a token-level reference: query i may attend key j where the tile of i's permuted
    position and the tile of j's keep their pair; the output in the input's order."""
    generator = torch.Generator().manual_seed(4)
    batch, length, heads, dim = 1, 300, 2, 16
    q, k, v = (torch.randn(batch, length, heads, dim, generator=generator) for _ in range(3))
    settings = SparseSettings.of("svg2", 1, dense_steps=0, dense_blocks=0, query_clusters=6, key_clusters=10, top_p=0.5)
    attention = SparseSelfAttention(SparseRun(settings), block=0, dense=None)
    made = []  # the layout the call made (k-means under the interpreter is the test's cost: made once)

    def recorded(*args, **kwargs):
        made.append(semantic_layout(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("paradit.layers.sparse_attention.semantic_layout", recorded)
    with video_grid((3, 10, 10)):
        out, lse = attention.with_lse(q, k, v)
    ((layout, _),) = made
    q_tile = torch.empty(batch, heads, length, dtype=torch.long).scatter_(
        2, layout.query_order, (torch.arange(length) // TILE).expand(batch, heads, -1)
    )
    k_tile = torch.empty_like(q_tile).scatter_(2, layout.key_order, (torch.arange(length) // TILE).expand(1, 2, -1))
    allowed = torch.stack(
        [layout.block_mask[0, h][q_tile[0, h][:, None], k_tile[0, h][None, :]] for h in range(heads)]
    )[None]
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * dim**-0.5
    want = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
    assert relative_l2(out, want) <= 1e-5
    assert 0.1 < attention.run.density < 1.0
    assert torch.isfinite(lse).all()


def test_balanced_heads_keep_every_rank_within_a_tenth_of_the_mean():
    loads = [40.0, 38.0, 30.0, 29.0, 26.0, 25.0, 18.0, 17.0, 12.0, 11.0, 6.0, 5.0]
    order = balanced_head_order(loads, [3, 3, 3, 3])
    assert sorted(order) == list(range(12))
    per_rank = [sum(loads[h] for h in order[r * 3 : (r + 1) * 3]) for r in range(4)]
    mean = sum(per_rank) / 4
    assert max(abs(load - mean) for load in per_rank) <= 0.1 * mean
    contiguous = [sum(loads[r * 3 : (r + 1) * 3]) for r in range(4)]  # the plain order is far off
    assert max(abs(load - mean) for load in contiguous) > 0.3 * mean


def test_bad_sparse_parameters_are_refused_naming_what_is_allowed():
    import argparse

    from paradit.options import above_zero, share

    for parse, text, allowed in ((share, "1.5", "a share above 0 and at most 1"), (above_zero, "0", "above 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=allowed):
            parse(text)
    assert share("0.9") == 0.9 and above_zero("0.5") == 0.5


@pytest.mark.parametrize(
    "options, plan, frames, message",
    [
        (ExecutionOptions(sparse_attention="radial"), ParallelConfig(), None, "masks a video's self-attention"),
        (ExecutionOptions(sparse_attention="radial"), ParallelConfig(pipefusion=2), 81, "--pipefusion"),
        (ExecutionOptions(sparse_attention="svg2"), ParallelConfig(ring=2), 81, "svg2 clusters every token"),
        (ExecutionOptions(sparse_attention="radial", sparse_top_p=0.5), ParallelConfig(), 81, "does not read"),
        (ExecutionOptions(sparse_decay_factor=0.5), ParallelConfig(), 81, "does not read"),
        (ExecutionOptions(sparse_attention="radial", cuda_graphs=True), ParallelConfig(), 81, "CUDA graphs"),
    ],
    ids=["images", "pipefusion", "svg2-ring", "svg2-parameter", "no-method", "graphs"],
)
def test_what_sparse_attention_does_not_combine_with_is_refused(options, plan, frames, message):
    from types import SimpleNamespace

    request = SimpleNamespace(frames=frames, cache=None)
    with pytest.raises(InvalidRequest, match=message):
        check_conflicts(plan, options, "cuda", request)


def test_the_benchmarks_tiny_mode_prints_and_writes_its_rows(tmp_path, monkeypatch, capsys):
    """benchmarks/sparse_attention.py --tiny on the CPU (the masked reference: the GPU's figures need the GPU)."""
    import json

    from benchmarks import sparse_attention as benchmark

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    arguments = ["--tiny", "--kmeans", "torch", "--svg2-top-p", "0.3"]
    benchmark.main([*arguments, "--warmup", "0", "--iters", "1", "--out-dir", str(tmp_path)])
    radial, svg2 = json.loads((tmp_path / "sparse_attention.json").read_text())["rows"]
    assert radial["method"] == "radial" and radial["tokens"] == 768
    assert 0.5 < radial["density"] < 1.0  # the tiny grid's radial mask: frames of one tile, distance 3 dropped
    assert 0.0 < radial["rel_l2_vs_sdpa"] < 0.5 and radial["forward_ms"] > 0
    # 300 query clusters over 6 tiles: every tile holds tokens of most clusters, so every tile is kept.
    assert svg2["variant"] == "svg2 p=0.3 torch" and svg2["density"] == 1.0 and svg2["layout_ms"] > 0
    assert "rel L2 vs fp8" in capsys.readouterr().out


def test_the_engine_runs_the_asked_mask_and_reports_it_lossy(tmp_path):
    """Through the front door: the option reaches Wan's self-attention, the run records its mask and density, the
    closing table says it is lossy; a run that did not ask has none (nothing chooses it unasked)."""
    from paradit.cli import format_table
    from paradit.engine import Engine
    from paradit.outputs import sparse_record
    from paradit.request import GenerationRequest

    request = GenerationRequest(prompt="a boat", steps=2, height=32, width=32, frames=5, seed=0)
    options = ExecutionOptions(sparse_attention="radial", sparse_dense_steps=1, sparse_dense_blocks=0)
    with Engine("wan-tiny", device="cpu", options=options) as engine:
        result = engine.generate(request)
    record = result.timings.features["sparse_attention"]
    assert record.method == "radial" and record.settings == {"dense_steps": 1, "dense_blocks": 0, "decay_factor": 1.0}
    assert record.density == 1.0 and record.attended == 1.0  # 8 tokens: one tile, kept
    (row,) = [line.split(None, 1) for line in format_table(result).splitlines() if line.startswith("lossy")]
    assert row[1] == "sparse attention (radial), density 1.00, 1.00 of all pairs attended"
    assert sparse_record(result.timings)["density"] == 1.0
    with Engine("wan-tiny", device="cpu") as engine:
        assert "sparse_attention" not in engine.generate(request).timings.features
