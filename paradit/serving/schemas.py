"""The HTTP API's bodies (no unknown fields, no "2" for 2) and answers; the engine checks the model's own limits."""

from __future__ import annotations

import base64
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from paradit.cache_options import kept_curve
from paradit.errors import InvalidRequest
from paradit.flags import GENERATE, flagged_fields
from paradit.outputs import API_FORMATS
from paradit.request import (
    CACHE_METHODS,
    CACHE_PARAMETERS,
    MAX_PROMPT_CHARS,
    SERVED_MAX_STEPS,
    SPARSE_ATTENTIONS,
    GenerationRequest,
    SparseAttentionConfig,
    StepCacheConfig,
)

MAX_IMAGES = 10  # per request, as OpenAI's Images API allows
MAX_INPUT_IMAGES = 10  # input images one edit may send (as FLUX.2 takes them)
SIZE_PATTERN = r"^(auto|\d{1,5}x\d{1,5})$"
MAX_CLUSTERS = 4096  # SVG2's k-means clusters a request may ask for: four times its paper's 1000 key clusters


class LoraChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=200)
    scale: float = Field(1.0, allow_inf_nan=False)


class CacheChoice(BaseModel):
    """A request's step cache, by diffusers' names (``StepCacheConfig``); MagCache's curve is never calibrated here."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal[*CACHE_METHODS]
    threshold: float | None = Field(None, ge=0, allow_inf_nan=False)
    cache_interval: int = Field(5, ge=1)
    disable_cache_before_step: int = Field(3, ge=0)
    disable_cache_after_step: int | None = Field(None, ge=0)
    max_order: int = Field(1, ge=0, le=8)
    max_skip_steps: int = Field(3, ge=0)
    retention_ratio: float = Field(0.2, ge=0, le=1)
    mag_ratios: list[float] | None = Field(None, min_length=1, max_length=SERVED_MAX_STEPS)

    def config(self, served: str) -> StepCacheConfig:
        """MagCache without its curve takes the one kept for the ``served`` model here, as ``generate`` does."""
        stray = sorted(self.model_fields_set - {"method", *CACHE_PARAMETERS[self.method]})
        if stray:
            raise InvalidRequest(
                f"cache: {stray[0]} is not a parameter of {self.method}, which reads "
                f"{', '.join(CACHE_PARAMETERS[self.method])}",
                param="cache",
            )
        ratios = self.mag_ratios
        if self.method == "mag" and ratios is None and (ratios := kept_curve(served)) is None:
            raise InvalidRequest(
                f"cache: mag needs mag_ratios (positive numbers, one a step); none were calibrated for {served} on "
                "this server's machine",
                param="cache",
            )
        return StepCacheConfig(**{**self.model_dump(), "mag_ratios": None if ratios is None else tuple(ratios)})


class SparseChoice(BaseModel):
    """A request's sparse attention, by the names of the run's ``--sparse-*`` options (``SparseAttentionConfig``);
    a parameter its method does not read is refused when the request is resolved."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal[*SPARSE_ATTENTIONS]
    dense_steps: int | None = Field(None, ge=0, le=SERVED_MAX_STEPS)
    dense_blocks: int | None = Field(None, ge=0)
    decay_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    query_clusters: int | None = Field(None, ge=1, le=MAX_CLUSTERS)
    key_clusters: int | None = Field(None, ge=1, le=MAX_CLUSTERS)
    top_p: float | None = Field(None, gt=0, le=1)

    def config(self) -> SparseAttentionConfig:
        return SparseAttentionConfig(**self.model_dump())


def declared(route: str, beyond=()) -> dict[str, tuple[Any, Any]]:
    """The request fields ``route``'s body takes but ``beyond`` does not, as their flags declare them."""
    return {
        flag.remote: (flag.http[0], Field(None, **flag.http[1]))
        for _, flag in flagged_fields(GenerationRequest, GENERATE)
        if flag.http is not None and route in flag.routes and flag.remote not in beyond
    }


