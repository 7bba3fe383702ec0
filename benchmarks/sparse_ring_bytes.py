"""The K/V bytes a Ring rank sends per video self-attention under radial's mask: today's whole blocks, against
sending each rank only the key tiles that some query tile of that rank keeps (the least any schedule can send).
CPU only: the mask decides it. ``--tiny``: the tests' grid."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradit.layers.sparse_masks import TILE, radial_block_mask, tiles
from paradit.parallel.sequence import aligned_split_sizes

# (name, latent grid (frames, rows, columns), heads, head dim): Wan 2.2 A14B's 40 heads of 128.
GRIDS = [("Wan 2.2 A14B 1280x720x81", (21, 45, 80), 40, 128), ("Wan 2.2 A14B 832x480x81", (21, 30, 52), 40, 128)]
TINY = [("tiny", (9, 4, 8), 3, 12)]


def ring_bytes(grid: tuple[int, int, int], ring: int, heads: int, dim: int, element: int = 2) -> tuple[int, int]:
    """(whole blocks, only the kept tiles): bytes of K and V every rank receives, summed over the ring."""
    mask = radial_block_mask(grid)
    length = grid[0] * grid[1] * grid[2]
    sizes = aligned_split_sizes(length, ring, TILE)
    starts = [sum(sizes[:rank]) for rank in range(ring)]
    spans = [(start // TILE, tiles(start + size) - start // TILE) for start, size in zip(starts, sizes)]
    per_token = 2 * heads * dim * element  # K and V
    whole = needed = 0
    for receiver, (rows, row_count) in enumerate(spans):
        for source, (columns, column_count) in enumerate(spans):
            if source == receiver:
                continue
            kept = mask[rows : rows + row_count, columns : columns + column_count].any(dim=0)
            whole += sizes[source] * per_token
            needed += int(kept.sum()) * TILE * per_token  # a kept partial last tile counted whole: an upper bound
    return whole, min(needed, whole)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out-dir", default="out/benchmarks")
    args = parser.parse_args(argv)
    rows = []
    for name, grid, heads, dim in TINY if args.tiny else GRIDS:
        for ring in args.rings:
            whole, needed = ring_bytes(grid, ring, heads, dim)
            rows.append({"model": name, "ring": ring, "whole_mib": whole / 2**20, "kept_tiles_mib": needed / 2**20})
    print(f"{'model':<28} {'ring':>4} {'whole blocks MiB':>17} {'kept tiles MiB':>15}")
    for row in rows:
        print(f"{row['model']:<28} {row['ring']:>4} {row['whole_mib']:>17.1f} {row['kept_tiles_mib']:>15.1f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_ring_bytes.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
