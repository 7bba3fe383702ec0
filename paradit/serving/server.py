"""The HTTP front end (FastAPI) over a ``Scheduler``: OpenAI's Images API, video jobs, models, health and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from paradit import __version__
from paradit.errors import InvalidRequest, OutOfMemory, ParaditError
from paradit.outputs import sparse_record
from paradit.serving import schemas
from paradit.serving.jobs import Draining, Job, JobCancelled, JobTimeout, QueueFull
from paradit.serving.media import decode_input, encode_image, file_metadata
from paradit.serving.metrics import Metrics
from paradit.serving.records import JobRecords
from paradit.serving.remote import RemoteScheduler, ReplicaLost
from paradit.serving.scheduler import Scheduler
from paradit.serving.store import FILES, VIDEOS, DirectoryStore, FileStore, files_folder
from paradit.serving.videos import VideoJobs

DISCONNECT_POLL_S = 0.25  # how often a waiting handler asks whether its client is still there
EDITS = "/v1/images/edits"
CLIENT_GONE = 499  # the status logged for a request whose client left (nginx's convention): nobody reads it
JSON = "application/json"
NO_KEY = "a valid API key is required: send the header Authorization: Bearer <key>"


@dataclass(frozen=True)
class ServerConfig:
    """``api_key``, when set: the bearer token every route but /health requires; ``lora``: the adapters' names;
    ``files_dir``, when set: the folder of the files and video jobs, shared by every server process over it."""

    model: str
    video: bool = False
    api_key: str | None = None
    lora: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_edit_bytes: int = 20 << 20  # an edit's body, its images included
    file_store_bytes: int = 1 << 30
    files_dir: Path | None = None


def error_response(status: int, message: str, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


ERRORS: dict[type[ParaditError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    QueueFull: (429, "rate_limit_error"),
    Draining: (503, "server_shutting_down"),
    ReplicaLost: (503, "replica_lost"),
    OutOfMemory: (503, "out_of_memory"),  # the server's capacity, not the client's input: it serves on
    JobTimeout: (504, "timeout"),
    JobCancelled: (409, "cancelled"),
}


def paradit_error(request: Request, exc: ParaditError) -> JSONResponse:
    status, kind = next(((s, k) for t, (s, k) in ERRORS.items() if isinstance(exc, t)), (500, "server_error"))
    retry_after = getattr(exc, "retry_after", None)  # a full queue's, a lost replica's (serving/remote.py)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    # A failure in the workers carries their traces for the server's log; the client gets its first line.
    return error_response(status, str(exc).splitlines()[0], kind, getattr(exc, "param", None), headers)


def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming each field that is wrong and what it takes."""
    problems, params = [], []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown field; see the schema at /docs for the fields this API takes"
        elif error["type"] == "string_pattern_mismatch" and field == "size":
            message = 'give WIDTHxHEIGHT in pixels (such as "1024x1024") or "auto"'
        elif error["type"] == "json_invalid":  # its location is a character offset: the body is what is wrong
            field, message = "body", f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'syntax')})"
        problems.append(f"{field}: {message}")
        params.append(field)
    return error_response(400, "; ".join(problems), "invalid_request_error", params[0] if params else None)


def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


class BodyTooLarge(Exception):
    pass


class Gate:
    """ASGI middleware: 401 without the key but on /health (the docs too, which router dependencies miss), 413 for a
    body past the limit before anything parses it; every answer counted."""

    TIMED = {"/v1/images/generations", EDITS, "/v1/videos"}
    OUTCOMES = {
        401: "unauthorized",
        413: "too_large",
        429: "rejected",
        CLIENT_GONE: "cancelled",
        503: "unavailable",
        504: "timeout",
    }

    def __init__(self, app, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self.api_key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, received = time.perf_counter(), None, 0
        max_bytes = self.config.max_edit_bytes if scope["path"] == EDITS else self.config.max_body_bytes

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise BodyTooLarge
            return message

        async def recording_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        keyed = scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.api_key or b"")
        try:
            # An app mounted under a prefix (a Ray Serve route) sees its full path: /health is the one past the prefix.
            route = scope["path"].removeprefix(scope.get("root_path", ""))
            if self.api_key is not None and route != "/health" and not keyed:
                answer = error_response(401, NO_KEY, "authentication_error", headers={"WWW-Authenticate": "Bearer"})
                return await answer(scope, receive, recording_send)
            if int(headers.get(b"content-length", 0)) > max_bytes:
                raise BodyTooLarge
            await self.app(scope, limited_receive, recording_send)
        except BodyTooLarge:
            if status is None:  # nothing answered yet
                message = f"the body is larger than this server's limit of {max_bytes} bytes"
                await error_response(413, message, "invalid_request_error", "body")(scope, receive, recording_send)
        finally:
            # A request refused before the router matched it (no key, too large) counts under its route too.
            route = scope.get("route") or next(
                (r for r in scope["app"].routes if r.matches(scope)[0] is Match.FULL), None
            )
            path = route.path if route is not None else "unmatched"
            status = status or 500  # nothing answered: the app failed
            outcome = "ok" if status < 400 else self.OUTCOMES.get(status, "invalid" if status < 500 else "failed")
            self.metrics.requests.labels(path, outcome).inc()
            if path in self.TIMED and scope["method"] == "POST":
                self.metrics.latency.labels("total").observe(time.perf_counter() - start)


