"""``paradit generate --server URL``: the request sent to a running ``paradit serve`` instead of a model loaded here,
the files written where ``--out`` says. An ``--out`` ending in .mp4 makes a video job and waits for it. Standard
library only, so that the command answers at once.

Must not import torch.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from paradit.errors import InvalidRequest, ParaditError

FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
POLL_S = 0.5
# Options that shape what the server runs rather than the request: the server chose them when it started.
LOCAL_ONLY = ("gpus", "ulysses", "ring", "tensor", "pipefusion", "quantize", "dtype", "device", "max_gpu_memory")


class ServerError(ParaditError):
    """The server refused or failed the request (its message)."""


def call(server: str, method: str, path: str, api_key: str | None, body: dict | None = None) -> bytes:
    """The answer's body; an error answer raises ServerError with the server's message."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
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
    """The fields both APIs share, from ``generate``'s flags; flags a server cannot take are refused."""
    given = [name for name in LOCAL_ONLY if getattr(args, name, None) not in (None, False, "none")]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InvalidRequest(f"{flags}: the server chose these when it started; drop them with --server")
    if len(args.prompt) > 1:
        raise InvalidRequest("--server takes one --prompt a call (each is its own request)")
    if (args.height is None) != (args.width is None):
        raise InvalidRequest("--server needs --height and --width together (or neither, for the model's size)")
    body = {
        "prompt": args.prompt[0], "negative_prompt": args.negative_prompt, "steps": args.steps,
        "guidance": args.guidance, "seed": args.seed,
        "size": "auto" if args.height is None else f"{args.width}x{args.height}",
    }  # fmt: skip
    return {key: value for key, value in body.items() if value is not None}


def generate_remote(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("PARADIT_API_KEY")
    out = Path(args.out or "out/paradit.png")
    body = request_body(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".mp4":
        body.update({k: v for k, v in (("frames", args.frames), ("fps", args.fps), ("guidance_2", args.guidance_2))
                     if v is not None})  # fmt: skip
        job = json.loads(call(args.server, "POST", "/v1/videos", api_key, body))
        while job["status"] in ("queued", "in_progress"):
            time.sleep(POLL_S)
            job = json.loads(call(args.server, "GET", f"/v1/videos/{job['id']}", api_key))
        if job["status"] != "completed":
            raise ServerError(f"the video job {job['status']}: {(job.get('error') or {}).get('message', '')}")
        out.write_bytes(call(args.server, "GET", f"/v1/videos/{job['id']}/content", api_key))
        print(f"seed {job['seed']}")
        print(f"wrote {out}")
        return 0
    if out.suffix.lower() not in FORMATS:
        raise InvalidRequest(f"--out {out} has no image extension; end it in {', '.join(FORMATS)} (or .mp4)")
    body.update(n=args.images_per_prompt, output_format=FORMATS[out.suffix.lower()])
    answer = json.loads(call(args.server, "POST", "/v1/images/generations", api_key, body))
    images = [base64.b64decode(item["b64_json"]) for item in answer["data"]]
    paths = [out] if len(images) == 1 else [out.with_name(f"{out.stem}_{i}{out.suffix}") for i in range(len(images))]
    for path, data in zip(paths, images):
        path.write_bytes(data)
    print(f"seed {answer['seed']}")
    print("wrote " + ", ".join(str(path) for path in paths))
    return 0
