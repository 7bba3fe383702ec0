"""Output files (images, frames, H.264 MP4s) written whole, ``--out``'s paths; input images read as diffusers does."""

from __future__ import annotations

import dataclasses
import io
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from paradit.errors import InvalidRequest, ParaditError

IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}  # extension -> PIL's format
VIDEO_SUFFIX = ".mp4"
API_FORMATS = {kind.lower(): kind for kind in IMAGE_FORMATS.values()}  # the HTTP API's (OpenAI's output_format)
DEFAULT_QUALITY = 95  # JPEG and WebP: PIL's default (75) visibly blurs generated detail
# x264's constant-quality setting: 18 is visually near-lossless, and generated detail is what the user came for.
CRF = 18


def sparse_record(timings) -> dict | None:
    """The sparse attention a run's request ran with, its settings and the density it ran at (None: dense): the
    files and answers say they are lossy."""
    record = timings.features.get("sparse_attention")
    return None if record is None else dataclasses.asdict(record)


def output_paths(out: str, count: int, video: bool = False) -> list[Path]:
    """The files ``--out`` names, checked before anything runs (a video's may be a folder or image, for its frames)."""
    path = Path(out)
    is_folder = out.endswith(("/", os.sep)) or path.is_dir()
    images = ", ".join(IMAGE_FORMATS)
    if is_folder and not video:
        raise InvalidRequest(f"--out {out} is a folder; give a file name ending in {images}")
    if path.suffix.lower() == VIDEO_SUFFIX and not video:
        raise InvalidRequest(f"--out {out} names a video; this model makes images: end it in {images}")
    if not is_folder and path.suffix.lower() not in {*IMAGE_FORMATS, *([VIDEO_SUFFIX] if video else [])}:
        allowed = f"{VIDEO_SUFFIX}, {images} or a folder" if video else images
        raise InvalidRequest(f"--out {out} has no {'video' if video else 'image'} extension; end it in {allowed}")
    writable_folder("--out", out, path if is_folder else None)
    if count == 1:
        return [path]
    if is_folder:
        return [path / str(i) for i in range(count)]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(count)]


def writable_folder(flag: str, out: str | Path, folder: Path | None = None) -> Path:
    """The nearest existing one of ``folder`` (None: ``out``'s) and its parents, refused unless paradit writes there."""
    if folder is None and (str(out).endswith(("/", os.sep)) or Path(out).is_dir()):
        raise InvalidRequest(f"{flag} {out} is a folder; give a file name")
    folder = Path(out).parent if folder is None else folder
    existing = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
    try:  # a file made and removed there: permissions, read-only mounts and pseudo file systems all answer
        with tempfile.TemporaryFile(dir=existing):
            return existing
    except OSError:
        raise InvalidRequest(f"{flag} {out}: {existing} is not a folder paradit can write to") from None


@contextmanager
def replaced(path: Path, errors: tuple[type[Exception], ...] = (OSError,)) -> Iterator[Path]:
    """A name beside ``path``, renamed to it whole: a failure leaves nothing half-written (``errors``: one line)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as folder:
            yield Path(folder, path.name)
            Path(folder, path.name).replace(path)
    except errors as exc:
        raise ParaditError(f"cannot write {path}: {getattr(exc, 'strerror', None) or exc}") from None


def save_images(images: list, paths: list[Path], metadata: list[dict[str, str]]) -> None:
    """Each image in the format its extension names, a PNG with its ``metadata`` as text chunks."""
    from PIL.PngImagePlugin import PngInfo

    for path, image, text in zip(paths, images, metadata):
        info = PngInfo()
        for key, value in text.items():
            info.add_itxt(key, value)
        with replaced(path) as temporary:  # PIL takes the options of its format and ignores the others'
            image.save(temporary, format=IMAGE_FORMATS[path.suffix.lower()], pnginfo=info, quality=DEFAULT_QUALITY)


def save_videos(videos: list[list], paths: list[Path], fps: int, metadata: list[dict[str, str]]) -> list[Path]:
    """Each video as an MP4 or its frames in a folder (``x.png`` or ``x/`` -> ``x/0000.png``); returns the paths."""
    written = []
    for path, frames, text in zip(paths, videos, metadata):
        if path.suffix.lower() == VIDEO_SUFFIX:
            video = encode_mp4(frames, fps, text)  # before the file: an encoder's failure is not the disk's
            with replaced(path) as temporary:
                temporary.write_bytes(video)
        else:
            suffix = path.suffix if path.suffix.lower() in IMAGE_FORMATS else ".png"
            path = path.with_suffix("") if path.suffix.lower() in IMAGE_FORMATS else path  # the frames' folder
            save_images(frames, [path / f"{i:04d}{suffix}" for i in range(len(frames))], [text] * len(frames))
        written.append(path)
    return written


def read_image(path: str, flag: str = "--image"):
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings(action="ignore", category=Image.DecompressionBombWarning):  # PIL's raw one
            with Image.open(path) as image:  # past PIL's limit (diffusers' too) it raises from the header
                return rgb_image(image, f"{flag} {path}")
    except Image.DecompressionBombError:
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # to read the size from the header (one thread)
        try:
            with Image.open(path) as image:
                width, height = image.size
        finally:
            Image.MAX_IMAGE_PIXELS = limit
        raise InvalidRequest(
            f"{flag} {path} is {width}x{height} ({width * height:,} pixels), past the {2 * Image.MAX_IMAGE_PIXELS:,} "
            "paradit decodes (PIL's limit, as diffusers' load_image has it); give a smaller image"
        ) from None
    except (OSError, UnidentifiedImageError) as exc:
        raise InvalidRequest(f"{flag} {path} cannot be read as an image ({exc.__class__.__name__}: {exc})") from None


def rgb_image(image, name: str = "image"):
    """``image`` (PIL) as diffusers' ``load_image`` hands it on (EXIF-turned, RGB), but deep pixels scaled to 8 bits
    over the first range that holds them, where PIL's conversion clips them (a 16-bit frame turns white)."""
    import numpy as np
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        pixels = np.asarray(image, dtype=np.float32)
        ranges = {"F": (1, 255), "I": (255, 65535)}.get(image.mode, (65535,))
        top = next((top for top in ranges if pixels.min() >= 0 and pixels.max() <= top), 0)  # NaN is in none
        if not top:
            raise InvalidRequest(f"{name} has {image.mode} pixels outside 0 to {ranges[-1]}, the most paradit reads")
        image = Image.fromarray(np.round(pixels * (255 / top)).astype(np.uint8))
    # Through RGBA and LA: PIL warns on a palette's transparency dropped on the way to RGB, and cannot convert La.
    return image.convert({"P": "RGBA", "La": "LA"}.get(image.mode, image.mode)).convert("RGB")


def encode_mp4(frames: list, fps: int, metadata: dict[str, str] | None = None) -> bytes:
    """``frames``: PIL images of one size, even sides; ``metadata`` goes in the container's tags."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    # use_metadata_tags: the mp4 muxer otherwise keeps only the tags it knows (title, comment), dropping paradit's
    with av.open(buffer, mode="w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
        container.metadata.update(metadata or {})
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"  # what players expect of H.264; the sizes paradit makes are even
        stream.options = {"crf": str(CRF)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame.convert("RGB")), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()
