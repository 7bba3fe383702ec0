"""The server's PNG encoder (``paradit.serving.png``) against PIL's at the same zlib level, on a 1024² noise image
(what random weights make; nothing to compress) and a smooth one: median ms of 10 after one warm-up, and the bytes.

    python benchmarks/png_encode.py --out-dir out/png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

from paradit.serving import png


def images(side: int) -> dict[str, Image.Image]:
    noise = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    ramp = np.linspace(0, 255, side)
    smooth = ((ramp[:, None] + ramp[None]) / 2).astype(np.uint8)[..., None].repeat(3, axis=-1)
    return {"noise": Image.fromarray(noise), "smooth": Image.fromarray(smooth)}


def median_ms(encode, image: Image.Image, runs: int) -> tuple[float, int]:
    size = len(encode(image))
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        encode(image)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for name, image in images(args.side).items():
        for encoder, encode in (("paradit", png.encode_png), ("PIL", png.pil_png)):
            ms, size = median_ms(encode, image, args.runs)
            rows.append({"image": name, "encoder": encoder, "ms": ms, "bytes": size})
    env = {
        "cpus": os.cpu_count(),
        "threads": png.THREADS,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
    }
    print(f"{args.side}² RGB, zlib level {png.COMPRESS_LEVEL}, {env}")
    print(f"{'image':>7} {'encoder':>8} {'ms':>7} {'KiB':>6}")
    for row in rows:
        print(f"{row['image']:>7} {row['encoder']:>8} {row['ms']:7.1f} {row['bytes'] // 1024:6d}")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "png_encode.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
