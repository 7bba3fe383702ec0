"""The server's PNG encoder (``paradit.serving.png``) against PIL's at the same zlib level, and against itself with
every band deflated (``--variants``' ``deflate-all``, what it did before it sampled) and with every deflated band at
level 1 (``level-1``, before it chose run-length deflate for photographic bands), on 1024² images: noise (what random
weights make; nothing to compress), a smooth gradient, a textured one (a gradient with a little noise) and a
photograph-like one (smooth shapes, edges and a fine grain); then each stage from a result's float pixels to the
JSON bytes of an Images API answer, before and now. Median ms of ``--runs`` after one warm-up, and the bytes; every
PNG checked to decode to its pixels.

    python benchmarks/png_encode.py --out-dir out/png
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image
from pydantic import TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paradit.request import GenerationResult, Timings  # noqa: E402
from paradit.serving import png, schemas  # noqa: E402


def images(side: int) -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    ramp = np.linspace(0, 255, side)
    gradient = ((ramp[:, None] + ramp[None]) / 2)[..., None].repeat(3, axis=-1)
    textured = np.clip(gradient + rng.normal(0, 3, gradient.shape), 0, 255)
    coarse = torch.from_numpy(rng.normal(size=(1, 3, side // 32, side // 32)))
    field = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bicubic")[0].permute(1, 2, 0).numpy()
    rows, columns = np.mgrid[0:side, 0:side]
    discs = sum(
        40.0 * ((rows - y) ** 2 + (columns - x) ** 2 < radius**2)
        for y, x, radius in rng.uniform(0, side, (6, 3)) * [1, 1, 0.2]
    )
    photograph = np.clip(125 + 40 * field + discs[..., None] + rng.normal(0, 1.5, field.shape), 0, 255)
    return {
        name: Image.fromarray(pixels.astype(np.uint8))
        for name, pixels in (
            ("noise", noise),
            ("smooth", gradient),
            ("textured", textured),
            ("photograph-like", photograph),
        )
    }


def every_band_deflated(image: Image.Image) -> bytes:
    """The encoder with no band stored: its samples still taken, so this is an upper bound on the old encoder."""
    kept, png.STORE_RATIO = png.STORE_RATIO, math.inf
    try:
        return png.encode_png(image)
    finally:
        png.STORE_RATIO = kept


def level_one_only(image: Image.Image) -> bytes:
    """The encoder as it was before it chose zlib's run-length strategy: every deflated band at level 1."""
    kept = png.band_encoding

    def level_one(sample):
        level, _ = kept(sample)
        return level, png.zlib.Z_DEFAULT_STRATEGY

    png.band_encoding = level_one
    try:
        return png.encode_png(image)
    finally:
        png.band_encoding = kept


ENCODERS = {
    "paradit": png.encode_png,
    "level-1": level_one_only,
    "deflate-all": every_band_deflated,
    "PIL": png.pil_png,
}


def median_ms(run, runs: int) -> tuple[float, object]:
    made = run()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times), made


def encoder_rows(side: int, runs: int, variants: list[str]) -> list[dict]:
    rows = []
    for name, image in images(side).items():
        for encoder in variants:
            ms, data = median_ms(lambda encode=ENCODERS[encoder], image=image: encode(image), runs)
            back = Image.open(io.BytesIO(data))
            if not np.array_equal(np.asarray(back), np.asarray(image)):
                raise SystemExit(f"{encoder}'s PNG of the {name} image does not decode to its pixels")
            rows.append({"image": name, "encoder": encoder, "ms": ms, "bytes": len(data)})
    return rows


def stage_rows(side: int, runs: int) -> list[dict]:
    """A noise image's way from the float pixels a worker returns to the answer's bytes, before and now."""
    pixels = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(0))
    result = GenerationResult(pixels=pixels, seed=0, timings=Timings())
    answer = schemas.ImagesResponse(created=0, data=[], output_format="png", size=f"{side}x{side}", seed=0, plan="")
    file = png.encode_png(result.images[0])
    adapter = TypeAdapter(schemas.ImagesResponse)

    def strided_uint8() -> Image.Image:
        return Image.fromarray((pixels.permute(0, 2, 3, 1) * 255).round().byte().numpy()[0])

    def pydantic_json() -> bytes:  # FastAPI's path for a returned model: validated again, then written
        data = [schemas.ImageData(b64_json=base64.b64encode(file).decode())]
        return adapter.dump_json(adapter.validate_python(answer.model_copy(update={"data": data})))

    stages = [
        ("pixels to PIL", "before: uint8 strided", strided_uint8),
        ("pixels to PIL", "now: channels last in float", lambda: result.images[0]),
        ("base64 and JSON", "before: pydantic", pydantic_json),
        ("base64 and JSON", "now: spliced", lambda: schemas.images_json(answer, [file])),
    ]
    if json.loads(pydantic_json()) != json.loads(schemas.images_json(answer, [file])):
        raise SystemExit("the spliced JSON differs from pydantic's")
    rows = []
    for stage, variant, run in stages:
        ms, made = median_ms(run, runs)
        rows.append({"stage": stage, "variant": variant, "ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--variants", nargs="+", choices=list(ENCODERS), default=list(ENCODERS))
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    encoders = encoder_rows(args.side, args.runs, args.variants)
    stages = stage_rows(args.side, args.runs)
    env = {
        "cpus": os.cpu_count(),
        "threads": png.THREADS,
        "torch_threads": torch.get_num_threads(),
        "pillow": PIL.__version__,
        "python": platform.python_version(),
    }
    print(f"{args.side}² RGB, zlib level {png.COMPRESS_LEVEL}, {env}")
    print(f"{'image':>8} {'encoder':>11} {'ms':>7} {'KiB':>6}")
    for row in encoders:
        print(f"{row['image']:>8} {row['encoder']:>11} {row['ms']:7.1f} {row['bytes'] // 1024:6d}")
    print(f"\n{'stage':>15} {'variant':>28} {'ms':>7}")
    for row in stages:
        print(f"{row['stage']:>15} {row['variant']:>28} {row['ms']:7.1f}")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"env": env, "encoders": encoders, "stages": stages}
        (args.out_dir / "png_encode.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
