"""``paradit serve``: engines, scheduler, app, uvicorn; a first SIGTERM, SIGINT or SIGHUP drains, a second exits."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading

import torch
import uvicorn

from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.family import PIXELS_PER_IMAGE_TOKEN
from paradit.options import ServeSettings
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.serving.metrics import Metrics
from paradit.serving.pace import Pace
from paradit.serving.scheduler import Scheduler
from paradit.serving.server import ServerConfig, create_app
from paradit.serving.store import files_folder
from paradit.settings import settle

logger = logging.getLogger(__name__)


# A request's pixels at most, by default, against the model's default size: attention costs the square of its tokens.
MAX_PIXELS_FACTOR = 4


def build_scheduler(settings: ServeSettings, metrics: Metrics) -> tuple[Scheduler, ServerConfig]:
    """The scheduler (not started) over groups of warmed-up engines; ``auto``: a group over every GPU, then one each."""
    auto = settings.group_size == "auto"
    if auto and settings.gpus < 2:
        raise InvalidRequest("--group-size auto needs --gpus 2 or more (it chooses between splitting and not)")
    group_size = settings.gpus if auto else settings.group_size or settings.gpus
    if settings.gpus % group_size:
        raise InvalidRequest(f"--gpus {settings.gpus} is not a multiple of --group-size {group_size}")
    grouped = settle(dataclasses.replace(settings.asked, gpus=group_size))
    if grouped.origin is not None:
        logger.warning("%s", grouped.origin)
    alone = settle(dataclasses.replace(settings.asked, model=grouped.spec, gpus=1)) if auto else None
    on_cpu = grouped.device.type == "cpu"
    # Every worker process shares the cores: one group's would otherwise each take them all.
    cpu_threads = max(1, (os.cpu_count() or 1) // settings.gpus) if on_cpu else None
    spec, family = grouped.spec, grouped.family
    pace = Pace(spec, family)

    def build(index: int) -> Engine:
        single = auto and index > 0  # under auto, group i > 0 is GPU i - 1 on its own
        first = index - 1 if single else index * group_size
        run = alone if single else grouped
        run = run if on_cpu else dataclasses.replace(run, device=torch.device("cuda", first))
        engine = Engine(settings=run, isolate=True, cpu_threads=cpu_threads)
        try:  # a step at the model's default size per batch size, so that no client pays a first run's costs
            for images in range(1, settings.max_batch + 1):  # (compiled blocks: one graph per batch size)
                steps = 2 if images == 1 else 1  # one more to measure the pace: the second step is in its stride
                warm = engine.generate(GenerationRequest(prompt="warm-up", steps=steps, num_images_per_prompt=images))
                pace.record([warm.request], warm.timings.step_ms[1:])
        except BaseException:
            engine.close()
            raise
        return engine

    max_pixels = settings.max_pixels or MAX_PIXELS_FACTOR * spec.height * spec.width

    def check(request: GenerationRequest) -> ResolvedRequest:
        resolved = grouped.resolve(request)
        size = f"{resolved.width}x{resolved.height}"
        if resolved.width * resolved.height > max_pixels:
            raise InvalidRequest(
                f"{size} is past this server's {max_pixels} pixels a request (--max-pixels)", param="size"
            )
        # Input images' tokens count as the pixels that many target tokens cover: each lengthens every block as much.
        inputs = resolved.reference_tokens * PIXELS_PER_IMAGE_TOKEN
        if resolved.width * resolved.height + inputs > max_pixels:
            raise InvalidRequest(
                f"{size} with input images of {inputs} pixels (as the transformer sees them) is past this server's "
                f"{max_pixels} pixels a request (--max-pixels); send fewer or smaller images",
                param="image",
            )
        return resolved

    scheduler = Scheduler(
        build,
        settings.gpus + 1 if auto else settings.gpus // group_size,
        check,
        metrics,
        max_batch=settings.max_batch,
        max_queue=settings.max_queue,
        timeout_s=settings.timeout_s,
        auto=auto,
        pace=pace,
    )
    names = tuple(grouped.options.lora.names())
    config = ServerConfig(
        spec.name, video=family.video, api_key=settings.api_key, lora=names, files_dir=settings.files_dir
    )
    return scheduler, config


class DrainingServer(uvicorn.Server):
    """uvicorn, whose first SIGTERM or SIGINT drains the scheduler (new requests get 503) before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self.scheduler, self.draining = scheduler, False

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining:  # a second signal: stop now
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        self.draining = True
        threading.Thread(target=self._drain_then_exit, name="paradit-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        logger.warning("draining: finishing the accepted requests, refusing new ones")
        self.scheduler.drain()
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket]) -> None:
        await super().startup(sockets)
        self._log_started_message(sockets)  # uvicorn names the address only of a socket it opened itself


def listen(host: str, port: int) -> socket.socket:
    """Listening before any engine loads: a port in use is refused at once, not after a minute of loading."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except (OSError, OverflowError) as exc:  # OverflowError: a port past 65535
        reason = str(getattr(exc, "strerror", None) or exc).rstrip(".")
        raise InvalidRequest(f"port {port} on {host}: {reason}; give a free --port or another --host") from None


def serve(settings: ServeSettings, log_level: str = "info") -> None:
    host, port = settings.host, settings.port
    with listen(host, port) as listening:
        if settings.files_dir is not None:  # before loading, as the port
            files_folder(settings.files_dir)
        metrics = Metrics()
        scheduler, config = build_scheduler(settings, metrics)
        app = create_app(scheduler, config, metrics)
        try:
            scheduler.start()
            DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), scheduler).run([listening])
        finally:
            scheduler.close()
            app.state.videos.close()
