"""Serving under load: ``paradit serve`` started as its own process per configuration (group size, batch), driven
with open-loop Poisson arrivals at several rates from this process over HTTP. For each configuration and rate it
reports requests sent, answered, refused (429) and failed, images per minute, p50/p95/p99 latency (request sent to
answer read, base64 images included) and the mean images per forward pass; before the rates, the unloaded HTTP
latency (one request at a time) against ``Engine.generate``'s own time with the same plan (measured first, without
the server) and the time to make its answer's bytes from the result as the server does (8-bit pixels, PNG, base64
and JSON), the largest part of the difference.

Every configuration sees the same arrival times and prompts (a seeded schedule), so rows compare at equal load. By
default the rates are fractions of the first configuration's capacity (its groups over its unloaded latency), from
light load to past saturation; ``--rates`` gives them in requests per second instead. Group sizes are whole numbers
or ``auto`` (the server chooses per batch between one group of every GPU and one group per GPU).

    python benchmarks/serve_load.py --model flux2-klein-4b --load-format dummy --gpus 1 --max-batches 1 4
    python benchmarks/serve_load.py --model z-image-turbo --load-format dummy --gpus 2 --group-sizes 2 1 auto
    python benchmarks/serve_load.py --tiny            # CPU self-check: tiny FLUX.2, two processes, a few requests

Prints a table and writes ``serve_load_<model>.json`` (or ``--tag``.json) under ``--out-dir`` (default ``$OUT``
when set).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402

# Load as fractions of the first configuration's capacity: light, moderate, near and past saturation.
LOAD_FRACTIONS = (0.3, 0.6, 0.9, 1.2, 1.8)
PROMPTS = [
    "a lighthouse on a cliff at dusk",
    "a red fox in fresh snow, morning light",
    "a bowl of ramen on a wooden table, steam rising, shallow depth of field",
    "an isometric city block at night with neon signs and rain",
    "a watercolour of a heron standing in reeds",
]
STOP_S = 120  # a server draining its last requests
START_S = 900  # loading a full-size model, compiling and warming up
UNLOADED_REQUESTS = 5


@dataclass(frozen=True)
class Config:
    group_size: int | str  # or "auto"
    max_batch: int

    @property
    def name(self) -> str:
        return f"G={self.group_size} batch<={self.max_batch}"


class Server:
    """``paradit serve`` in a process of its own, on a free port, until ``stop``."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        command = [
            sys.executable,
            "-m",
            "paradit",
            "serve",
            "--model",
            args.model,
            "--gpus",
            str(args.gpus),
            "--group-size",
            str(config.group_size),
            "--max-batch",
            str(config.max_batch),
            "--port",
            "0",
            "--max-queue",
            str(10 * args.requests),
            "--timeout",
            "3600",
            "--load-format",
            args.load_format,
            *(["--device", args.device] if args.device else []),
            *args.server_args.split(),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        deadline, self.url = time.monotonic() + START_S, None
        while self.url is None and time.monotonic() < deadline and self.process.poll() is None:
            line = self.process.stdout.readline()
            self.log.append(line)
            found = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line)
            self.url = found and found[1]
        if self.url is None:
            self.stop()
            raise SystemExit(f"the server for {config.name} did not start:\n" + "".join(self.log[-30:]))
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()

    def batch_images(self) -> tuple[float, float]:
        """(forward passes, images) the server has run, from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        count = float(re.search(r"paradit_batch_images_count (\S+)", text)[1])
        return count, float(re.search(r"paradit_batch_images_sum (\S+)", text)[1])

    def mean_seconds(self, phase: str) -> float:
        """The mean of ``phase``'s seconds over the requests so far, from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        total = float(re.search(rf'paradit_latency_seconds_sum{{phase="{phase}"}} (\S+)', text)[1])
        return total / float(re.search(rf'paradit_latency_seconds_count{{phase="{phase}"}} (\S+)', text)[1])

    def stop(self) -> None:
        stop_server(self.process)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, which a server answers by draining (``--ray``: and stopping the Ray it started); killed after
    ``STOP_S``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def body(args: argparse.Namespace, index: int) -> dict:
    return {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "size": f"{args.size}x{args.size}",
        "seed": index,
        **({"steps": args.steps} if args.steps else {}),
    }


