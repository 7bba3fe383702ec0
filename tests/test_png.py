"""The server's parallel PNG encoder: every mode it writes decodes with PIL to the same pixels, whatever the band
split (one band, several, a last band shorter than the rest) and whichever way a band is written (stored, by runs,
by level 1's matches), each way chosen where it belongs; the modes it does not write go through PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from paradit.serving import png


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize("mode, channels", [("RGB", 3), ("RGBA", 4), ("L", 1)])
@pytest.mark.parametrize("height, width", [(1, 1), (7, 5), (1024, 1024), (1021, 333)])
def test_a_png_decodes_to_the_same_pixels(mode, channels, height, width):
    rng = np.random.default_rng(height * width)
    noise = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    ramp = (np.arange(height * width * channels) % 256).astype(np.uint8).reshape(height, width, channels)
    for pixels in (noise, ramp, photograph_like(rng, height, width, channels)):
        image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
        back = decoded(png.encode_png(image))
        assert back.mode == mode and back.size == (width, height)
        assert np.array_equal(np.asarray(back), np.asarray(image))


def photograph_like(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    """Smooth shading under a fine grain: Up-filtered, small residuals with few long repeats."""
    rows, columns = np.mgrid[0:height, 0:width]
    shading = 100 + 60 * np.sin(rows / 40.0)[..., None] * np.cos(columns[..., None] / 55.0 + np.arange(channels))
    return np.clip(shading + rng.normal(0, 1.5, shading.shape), 0, 255).astype(np.uint8)


def test_each_band_is_stored_run_length_deflated_or_level_1_deflated_by_what_it_holds():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 1024 * 3), dtype=np.uint8)
    gradient = np.tile(np.arange(1024 * 3) // 12 % 256, (64, 1)).astype(np.uint8)
    photograph = photograph_like(rng, 64, 1024, 3).reshape(64, -1)
    filtered = {name: np.diff(pixels, axis=0) for name, pixels in [("noise", noise), ("gradient", gradient)]}
    filtered["photograph"] = np.diff(photograph, axis=0)
    assert png.band_encoding(filtered["noise"]) == (png.STORED, png.zlib.Z_DEFAULT_STRATEGY)
    assert png.band_encoding(filtered["gradient"]) == (png.COMPRESS_LEVEL, png.zlib.Z_DEFAULT_STRATEGY)
    assert png.band_encoding(filtered["photograph"]) == (png.COMPRESS_LEVEL, png.zlib.Z_RLE)


def test_small_bands_split_an_image_across_threads(monkeypatch):
    monkeypatch.setattr(png, "MIN_BAND_BYTES", 1)
    monkeypatch.setattr(png, "THREADS", 4)
    pixels = np.random.default_rng(0).integers(0, 256, (37, 11, 3), dtype=np.uint8)
    split = []
    encode = png.encode_band

    def counted(pixels, start, stop, final):
        split.append(len(pixels[start:stop]))
        return encode(pixels, start, stop, final)

    monkeypatch.setattr(png, "encode_band", counted)
    back = decoded(png.encode_png(Image.fromarray(pixels)))
    assert sorted(split) == [7, 10, 10, 10]
    assert np.array_equal(np.asarray(back), pixels)


def test_other_modes_are_written_by_pil():
    image = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), "L").convert("P")
    back = decoded(png.encode_png(image))
    assert back.mode == "P" and np.array_equal(np.asarray(back), np.asarray(image))
