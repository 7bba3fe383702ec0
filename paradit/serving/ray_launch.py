"""``paradit serve --ray [ADDRESS]``: Ray (the cluster at ADDRESS, or an instance started here), ``ray_serve``'s
application on it at --host:--port, until a signal: the first drains (new requests get 503, the accepted ones finish)
and ends, a second ends at once. On the way out the application is deleted and a Ray started here stopped, its
processes with it (Ray ties them to this one's life as well)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

import ray
from ray import serve

from paradit.errors import InvalidRequest
from paradit.options import RAY_LOCAL, ServeSettings
from paradit.serving.ray_serve import APP_NAME, application

logger = logging.getLogger(__name__)


def free_port(host: str, port: int) -> int:
    """``port``, refused at once when in use (Ray Serve would only log it), or for 0 a free one (Serve takes none)."""
    from paradit.serving.launch import listen  # with the engine: a Ray started here settles the replicas' run first

    with listen(host, port) as listening:
        return listening.getsockname()[1]


def check_resources(settings: ServeSettings) -> None:
    """Refuse a replica the cluster has no room for, which Ray would otherwise wait for without end."""
    kind = "CPU" if settings.asked.device == "cpu" else "GPU"
    have, need = int(ray.cluster_resources().get(kind, 0)), settings.gpus_per_replica
    if have < need:
        hint = "; give --device cpu, or join nodes with GPUs" if kind == "GPU" else ""
        raise InvalidRequest(f"a replica reserves {need} {kind}(s) and this Ray cluster has {have}{hint}")


def local_room(settings: ServeSettings) -> dict[str, int]:
    """A Ray started here on the CPU counts a CPU a replica process, however many cores there are, as ``paradit serve
    --device cpu --gpus N`` runs N processes on any machine."""
    if settings.ray != RAY_LOCAL or settings.asked.device != "cpu":
        return {}
    processes = settings.gpus_per_replica * (settings.max_replicas or settings.replicas or 1)
    return {"num_cpus": max(os.cpu_count() or 1, processes)}


def serve_on_ray(settings: ServeSettings, log_level: str = "info") -> None:
    settings.check_replicas()
    host, port = settings.host, settings.port
    if settings.ray == RAY_LOCAL:
        port = free_port(host, port)
        from paradit.settings import settle

        # This host's GPUs are the replicas': what settle refuses is refused before Ray starts.
        settle(dataclasses.replace(settings.asked, gpus=settings.gpus_per_replica))
    ray.init(address=settings.ray, include_dashboard=False, logging_level=log_level.upper(), **local_room(settings))
    try:
        check_resources(settings)
        serve.start(http_options={"host": host, "port": port})
        # A cluster whose Serve already runs keeps its own address; Ray has no public call that says which.
        http = serve.context._get_global_client().http_config
        serve.run(application(settings), name=APP_NAME, route_prefix="/", blocking=False)
        where = ray.get_runtime_context().gcs_address
        print(f"paradit: serving {settings.asked.model} on http://{http.host}:{http.port} (Ray at {where})", flush=True)
        wait_for_signal()
        logger.warning("draining: finishing the accepted requests, refusing new ones")
        serve.get_app_handle(APP_NAME).drain.remote().result(timeout_s=settings.timeout_s)
    finally:
        try:
            serve.delete(APP_NAME)
            if settings.ray == RAY_LOCAL:
                serve.shutdown()
        finally:
            ray.shutdown()


def wait_for_signal() -> None:
    """Return at the first SIGTERM, SIGINT or SIGHUP (forwarded as SIGTERM by the command line); a second one raises
    KeyboardInterrupt, ending the drain."""
    stop = threading.Event()

    def first(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, first)
    while not stop.wait(0.5):  # a timed wait: the signal's handler runs between two
        pass