def create_app(scheduler: Scheduler | RemoteScheduler, config: ServerConfig, metrics: Metrics) -> FastAPI:
    app = FastAPI(
        title="paradit",
        version=__version__,
        description="OpenAI-compatible image and video generation.",
        responses={code: {"model": schemas.ErrorResponse} for code in (400, 401, 413, 429, 500, 503, 504)},
        exception_handlers={
            ParaditError: paradit_error,
            RequestValidationError: validation_error,
            HTTPException: http_error,
        },
    )
    app.add_middleware(Gate, config=config, metrics=metrics)
    if config.files_dir is None:
        files, records = FileStore(config.file_store_bytes), None
    else:
        folder = files_folder(config.files_dir)
        files, records = DirectoryStore(folder / FILES, config.file_store_bytes), JobRecords(folder / VIDEOS)
    videos = VideoJobs(scheduler, files, config.model, records=records)
    app.state.videos = videos

    def submitted(body: schemas.Body, **fields):
        """The body's request queued (a video job for a VideoBody), a size refused said in ``size``'s terms."""
        video = isinstance(body, schemas.VideoBody)
        if body.model is not None and body.model != config.model:
            raise InvalidRequest(f"model {body.model!r} is not served here; this server serves {config.model!r}")
        if video != config.video:
            made, route = ("videos", "POST /v1/videos") if config.video else ("images", "POST /v1/images/generations")
            raise InvalidRequest(f"{config.model} makes {made}; use {route}")
        request = body.request(config.model, **fields)
        try:
            return (videos.create if video else scheduler.submit)(request)
        except InvalidRequest as refused:
            if refused.param != "size":
                raise
            auto = scheduler.check(dataclasses.replace(request, height=None, width=None))
            message = f'{refused}; give size as WIDTHxHEIGHT within that, or "auto" ({auto.width}x{auto.height})'
            raise InvalidRequest(message, param="size") from None

    async def outcome_of(job: Job, request: Request):
        """The job's result, or None for a client that left first (its job cancelled)."""
        waiting = asyncio.wrap_future(job.future)
        while True:
            done, _ = await asyncio.wait([waiting], timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                scheduler.cancel(job, JobCancelled("the client went away"))
                waiting.add_done_callback(lambda ended: ended.exception())  # nobody is left to read its error
                return None

    @app.post("/v1/images/generations", response_model=schemas.ImagesResponse)
    async def generate_images(body: schemas.ImageGenerationBody, request: Request):
        return await images_answer(body, request)

    @app.post(EDITS, response_model=schemas.ImagesResponse)
    async def edit_images(request: Request):
        """Multipart: an ``image`` (``image[]`` from OpenAI's client) per input image, a ``mask``, text fields."""
        try:
            form = await request.form(max_files=schemas.MAX_INPUT_IMAGES + 2)
        except HTTPException as refused:  # Starlette's own, for a malformed body or too many parts
            message = f"the body is not a multipart form of this API's fields: {refused.detail}"
            raise InvalidRequest(message, param="image") from None
        uploads, mask = [*form.getlist("image"), *form.getlist("image[]")], form.get("mask")
        if not uploads:
            raise InvalidRequest("give the image(s) to edit as file parts named image", param="image")
        if len(uploads) > schemas.MAX_INPUT_IMAGES:
            raise InvalidRequest(
                f"{len(uploads)} images sent; this server takes at most {schemas.MAX_INPUT_IMAGES} an edit",
                param="image",
            )
        if any(isinstance(upload, str) for upload in uploads):
            raise InvalidRequest("image: send each image as a file part, not as text", param="image")
        if isinstance(mask, str):
            raise InvalidRequest(
                "mask: send the mask as a file part (an image of the first image's size)", param="mask"
            )
        fields = {key: value for key, value in form.multi_items() if key not in ("image", "image[]", "mask")}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise InvalidRequest(f"{key}: only image and mask take files; send {key} as text", param=key)
            if key in schemas.JSON_FORM_FIELDS:  # the JSON body's objects and lists, as JSON text
                try:
                    fields[key] = json.loads(value)
                except ValueError:
                    raise InvalidRequest(f"{key}: give it as JSON text, as the JSON body takes it", param=key) from None
        try:
            body = schemas.ImageEditBody.model_validate(fields)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        images = [
            await run_in_threadpool(decode_input, await upload.read(), f"image {i + 1}")
            for i, upload in enumerate(uploads)
        ]
        if mask is not None:
            mask = await run_in_threadpool(decode_input, await mask.read(), "the mask", "mask")
        return await images_answer(body, request, image=images, mask=mask)

    async def images_answer(body: schemas.ImageGenerationBody, request: Request, **fields):
        if body.output_compression is not None and body.output_format == "png":
            raise InvalidRequest("output_compression applies to jpeg and webp; png is lossless")
        job = submitted(body, num_images_per_prompt=body.n, **fields)
        result = await outcome_of(job, request)
        if result is None:
            return Response(status_code=CLIENT_GONE)
        sparse = sparse_record(result.timings)
        metadata = file_metadata(sparse)
        resolved = job.resolved
        answer = schemas.ImagesResponse(
            created=int(job.created),
            data=[],
            output_format=body.output_format,
            size=f"{resolved.width}x{resolved.height}",
            seed=resolved.seed,
            plan=job.plan,
            sparse_attention=sparse,
        )

        def encoded() -> list[bytes]:
            return [
                encode_image(image, body.output_format, body.output_compression, metadata) for image in result.images
            ]

        with metrics.latency.labels("encode").time():
            if body.response_format == "b64_json":  # its JSON written in the pool too: megabytes of base64
                content = await run_in_threadpool(lambda: schemas.images_json(answer, encoded()))
                return Response(content, media_type=JSON)
            # stored in the pool too: into a folder (--files-dir), a put is a write
            names = await run_in_threadpool(lambda: [files.put(data, body.output_format) for data in encoded()])
        # At the socket's address (--host and --port; under 0.0.0.0 the one reached), never the client's Host.
        host, port = request.scope["server"]
        origin = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        answer.data = [schemas.ImageData(url=origin + app.url_path_for("get_file", name=name)) for name in names]
        return answer

    def stored_file(stored: tuple[bytes, str] | None, missing: str) -> Response:
        if stored is None:
            raise HTTPException(404, missing)
        return Response(stored[0], media_type=stored[1])

    # A folder's (--files-dir) files and records are read in the pool, off the event loop.

    @app.get("/v1/files/{name}", name="get_file")
    async def get_file(name: str):
        return stored_file(
            await run_in_threadpool(files.get, name), f"no file {name!r}: it never existed or has expired"
        )

    @app.post("/v1/videos", response_model=schemas.VideoJob)
    async def create_video(body: schemas.VideoBody):
        return videos.view(submitted(body))

    async def video_entry(video_id: str):
        entry = await run_in_threadpool(videos.get, video_id)
        if entry is None:
            raise HTTPException(404, f"no video job {video_id!r}")
        return entry

    @app.get("/v1/videos/{video_id}", response_model=schemas.VideoJob)
    async def get_video(video_id: str):
        return videos.view(await video_entry(video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def get_video_content(video_id: str):
        entry = await video_entry(video_id)
        status = videos.view(entry).status
        if status != "completed":
            raise HTTPException(409, f"video job {video_id} is {status}; its content is there once it is completed")
        content = await run_in_threadpool(files.get, entry.content)
        return stored_file(content, f"video job {video_id}'s content has expired")

    @app.delete("/v1/videos/{video_id}", response_model=schemas.DeletedVideo)
    async def delete_video(video_id: str):
        return schemas.DeletedVideo(id=video_id, status=await videos.delete(await video_entry(video_id)))

    card = schemas.ModelCard(id=config.model, created=int(time.time()), lora=list(config.lora))

    @app.get("/v1/models", response_model=schemas.ModelList)
    async def list_models():
        return schemas.ModelList(data=[card])

    @app.get("/v1/models/{model:path}", response_model=schemas.ModelCard)
    async def get_model(model: str):
        if model != config.model:
            raise HTTPException(404, f"model {model!r} is not served here; this server serves {config.model!r}")
        return card

    @app.get("/metrics")
    async def get_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", response_model=schemas.Health)
    async def health():
        status, queued, groups = scheduler.health()
        rows = [schemas.GroupHealth.model_validate(group, from_attributes=True) for group in groups]
        answer = schemas.Health(status=status, queue=queued, groups=rows)
        return JSONResponse(answer.model_dump(), status_code=200 if status in ("ok", "degraded") else 503)

    return app
