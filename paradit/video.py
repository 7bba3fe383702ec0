"""Video files: a video's frames encoded as H.264 in an MP4 container through PyAV (FFmpeg's libx264)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

# x264's constant-quality setting: 18 is visually near-lossless, and generated detail is what the user came for.
CRF = 18


def encode_mp4(frames: list[Image.Image], fps: int, metadata: dict[str, str] | None = None) -> bytes:
    """The MP4 bytes of ``frames`` (PIL, all one size, even sides) at ``fps``; ``metadata`` goes into the container's
    tags (readable with ffprobe)."""
    import av

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


def write_mp4(frames: list[Image.Image], path: Path, fps: int, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_mp4(frames, fps, metadata))

