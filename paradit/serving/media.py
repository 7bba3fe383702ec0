"""Image files made from what the workers return, in the formats of ``paradit.outputs``. Called from the front end's
thread pool, never from a group's thread, so that encoding overlaps the next batch. Must not import torch."""

from __future__ import annotations

import io

from PIL import Image

from paradit.outputs import API_FORMATS, DEFAULT_QUALITY

MEDIA_TYPES = {**{name: f"image/{name}" for name in API_FORMATS}, "mp4": "video/mp4"}
# zlib's fastest level: a 1024x1024 image encodes in about a quarter of the default level's time (60 ms against 250
# on one core) for a sixth more bytes, and the encoding is part of every answer's latency.
PNG_COMPRESS_LEVEL = 1


def encode_image(image: Image.Image, output_format: str, quality: int | None = None) -> bytes:
    """``output_format``: png (lossless), jpeg or webp at ``quality`` (0-100, default 95)."""
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    else:
        image.save(buffer, format=API_FORMATS[output_format], quality=DEFAULT_QUALITY if quality is None else quality)
    return buffer.getvalue()
