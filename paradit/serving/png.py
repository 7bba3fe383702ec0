"""The server's PNG encoder. PIL's is one thread and deflates every byte: a 1024x1024 noise-like image (what random
weights make) costs it ~200 ms at zlib level 1 and shrinks by nothing. Here row bands are encoded in parallel threads,
each as an IDAT chunk of its own (PNG lets the zlib stream split across chunks at any byte), and each band deflates a
sample of its rows first: a band that does not shrink to half (noise, grain) is stored, a copy (~1 ms for the whole
image); one that does is deflated, by runs where it is photographic, by level 1's matches where it is flat. The bands
join into one zlib stream as pigz does: each band but the last ends on a sync flush."""

from __future__ import annotations

import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, the fastest level's flag
COLOR_TYPES = {"L": 0, "RGB": 2, "RGBA": 6}  # PIL mode -> PNG colour type, 8 bits a channel
UP_FILTER = 2  # each byte minus the byte above it: cheap in numpy, and it shrinks smooth images several times over
# Bands smaller than this cost more in thread hand-offs and flush markers than their deflate takes.
MIN_BAND_BYTES = 256 * 1024
THREADS = min(8, os.cpu_count() or 1)
COMPRESS_LEVEL = 1  # zlib's fastest: a sixth more bytes than the default level, a quarter of its time
STORED = 0  # zlib's level 0: stored blocks, the bytes copied
SAMPLE_BYTES = 16 * 1024  # of a band's filtered rows, deflated to decide its encoding: ~1 ms at level 1 on noise
# Up-filtered photographs and renders are small residuals with few long repeats: zlib's run-length strategy (matches
# at distance 1 only) deflates them in about two thirds of level 1's time, and smaller (a 1024² photograph: 28 ms for
# 58.5% against 41 ms for 59.0%, one core). Flat content (gradients, graphics, text) keeps level 1's hash search, whose
# long matches are both faster and several times smaller there (a gradient: 4 ms for 1.3% against 9 ms for 5.8%).
FLAT_RATIO = 0.25  # a band whose sample level 1 shrinks below this share is flat
# A band whose sample deflates by runs to more than this share of its bytes is stored. Run-length deflate costs
# textured rows ~8 ns a byte on one core (~1 a byte of the image on 8), and each byte it removes saves ~13 ns
# downstream at 1 Gbit/s (~11 for its 4/3 bytes of base64 on the wire, ~2 to base64, splice and decode them) but only
# those ~2 on the loopback: deflate pays below ~0.9 across a network and ~0.5 beside the client. Half keeps the
# loopback's latency, the one an answer's speed is measured by.
STORE_RATIO = 0.5
ADLER_BASE = 65521  # the largest prime below 2**16, adler32's modulus

_pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="paradit-png")


