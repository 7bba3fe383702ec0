"""``paradit generate --server URL``: a request to ``paradit serve``; standard library only, so it starts at once."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from paradit.cache_options import cache_config
from paradit.errors import InvalidRequest, ParaditError
from paradit.flags import GENERATE, flagged_fields, flags_given, from_args
from paradit.lora import parse_adapter
from paradit.options import Asked, ExecutionOptions, LoraFlags
from paradit.outputs import IMAGE_FORMATS, VIDEO_SUFFIX, output_paths
from paradit.parallel.config import ParallelConfig
from paradit.request import GenerationRequest

POLL_S = 0.5
Files = list[tuple[str, Path]]  # (part name, path)


class ServerError(ParaditError):
    """The server refused or failed the request (its message)."""


def multipart(fields: dict, files: Files) -> tuple[bytes, str]:
    """A multipart form of ``fields`` (lists as JSON) and ``files``, and its type: urllib has none."""
    boundary = secrets.token_hex(16)
    parts = []
    for name, value in fields.items():
        text = json.dumps(value) if isinstance(value, list) else str(value)
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{text}\r\n'.encode())
    for name, path in files:
        filename = path.name.replace('"', "_")
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        )
        parts.append(head.encode() + path.read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def call(
    server: str, method: str, path: str, api_key: str | None, body: dict | None = None, files: Files | None = None
) -> bytes:
    """The answer's body (with ``files``, ``body`` is sent as a multipart form); an error answer raises ServerError."""
    content_type, data = "application/json", None if body is None else json.dumps(body).encode()
    if files:
        data, content_type = multipart(body or {}, files)
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(server.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.read()
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ServerError(f"the server answered {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise ServerError(f"cannot reach {server}: {exc.reason}") from None


def request_body(args: argparse.Namespace) -> dict:
    """The request's fields, from ``generate``'s flags; the run's flags, which the server chose, are refused."""
    chosen = flags_given(args, GENERATE, Asked, ExecutionOptions, ParallelConfig, LoraFlags)
    sparse = [name for name in chosen if name.startswith("--sparse-")]  # the request's own sparse attention
    # --lora: the server's adapters by name
    chosen = [name for name in chosen if name not in ("--model", "--lora") and name not in sparse]
    if chosen:
        raise InvalidRequest(f"{', '.join(chosen)}: the server chose these when it started; drop them with --server")
    if len(args.prompt) > 1:
        raise InvalidRequest("--server takes one --prompt a call (each is its own request)")
    if (args.height is None) != (args.width is None):
        raise InvalidRequest("--server needs --height and --width together (or neither, for the model's size)")
    body = {"prompt": args.prompt[0], "size": "auto" if args.height is None else f"{args.width}x{args.height}"}
    for each, flag in flagged_fields(GenerationRequest, GENERATE):
        if flag.remote is not None and (value := getattr(args, each.name)) is not None:
            body[flag.remote] = flag.convert(value) if flag.convert else value
    cache = cache_config(args)
    if cache is not None:
        if cache.calibrate or getattr(args, "image", None):
            raise InvalidRequest(
                "--server caches text-to-image requests; calibrate (--cache-calibrate) and edit with a cache locally"
            )
        body["cache"] = {k: v for k, v in dataclasses.asdict(cache).items() if k != "calibrate" and v is not None}
    if sparse:
        options = from_args(ExecutionOptions, args, GENERATE)
        if options.sparse_attention is None:
            raise InvalidRequest(f"{', '.join(sparse)}: give the --sparse-attention they are parameters of")
        body["sparse_attention"] = {"method": options.sparse_attention, **options.sparse_parameters()}
    if args.lora:  # the server's named adapters, NAME[:SCALE]
        body["lora"] = [{"name": ref.source, "scale": ref.scale} for ref in map(parse_adapter, args.lora)]
    return {key: value for key, value in body.items() if value is not None}


def generate_remote(args: argparse.Namespace) -> int:
    try:  # urllib takes any text for a URL and fails later on its own terms; .port raises for a port out of range
        url = urllib.parse.urlsplit(args.server)
        if url.scheme not in ("http", "https") or not url.hostname or url.port == 0:
            raise ValueError
    except ValueError:
        raise InvalidRequest(f"--server {args.server} is not a server URL; give http://host:port") from None
    api_key = args.api_key or os.environ.get("PARADIT_API_KEY")
    out = args.out or "out/paradit.png"
    video = Path(out).suffix.lower() == VIDEO_SUFFIX
    body = request_body(args)
    parts = [("image", Path(path)) for path in args.image or ()]  # the form's file parts
    if getattr(args, "mask", None) is not None:
        if not parts:
            raise InvalidRequest("--mask needs the --image it masks")
        parts.append(("mask", Path(args.mask)))
    for flag, path in parts:  # read before anything is sent, as generate does
        if not path.is_file():
            raise InvalidRequest(f"--{flag} {path} cannot be read as an image (no such file)")
    if video and args.image:
        raise InvalidRequest("--image: a server's video jobs take no image; run image-to-video without --server")
    if video:
        [path] = output_paths(out, 1, video=True)
        answer = json.loads(call(args.server, "POST", "/v1/videos", api_key, body))
        while answer["status"] in ("queued", "in_progress"):
            time.sleep(POLL_S)
            answer = json.loads(call(args.server, "GET", f"/v1/videos/{answer['id']}", api_key))
        if answer["status"] != "completed":
            raise ServerError(f"the video job {answer['status']}: {(answer.get('error') or {}).get('message', '')}")
        files = {path: call(args.server, "GET", f"/v1/videos/{answer['id']}/content", api_key)}
    else:
        paths = output_paths(out, args.num_images_per_prompt)
        body.update(n=args.num_images_per_prompt, output_format=IMAGE_FORMATS[paths[0].suffix.lower()].lower())
        route = "/v1/images/edits" if args.image else "/v1/images/generations"
        answer = json.loads(call(args.server, "POST", route, api_key, body, parts))
        files = {path: base64.b64decode(item["b64_json"]) for path, item in zip(paths, answer["data"])}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    print(f"seed {answer['seed']}")
    print("wrote " + ", ".join(str(path) for path in files))
    return 0
