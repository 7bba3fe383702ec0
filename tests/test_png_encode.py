"""An image answer's way from float pixels to the response bytes: the PNG stores the bands that do not deflate to half
and deflates the rest, every one decoding with PIL to the same pixels; the stream's adler32 combined from its bands'
equals zlib's of the whole; the 8-bit pixels equal the rounding they always were, ``pixels`` untouched; the JSON
spliced around the base64 is pydantic's byte for byte; and over HTTP the OpenAI client reads PNG, JPEG and WebP."""

from __future__ import annotations

import base64
import io
import zlib

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from paradit.request import GenerationResult, Timings, rgb8_of
from paradit.serving import png, schemas
from tests.test_serving_scheduler import http_server, scheduler


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def smooth(height: int, width: int) -> np.ndarray:
    ramp = np.add.outer(np.arange(height), np.arange(width)) % 256
    return np.repeat(ramp[..., None], 3, axis=-1).astype(np.uint8)


def test_noise_is_stored_and_a_gradient_deflated_each_decoding_to_its_pixels():
    noise = np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    for pixels, at_most in ((noise, 1.01), (smooth(300, 200), 0.1)):
        data = png.encode_png(Image.fromarray(pixels))
        assert len(data) <= at_most * pixels.nbytes
        assert np.array_equal(np.asarray(decoded(data)), pixels)


def test_each_band_chooses_for_itself_and_the_stream_joins_across_chunks(monkeypatch):
    monkeypatch.setattr(png, "MIN_BAND_BYTES", 1)
    monkeypatch.setattr(png, "THREADS", 4)
    monkeypatch.setattr(png, "SAMPLE_BYTES", 3 * 193)  # a band's first three rows (of 64 pixels) decide
    pixels = smooth(40, 64)
    pixels[10:20] = np.random.default_rng(1).integers(0, 256, (10, 64, 3), dtype=np.uint8)  # the second band
    chosen = []
    band_encoding = png.band_encoding
    monkeypatch.setattr(png, "band_encoding", lambda sample: chosen.append(band_encoding(sample)) or chosen[-1])
    data = png.encode_png(Image.fromarray(pixels))
    assert sorted(level for level, _ in chosen) == [
        png.STORED,
        png.COMPRESS_LEVEL,
        png.COMPRESS_LEVEL,
        png.COMPRESS_LEVEL,
    ]
    assert data.count(b"IDAT") == 5  # four bands and the trailer
    assert np.array_equal(np.asarray(decoded(data)), pixels)


@pytest.mark.parametrize("split", [0, 1, 70_000, 200_000])
def test_adler32_combined_from_two_parts_is_zlibs_of_both(split):
    data = np.random.default_rng(split).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    first, second = data[:split], data[split:]
    assert png.adler32_combine(zlib.adler32(first), zlib.adler32(second), len(second)) == zlib.adler32(data)


@pytest.mark.parametrize("shape", [(1, 3, 1, 1), (2, 3, 5, 7), (1, 2, 3, 4, 6)])
def test_8_bit_pixels_are_the_rounding_they_were_and_leave_the_result_untouched(shape):
    pixels = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    kept = pixels.clone()
    frames = pixels.flatten(0, 1) if pixels.ndim == 5 else pixels
    expected = (frames.permute(0, 2, 3, 1) * 255).round().byte().numpy()
    images = GenerationResult(pixels=pixels, seed=0, timings=Timings()).images
    assert np.array_equal(np.stack([np.asarray(image) for image in images]), expected)
    assert torch.equal(pixels, kept)
    if pixels.ndim == 4:  # an image's 8-bit pixels as a GPU run rounds them where they were decoded
        rounded = GenerationResult(pixels=pixels, seed=0, timings=Timings(), rgb8=rgb8_of(pixels)).images
        assert np.array_equal(np.stack([np.asarray(image) for image in rounded]), expected)


@pytest.mark.parametrize("files", [[], [b"ab"], [b"x" * 7, bytes(range(256))]])
def test_the_spliced_json_is_pydantics_byte_for_byte(files):
    answer = schemas.ImagesResponse(created=5, data=[], output_format="png", size="1x1", seed=3, plan='cfg "data":[] 2')
    items = [schemas.ImageData(b64_json=base64.b64encode(file).decode()) for file in files]
    whole = answer.model_copy(update={"data": items}).model_dump_json().encode()
    assert schemas.images_json(answer, files) == whole


@pytest.mark.parametrize("output_format, kind", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_the_openai_client_reads_each_format_from_the_server(output_format, kind):
    with scheduler() as (scheduling, _, _), http_server(scheduling) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answer = client.images.generate(
            prompt="a fox", size="32x32", n=2, output_format=output_format, extra_body={"steps": 1}
        )
    assert answer.output_format == output_format and answer.size == "32x32" and len(answer.data) == 2
    for item in answer.data:
        image = decoded(base64.b64decode(item.b64_json))
        assert image.format == kind and image.size == (16, 16)  # the stand-in engine's black 16x16
        assert np.asarray(image.convert("RGB")).max() <= (0 if kind == "PNG" else 8)
