"""Output files: the image formats paradit writes, ``--out``'s paths, images and videos written to them, and MP4s
(H.264 through PyAV, FFmpeg's libx264). The command line writes with these; the server encodes to the same formats
(``serving.media``) under their API names, and its videos with ``encode_mp4``.

Must not import torch.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

from paradit.errors import InvalidRequest

IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}  # extension -> PIL's format
VIDEO_SUFFIX = ".mp4"
# The HTTP API's names for them (OpenAI's ``output_format``): PIL's, lower-cased.
API_FORMATS = {kind.lower(): kind for kind in IMAGE_FORMATS.values()}
DEFAULT_QUALITY = 95  # JPEG and WebP: PIL's default (75) visibly blurs generated detail
# x264's constant-quality setting: 18 is visually near-lossless, and generated detail is what the user came for.
CRF = 18


def output_paths(out: str, count: int, video: bool = False) -> list[Path]:
    """The files ``--out`` names, checked before anything runs: a known image extension (or for a video, .mp4, an
    image extension or a folder, which hold its frames), a writable folder."""
    path = Path(out)
    is_folder = out.endswith(("/", os.sep)) or path.is_dir()
    if is_folder and not video:
        raise InvalidRequest(f"--out {out} is a folder; give a file name ending in {', '.join(IMAGE_FORMATS)}")
    if path.suffix.lower() == VIDEO_SUFFIX and not video:
        allowed = ", ".join(IMAGE_FORMATS)
        raise InvalidRequest(f"--out {out} names a video; this model makes images: end it in {allowed}")
    if not is_folder and path.suffix.lower() not in {*IMAGE_FORMATS, *([VIDEO_SUFFIX] if video else [])}:
        allowed = ", ".join([VIDEO_SUFFIX, *IMAGE_FORMATS]) + " or a folder" if video else ", ".join(IMAGE_FORMATS)
        raise InvalidRequest(f"--out {out} has no {'video' if video else 'image'} extension; end it in {allowed}")
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    try:  # a file made and removed there: permissions, read-only mounts and pseudo file systems all answer
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        raise InvalidRequest(f"--out {out}: {folder} is not a folder paradit can write to") from None
    if count == 1:
        return [path]
    if is_folder:
        return [path / str(i) for i in range(count)]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(count)]


def save_images(images: list, paths: list[Path], metadata: dict[str, str]) -> None:
    """Each image in the format its extension names; PNGs carry ``metadata`` as text chunks."""
    from PIL.PngImagePlugin import PngInfo

    for path, image in zip(paths, images):
        path.parent.mkdir(parents=True, exist_ok=True)
        kind = IMAGE_FORMATS[path.suffix.lower()]
        if kind == "PNG":
            info = PngInfo()
            for key, value in metadata.items():
                info.add_itxt(key, value)
            image.save(path, format=kind, pnginfo=info)
        else:
            image.save(path, format=kind, quality=DEFAULT_QUALITY)


def save_videos(videos: list[list], paths: list[Path], fps: int, metadata: dict[str, str]) -> list[Path]:
    """Each video as an MP4, or its frames into a folder (``x.png`` -> ``x/0000.png``, ``x/`` -> ``x/0000.png``);
    returns what was written."""
    written = []
    for path, frames in zip(paths, videos):
        if path.suffix.lower() == VIDEO_SUFFIX:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode_mp4(frames, fps, metadata))
            written.append(path)
            continue
        suffix = path.suffix if path.suffix.lower() in IMAGE_FORMATS else ".png"
        folder = path.with_suffix("") if path.suffix.lower() in IMAGE_FORMATS else path
        save_images(frames, [folder / f"{i:04d}{suffix}" for i in range(len(frames))], metadata)
        written.append(folder)
    return written


def read_image(path: str):
    """``--image``'s picture, refused with the reason when it cannot be read as one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise InvalidRequest(f"--image {path} cannot be read as an image ({exc.__class__.__name__}: {exc})") from None


def encode_mp4(frames: list, fps: int, metadata: dict[str, str] | None = None) -> bytes:
    """The MP4 bytes of ``frames`` (PIL, all one size, even sides) at ``fps``; ``metadata`` goes into the container's
    tags (readable with ffprobe)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        for key, value in (metadata or {}).items():
            container.metadata[key] = value
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"  # what players expect of H.264; the sizes paradit makes are even
        stream.options = {"crf": str(CRF)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame.convert("RGB")), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()