def encode_png(image: Image.Image, text: dict[str, str] | None = None) -> bytes:
    """``image`` as a PNG (8-bit L, RGB or RGBA; other modes go to PIL's own encoder), ``text`` as iTXt chunks."""
    text = text or {}
    if image.mode not in COLOR_TYPES:
        return pil_png(image, text)
    pixels = np.asarray(image).reshape(image.height, -1)
    band_rows = max(1, -(-MIN_BAND_BYTES // pixels.shape[1]), -(-image.height // THREADS))
    starts = range(0, image.height, band_rows)
    last = len(starts) - 1
    if last == 0:  # a small image: a thread hand-off would cost more than its deflate
        bands = [encode_band(pixels, 0, image.height, final=True)]
    else:
        bands = list(
            _pool.map(lambda start: encode_band(pixels, start, start + band_rows, final=start == starts[-1]), starts)
        )
    checksum = 1  # adler32 of nothing
    for _, band_checksum, length in bands:
        checksum = adler32_combine(checksum, band_checksum, length)
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, COLOR_TYPES[image.mode], 0, 0, 0)
    texts = [part for key, value in text.items() for part in chunk(b"iTXt", international_text(key, value))]
    return b"".join(
        [
            PNG_SIGNATURE,
            *chunk(b"IHDR", header),
            *texts,
            *(part for parts, _, _ in bands for part in parts),
            *chunk(b"IDAT", struct.pack(">I", checksum)),  # the zlib stream's trailer, a chunk of its own
            *chunk(b"IEND"),
        ]
    )


def international_text(key: str, value: str) -> bytes:
    """An uncompressed iTXt chunk's data, as PIL's ``PngInfo.add_itxt`` writes it: keyword, flags, no language."""
    return key.encode("latin-1") + b"\0\0\0\0\0" + value.encode("utf-8")


def encode_band(pixels: np.ndarray, start: int, stop: int, final: bool) -> tuple[list[bytes], int, int]:
    """Rows ``start:stop`` Up-filtered and deflated (or stored) as one IDAT chunk (the first opens the zlib stream);
    with the adler32 and the length of the filtered bytes, which the stream's trailer sums."""
    band = pixels[start:stop]
    rows = np.empty((len(band), band.shape[1] + 1), dtype=np.uint8)
    rows[:, 0] = UP_FILTER
    if start == 0:
        rows[0, 1:] = band[0]
    else:
        np.subtract(band[0], pixels[start - 1], out=rows[0, 1:])
    np.subtract(band[1:], band[:-1], out=rows[1:, 1:])
    level, strategy = band_encoding(rows[: -(-SAMPLE_BYTES // rows.shape[1])])
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS, 8, strategy)
    deflated = [compressor.compress(rows), compressor.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)]
    opening = [ZLIB_HEADER] if start == 0 else []
    return chunk(b"IDAT", *opening, *deflated), zlib.adler32(rows), rows.nbytes


def band_encoding(sample: np.ndarray) -> tuple[int, int]:
    """The (zlib level, strategy) for a band whose filtered rows begin with ``sample``: level 1 where the sample is
    flat, else stored where run-length deflate does not shrink it to ``STORE_RATIO``, else run-length deflate."""
    if deflated_size(sample, zlib.Z_DEFAULT_STRATEGY) < FLAT_RATIO * sample.nbytes:
        return COMPRESS_LEVEL, zlib.Z_DEFAULT_STRATEGY
    if deflated_size(sample, zlib.Z_RLE) > STORE_RATIO * sample.nbytes:
        return STORED, zlib.Z_DEFAULT_STRATEGY
    return COMPRESS_LEVEL, zlib.Z_RLE


def deflated_size(data: np.ndarray, strategy: int) -> int:
    compressor = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS, 8, strategy)
    return len(compressor.compress(data)) + len(compressor.flush())


def adler32_combine(first: int, second: int, second_length: int) -> int:
    """The adler32 of two byte strings joined, from each one's (zlib has this, but Python's zlib does not expose it):
    the byte sum adds, less the 1 each started from; the sum of sums adds, plus the first's byte sum once for every
    byte of the second."""
    first_sum, second_sum = first & 0xFFFF, second & 0xFFFF
    byte_sum = (first_sum + second_sum - 1) % ADLER_BASE
    sums = ((first >> 16) + (second >> 16) + second_length * (first_sum - 1)) % ADLER_BASE
    return byte_sum | sums << 16


def chunk(kind: bytes, *data: bytes) -> list[bytes]:
    """A PNG chunk as the parts to join: its ``data`` given in parts, so that a band is copied once, by the join."""
    checksum = zlib.crc32(kind)
    for part in data:
        checksum = zlib.crc32(part, checksum)
    return [struct.pack(">I", sum(map(len, data))), kind, *data, struct.pack(">I", checksum)]


def pil_png(image: Image.Image, text: dict[str, str] | None = None) -> bytes:
    info = PngInfo()
    for key, value in (text or {}).items():
        info.add_itxt(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=COMPRESS_LEVEL, pnginfo=info)
    return buffer.getvalue()
