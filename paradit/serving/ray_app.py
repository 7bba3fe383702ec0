"""``paradit serve --ray``: a Ray Serve application of one front and replicas that are each a paradit group.

The front is ``paradit serve``'s own FastAPI app over a ``RemoteScheduler``: it checks and seeds every request with
the check of a replica's group, its plan settled by ``settle`` on the replica's machine (a malformed request never
leaves the front, which needs no GPU), keeps the video jobs and their files (in its memory, or in ``--files-dir``, a
folder that a restarted front reads again), and sends each request to a ``GroupReplica``, which runs the scheduler
``paradit serve`` runs for one group.
``serve run paradit.serving.ray_app:build model=flux2-tiny device=cpu replicas=2`` serves it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import ray
from prometheus_client import Counter
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from paradit.errors import InvalidRequest
from paradit.options import LOCAL_RAY, Asked, RayFlags, ServeSettings
from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest
from paradit.serving.launch import build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.remote import RemoteScheduler
from paradit.serving.server import ServerConfig, create_app
from paradit.serving.store import files_folder
from paradit.worker import start_worker_server

logger = logging.getLogger(__name__)

TARGET_ONGOING_REQUESTS = 2  # per replica, for autoscaling: one running and one queued keeps a group busy
REPLICA_LOST = (RayActorError, ActorUnavailableError)
APP_NAME = "paradit"


def group_settings(settings: ServeSettings, gpus_per_replica: int) -> ServeSettings:
    """One replica's settings: a single group of ``gpus_per_replica`` GPUs (CPU workers on ``--device cpu``)."""
    return dataclasses.replace(settings, gpus=gpus_per_replica, group_size=None)


@serve.deployment(max_ongoing_requests=16)
class GroupReplica:
    """One paradit group, its plan settled once here as ``paradit serve`` settles it."""

    def __init__(self, settings: ServeSettings) -> None:
        start_worker_server(settings.asked.device)
        self.scheduler, self.config = build_scheduler(settings, Metrics())
        self.scheduler.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def checks(self) -> tuple[Callable[[GenerationRequest], ResolvedRequest], ServerConfig]:
        """This group's request check, closed over the plan settled on this replica's machine (Ray pickles it by
        value), and its API's config: the front refuses what this group would, with no GPU of its own."""
        return self.scheduler.check, self.config

    async def run(self, request: GenerationRequest, video: bool) -> tuple[GenerationResult, str, str]:
        """The result, the group's plan, and this replica's id (the front counts each replica's requests)."""
        job = self.scheduler.submit(request, video=video)
        return await asyncio.wrap_future(job.future), job.plan, self.replica_id

    def __del__(self) -> None:
        self.scheduler.close()


@serve.deployment
@serve.ingress()
class Front:
    """``paradit serve``'s API; the requests it accepts run on the replicas behind ``replica``."""

    async def __init__(self, settings: ServeSettings, replica: DeploymentHandle) -> None:  # Serve awaits it
        self.metrics = Metrics()
        check, self.config = await replica.checks.remote()
        self.replica = replica
        self.scheduler = RemoteScheduler(check, self._run, REPLICA_LOST, settings.timeout_s)
        self.served = Counter(
            "paradit_replica_requests", "Requests each replica ran", ["replica"], registry=self.metrics.registry
        )

    async def _run(self, request: GenerationRequest, video: bool) -> tuple[GenerationResult, str]:
        result, plan, replica_id = await self.replica.run.remote(request, video)
        self.served.labels(replica_id).inc()
        return result, plan

    async def drain(self) -> None:
        """Refuse new requests (503, as ``paradit serve`` draining) and return once the accepted ones have run."""
        self.scheduler.drain()
        await self.scheduler.finished()

    def __serve_build_asgi_app__(self):
        return create_app(self.scheduler, self.config, self.metrics)


def ray_app(
    settings: ServeSettings,
    replicas: int = 1,
    gpus_per_replica: int = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
):
    """The application: ``replicas`` groups of ``gpus_per_replica`` GPUs (CPUs on ``--device cpu``), or between
    ``min_replicas`` and ``max_replicas`` of them, scaled to ``TARGET_ONGOING_REQUESTS`` each, behind one front."""
    if settings.files_dir is not None:  # checked here, before any replica loads; the front makes it where it runs
        files_folder(settings.files_dir)
    grouped = group_settings(settings, gpus_per_replica)
    on_cpu = (settings.asked.device or "").startswith("cpu")
    resources = {"num_cpus": gpus_per_replica} if on_cpu else {"num_gpus": gpus_per_replica}
    if min_replicas is not None or max_replicas is not None:
        low, high = min_replicas or 1, max_replicas or max(min_replicas or 1, replicas)
        if low > high:
            raise InvalidRequest(f"--min-replicas {low} is past --max-replicas {high}; give a smaller --min-replicas")
        scaling = {
            "autoscaling_config": {
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": TARGET_ONGOING_REQUESTS,
            }
        }
    else:
        scaling = {"num_replicas": replicas}
    replica = GroupReplica.options(ray_actor_options=resources, **scaling).bind(grouped)
    return Front.options(ray_actor_options={"num_cpus": 0}).bind(grouped, replica)


def build(args: dict[str, str]):
    """``serve run``'s and a Serve config file's entry: ``model``, ``device``, ``replicas``, ``gpus_per_replica``,
    ``min_replicas``, ``max_replicas``, ``api_key``, ``files_dir``."""
    asked = Asked(model=args["model"], device=args.get("device"))
    settings = ServeSettings(
        asked=asked,
        api_key=args.get("api_key") or os.environ.get("PARADIT_API_KEY"),
        files_dir=Path(args["files_dir"]) if "files_dir" in args else None,
    )
    counts = {
        key: int(args[key]) for key in ("replicas", "gpus_per_replica", "min_replicas", "max_replicas") if key in args
    }
    return ray_app(settings, **counts)


def serve_on_ray(settings: ServeSettings, flags: RayFlags) -> None:
    """``paradit serve --ray``: the application on the cluster at ``flags.ray``, its front at --host and --port.
    A first SIGTERM, SIGINT or SIGHUP drains as ``paradit serve`` does (new requests get 503, the accepted ones
    answer), then the application leaves the cluster, and a Ray started here stops with it; a second exits now."""
    local = flags.ray == LOCAL_RAY
    app = ray_app(settings, flags.replicas, flags.gpus_per_replica, flags.min_replicas, flags.max_replicas)
    stop = threading.Event()

    def on_signal(signum: int, frame) -> None:
        if stop.is_set():
            raise SystemExit(128 + signum)
        stop.set()

    ray.init(address=None if local else flags.ray)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # after ray.init, which sets its own
        signal.signal(signum, on_signal)
    drained = False
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        front = serve.run(app, name=APP_NAME, route_prefix="/")
        logger.warning("serving on Ray at http://%s:%d (Ctrl-C stops it)", settings.host, settings.port)
        while not stop.wait(1):
            pass
        logger.warning("draining: finishing the accepted requests, refusing new ones")
        front.drain.remote().result()
        drained = True
    finally:
        if drained or not local:  # Serve lets the front finish writing its answers; another cluster keeps running
            serve.delete(APP_NAME)
        if local:
            ray.shutdown()