class Request(BaseModel):
    """What every body takes beside its declared request fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(None, description="the served model's name; other models are refused")
    size: str = Field("auto", pattern=SIZE_PATTERN, description='"WIDTHxHEIGHT" in pixels, or "auto"')
    lora: list[LoraChoice] | None = Field(None, max_length=16, description="the server's adapters to apply")
    cache: CacheChoice | None = Field(None, description="step caching for this request")
    sparse_attention: SparseChoice | None = Field(
        None, description="LOSSY: a video's block-sparse self-attention for this request (default: the server's)"
    )

    def request(self, served: str, **fields) -> GenerationRequest:
        width, height = (None, None) if self.size == "auto" else map(int, self.size.split("x"))
        declared = {
            each.name: getattr(self, flag.remote)
            for each, flag in flagged_fields(GenerationRequest, GENERATE)
            if flag.remote in type(self).model_fields
        }
        return GenerationRequest(
            prompt=self.prompt,
            height=height,
            width=width,
            lora=None if self.lora is None else tuple((choice.name, choice.scale) for choice in self.lora),
            cache=None if self.cache is None else self.cache.config(served),
            sparse_attention=None if self.sparse_attention is None else self.sparse_attention.config(),
            **declared,
            **fields,
        )


Body = create_model("Body", __base__=Request, __doc__="The fields every API takes.", **declared("images"))


class ImageGenerationBody(Body):
    """OpenAI's ``images.generate``, with paradit's request fields. The ``n`` images come from one seed, as a batch."""

    n: int = Field(1, ge=1, le=MAX_IMAGES)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal[*API_FORMATS] = "png"
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg and webp: quality, 100 the best")


class EditForm(ImageGenerationBody):
    """OpenAI's ``images.edit``: multipart form fields, all text, numbers read from it ("3" for 3) as OpenAI does."""

    model_config = ConfigDict(extra="forbid", strict=False)


ImageEditBody = create_model("ImageEditBody", __base__=EditForm, **declared("edits", Body.model_fields))


def takes_json(annotation) -> bool:
    """Whether a field of this type is an object or a list, spelled as JSON in a form."""
    if typing.get_origin(annotation) is Literal:
        return False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(takes_json(each) for each in typing.get_args(annotation))
    return annotation not in (str, int, float, bool, type(None))


JSON_FORM_FIELDS = frozenset(name for name, field in ImageEditBody.model_fields.items() if takes_json(field.annotation))
VideoBody = create_model(
    "VideoBody",
    __base__=Body,
    __doc__="A text-to-video job. ``frames`` and ``fps`` default to the model's.",
    **declared("videos", Body.model_fields),
)


SPARSE_RECORD = "LOSSY: the sparse attention it ran with, its settings and the density it ran at (null: dense)"


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
    sparse_attention: dict | None = Field(None, description=SPARSE_RECORD)


# One b64_json item's JSON around its payload, and the answer's around its items, as pydantic writes them.
B64_ITEM_OPEN, _, B64_ITEM_CLOSE = ImageData(b64_json="").model_dump_json().encode().partition(b'""')


def images_json(answer: ImagesResponse, files: list[bytes]) -> bytes:
    """``answer`` (its ``data`` empty) as the JSON pydantic would write, with each of ``files`` as a ``b64_json`` item.
    Base64 needs no JSON escapes, so its bytes are spliced in as they are: pydantic would copy a few-MB string while
    validating it and scan it for escapes while writing it (5-14 ms for one 1024x1024 PNG)."""
    head, _, tail = answer.model_dump_json().encode().partition(b'"data":[]')
    parts = [head, b'"data":[']
    for index, file in enumerate(files):
        parts += [b"," if index else b"", B64_ITEM_OPEN, b'"', base64.b64encode(file), b'"', B64_ITEM_CLOSE]
    return b"".join([*parts, b"]", tail])


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class VideoJob(BaseModel):
    """``progress``: the share of denoise steps done, in percent."""

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
    sparse_attention: dict | None = Field(None, description=SPARSE_RECORD)


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
    lora: list[str] = Field(default_factory=list, description="the named LoRA adapters a request may choose")


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
