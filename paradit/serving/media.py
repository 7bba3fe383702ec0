"""Image files from what the workers return, encoded in the front end's thread pool, never in a group's thread."""

from __future__ import annotations

import io
import json

from PIL import Image

from paradit.errors import InvalidRequest
from paradit.outputs import API_FORMATS, DEFAULT_QUALITY, rgb_image
from paradit.serving.png import encode_png

MAX_INPUT_PIXELS = 40_000_000  # pixels of one input image: past a 7680x4320 photo, decoding it costs more than it gives
MEDIA_TYPES = {**{name: f"image/{name}" for name in API_FORMATS}, "mp4": "video/mp4"}


def file_metadata(sparse: dict | None) -> dict[str, str]:
    """A PNG's text chunks, an MP4's tags."""
    return {} if sparse is None else {"sparse_attention": json.dumps(sparse)}


def encode_image(
    image: Image.Image, output_format: str, quality: int | None = None, metadata: dict[str, str] | None = None
) -> bytes:
    """``metadata``: a PNG's text chunks (JPEG and WebP carry none)."""
    if output_format == "png":
        return encode_png(image, metadata or {})
    buffer = io.BytesIO()
    image.save(buffer, format=API_FORMATS[output_format], quality=DEFAULT_QUALITY if quality is None else quality)
    return buffer.getvalue()


def decode_input(data: bytes, name: str, param: str = "image") -> Image.Image:
    """An uploaded image, its size read before its pixels: one past ``MAX_INPUT_PIXELS`` costs nothing to refuse."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_INPUT_PIXELS:
                raise InvalidRequest(
                    f"{name} is {image.width}x{image.height}, past this server's {MAX_INPUT_PIXELS} pixels an input "
                    "image",
                    param=param,
                )
            return rgb_image(image, name)
    except (OSError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{name} cannot be read as an image ({exc.__class__.__name__})", param=param) from None