async def timed_request(client: httpx.AsyncClient, payload: dict, delay: float, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    answer = await client.post("/v1/images/generations", json=payload)
    return {
        "status": answer.status_code,
        "sent": sent - start,
        "latency": time.perf_counter() - sent,
        "images": len(answer.json().get("data", [])) if answer.status_code == 200 else 0,
    }


async def run_schedule(url: str, payloads: list[dict], delays: list[float]) -> list[dict]:
    """Send each payload at its delay from now, whatever the answers so far (open loop)."""
    limits = httpx.Limits(max_connections=len(payloads) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(timed_request(client, p, d, start) for p, d in zip(payloads, delays)))


def unloaded_latency(url: str, args: argparse.Namespace) -> float:
    """Median seconds of one request at a time (after one more that warms the HTTP path)."""
    latencies = []
    with httpx.Client(base_url=url, timeout=3600) as client:
        for index in range(UNLOADED_REQUESTS + 1):
            sent = time.perf_counter()
            answer = client.post("/v1/images/generations", json=body(args, 10_000 + index))
            answer.raise_for_status()
            latencies.append(time.perf_counter() - sent)
    return statistics.median(latencies[1:])


def engine_latency(args: argparse.Namespace, group_size: int) -> tuple[float, dict[str, float]]:
    """Median seconds of ``Engine.generate`` (the same plan and request as the server's, no HTTP), measured
    before any server starts so that the two never share a GPU; and of making its answer as the server does, whole
    and by stage (the pixels to PIL, the PNG, the JSON)."""
    from benchmarks.common import default_plan_for
    from paradit import Engine, GenerationRequest
    from paradit.cli import build_parser
    from paradit.options import ExecutionOptions
    from paradit.serving import schemas
    from paradit.serving.media import encode_image
    from paradit.settings import resolve_model

    spec = resolve_model(args.model, args.load_format)
    served = build_parser().parse_args(["serve", *args.server_args.split()])  # the server's execution options
    options = ExecutionOptions(quantize=served.quantize, compile=served.compile, cuda_graphs=served.cuda_graphs)
    with Engine(
        spec,
        device=args.device,
        dtype=served.dtype,
        parallel=default_plan_for(spec, group_size),
        options=options,
        max_gpu_memory=served.max_gpu_memory,
        isolate=True,
    ) as engine:
        latencies, stages = [], []
        for index in range(UNLOADED_REQUESTS + 1):
            payload = body(args, 10_000 + index)
            request = GenerationRequest(
                prompt=payload["prompt"], height=args.size, width=args.size, steps=args.steps, seed=index
            )
            sent = time.perf_counter()
            result = engine.generate(request)
            made = time.perf_counter()
            images = result.images
            converted = time.perf_counter()
            files = [encode_image(image, "png") for image in images]
            encoded = time.perf_counter()
            answer = schemas.ImagesResponse(created=0, data=[], output_format="png", size="", seed=0, plan="")
            schemas.images_json(answer, files)
            done = time.perf_counter()
            latencies.append(made - sent)
            if index == 0 and args.out_dir:  # the image the stages encode, to study its encoding offline
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.out_dir) / "answer.png").write_bytes(files[0])
            stages.append(
                {
                    "png_s": done - made,
                    "pixels_s": converted - made,
                    "encode_s": encoded - converted,
                    "json_s": done - encoded,
                }
            )
    return statistics.median(latencies[1:]), {key: statistics.median(s[key] for s in stages[1:]) for key in stages[0]}


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summarise(config: Config, rate: float, results: list[dict], batches: tuple[float, float]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    span = max((r["sent"] + r["latency"] for r in ok), default=0.0) - min((r["sent"] for r in results), default=0.0)
    latencies = [r["latency"] for r in ok]
    forwards, images = batches
    return {
        "config": config.name,
        "group_size": config.group_size,
        "max_batch": config.max_batch,
        "rate": rate,
        "sent": len(results),
        "ok": len(ok),
        "refused": sum(r["status"] == 429 for r in results),
        "failed": sum(r["status"] not in (200, 429) for r in results),
        "images_per_min": 60 * sum(r["images"] for r in ok) / span if span > 0 else None,
        "p50_s": percentile(latencies, 0.50),
        "p95_s": percentile(latencies, 0.95),
        "p99_s": percentile(latencies, 0.99),
        "mean_batch": images / forwards if forwards else None,
    }


def environment(args: argparse.Namespace) -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else None
    return {"torch": torch.__version__, "gpu": gpu, "gpus": args.gpus, "python": platform.python_version()}


def print_rows(unloaded: list[dict], rows: list[dict]) -> None:
    print_table(
        unloaded,
        [
            ("config", "config", "s"),
            ("engine_s", "generate s", ".3f"),
            ("png_s", "PNG answer s", ".3f"),
            ("pixels_s", "pixels s", ".3f"),
            ("encode_s", "encode s", ".3f"),
            ("json_s", "JSON s", ".3f"),
            ("server_encode_s", "server's answer s", ".3f"),
            ("http_s", "HTTP s", ".3f"),
            ("overhead", "HTTP overhead", ".1%"),
        ],
    )
    print()
    print_table(
        rows,
        [
            ("config", "config", "s"),
            ("rate", "req/s", ".3f"),
            ("sent", "sent", "d"),
            ("ok", "ok", "d"),
            ("refused", "429", "d"),
            ("failed", "failed", "d"),
            ("images_per_min", "images/min", ".1f"),
            ("p50_s", "p50 s", ".3f"),
            ("p95_s", "p95 s", ".3f"),
            ("p99_s", "p99 s", ".3f"),
            ("mean_batch", "mean batch", ".2f"),
        ],
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux2-klein-4b")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the server uses (CPU processes with --device cpu)")
    parser.add_argument(
        "--group-sizes", nargs="+", help="whole numbers or auto (default: --gpus, then 1 and auto if different)"
    )
    parser.add_argument("--max-batches", type=int, nargs="+", default=[1], help="--max-batch of each configuration")
    parser.add_argument("--size", type=int, default=1024, help="image height and width")
    parser.add_argument("--steps", type=int, help="default: the model's")
    parser.add_argument("--rates", type=float, nargs="+", help="requests per second (default: from the capacity)")
    parser.add_argument("--requests", type=int, default=30, help="requests per rate")
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--server-args", default="", help="more `paradit serve` options, e.g. '--quantize fp8'")
    parser.add_argument("--no-baseline", action="store_true", help="skip Engine.generate's unloaded time")
    parser.add_argument("--tiny", action="store_true", help="CPU self-check: flux2-tiny, 2 processes, 32 px")
    parser.add_argument("--out-dir", default=os.environ.get("OUT"))
    parser.add_argument("--tag", help="the JSON file's name (default: serve_load_<model>)")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.load_format, args.device, args.gpus, args.size = "flux2-tiny", "auto", "cpu", 2, 32
        args.steps, args.requests = args.steps or 2, min(args.requests, 10)
    defaults = [str(args.gpus)] + (["1", "auto"] if args.gpus > 1 else [])
    args.group_sizes = [size if size == "auto" else int(size) for size in args.group_sizes or defaults]
    return args


def main() -> int:
    args = parse_args()
    configs = [Config(g, b) for g, b in itertools.product(args.group_sizes, args.max_batches)]
    fixed = [size for size in args.group_sizes if size != "auto"]
    engine_s = {} if args.no_baseline else {size: engine_latency(args, size) for size in fixed}
    schedule = random.Random(0)
    unit_gaps = [schedule.expovariate(1.0) for _ in range(args.requests)]  # scaled by each rate: one schedule
    payloads = [body(args, index) for index in range(args.requests)]
    unloaded, rows, rates = [], [], args.rates
    for config in configs:
        server = Server(args, config)
        try:
            http_s = unloaded_latency(server.url, args)
            served_encode_s = server.mean_seconds("encode")
            engine, answer_stages = engine_s.get(config.group_size, (None, {}))
            unloaded.append(
                {
                    "config": config.name,
                    "engine_s": engine,
                    **answer_stages,
                    "server_encode_s": served_encode_s,
                    "http_s": http_s,
                    "overhead": http_s / engine - 1 if engine else None,
                }
            )
            if rates is None:  # auto's first request runs on the group of every GPU
                capacity = (1 if config.group_size == "auto" else args.gpus // config.group_size) / http_s
                rates = [round(fraction * capacity, 4) for fraction in LOAD_FRACTIONS]
            for rate in rates:
                delays = list(itertools.accumulate(gap / rate for gap in unit_gaps))
                before = server.batch_images()
                results = asyncio.run(run_schedule(server.url, payloads, delays))
                after = server.batch_images()
                rows.append(summarise(config, rate, results, (after[0] - before[0], after[1] - before[1])))
                print(f"{config.name} at {rate:.3f} req/s: {rows[-1]['ok']}/{len(results)} ok", flush=True)
        finally:
            server.stop()
    print()
    print_rows(unloaded, rows)
    payload = {"env": environment(args), "args": vars(args), "unloaded": unloaded, "rows": rows}
    write_json(args.out_dir, f"{args.tag or 'serve_load_' + Path(args.model).name}.json", payload)
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
