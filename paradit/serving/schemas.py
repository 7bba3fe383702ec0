"""The HTTP API's bodies and answers (pydantic): what FastAPI validates each request against and what the OpenAPI
schema shows. Requests refuse fields they do not know and values of the wrong JSON type; the model's own limits
(sizes, frames) are checked afterwards by the engine, which knows them.

Must not import torch.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds a server sets on what one request may ask for, tighter than the engine's own: a prompt far past what any
# text encoder reads, as many images per request as OpenAI's Images API allows, steps past any published schedule.
MAX_PROMPT_CHARS = 10_000
MAX_IMAGES = 10
MAX_STEPS = 500
SEED_LIMIT = 2**64
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
SIZE_PATTERN = r"^(auto|\d{1,5}x\d{1,5})$"


class Body(BaseModel):
    """A request body: unknown fields and values of the wrong JSON type ("2" for 2) are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def width_height(self) -> tuple[int | None, int | None]:
        """``size`` as (width, height); the model's default for ``auto``."""
        match = SIZE.match(self.size)
        return (int(match[1]), int(match[2])) if match else (None, None)


class ImageGenerationBody(Body):
    """OpenAI's Images API (``images.generate``), with paradit's ``negative_prompt``, ``steps``, ``guidance`` and
    ``seed``. All ``n`` images come from one seed, as a batch of ``n`` from ``paradit generate`` does."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(None, description="the served model's name; other models are refused")
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str = Field("auto", pattern=SIZE_PATTERN, description='"WIDTHxHEIGHT" in pixels, or "auto"')
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg and webp: quality, 100 the best")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="drawn at random when absent; answered back")


class VideoBody(Body):
    """A text-to-video job. ``frames`` and ``fps`` default to the model's."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(None, description="the served model's name; other models are refused")
    size: str = Field("auto", pattern=SIZE_PATTERN, description='"WIDTHxHEIGHT" in pixels, or "auto"')
    frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1)
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=0, allow_inf_nan=False)
    guidance_2: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    seed: int
    plan: str = Field(description="the parallel plan of the group that made the images")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class VideoJob(BaseModel):
    """A video job as ``GET /v1/videos/{id}`` shows it; ``progress`` is the share of denoise steps done, in percent."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    steps_done: int
    steps: int
    created_at: int
    completed_at: int | None = None
    size: str
    frames: int
    seed: int
    error: ErrorInfo | None = None


class DeletedVideo(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True
    status: str = Field(description="the job's last status: cancelled if DELETE stopped it")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "paradit"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GroupHealth(BaseModel):
    index: int
    state: Literal["starting", "serving", "restarting", "stopped"]
    plan: str
    workers: list[int] = Field(description="process ids of the group's workers")
    restarts: int


class Health(BaseModel):
    status: Literal["ok", "starting", "degraded", "draining"]
    queue: int
    groups: list[GroupHealth]
