"""Replicas on Ray Serve against ``paradit serve`` over the same groups. For each replica count (1, and every GPU in
groups of ``--gpus-per-replica``), both servers start as their own process on one port: ``paradit serve --gpus N*G
--group-size G`` and ``paradit serve --ray --replicas N --gpus-per-replica G`` (a Ray started by the command). Each
answers one request at a time (the median, after one that warms the HTTP path), then a crowd of ``--requests``
sent at once, whose requests a minute and p50/p95 latency are reported. One request's latency on Ray against
``paradit serve``'s is what the front and Serve's proxy add; the crowd's requests a minute at N replicas against 1 is
the scaling.

    python benchmarks/ray_replicas.py --model flux2-klein-4b --load-format dummy --gpus-per-replica 1
    python benchmarks/ray_replicas.py --tiny    # CPU self-check: flux2-tiny, 1 and 2 replicas of one process each

Prints a table and writes ``ray_replicas_<model>.json`` under ``--out-dir`` (default ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402
from benchmarks.serve_load import (  # noqa: E402
    body,
    environment,
    percentile,
    run_schedule,
    stop_server,
    unloaded_latency,
)

START_S = 900  # loading a full-size model on every replica, compiling and warming up


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A ``paradit serve`` command in a process of its own, until ``stop``; ready once /health answers 200."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name, port = name, free_port()
        self.url = f"http://127.0.0.1:{port}"
        full = [sys.executable, "-m", "paradit", "serve", *command, "--host", "127.0.0.1", "--port", str(port)]
        self.process = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()
        deadline = time.monotonic() + START_S
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not start:\n" + "".join(self.log[-30:]))
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_server(self.process)


def commands(args: argparse.Namespace, replicas: int) -> dict[str, list[str]]:
    common = ["--model", args.model, "--load-format", args.load_format, "--timeout", "3600"]
    common += ["--max-queue", str(10 * args.requests), *(["--device", args.device] if args.device else [])]
    common += args.server_args.split()
    group = args.gpus_per_replica
    return {
        "paradit serve": [*common, "--gpus", str(replicas * group), "--group-size", str(group)],
        "ray": [*common, "--ray", "--replicas", str(replicas), "--gpus-per-replica", str(group)],
    }


def measure(args: argparse.Namespace, server: ServerProcess, replicas: int) -> dict:
    alone_s = unloaded_latency(server.url, args)
    crowd = [body(args, 20_000 + index) for index in range(args.requests)]
    results = asyncio.run(run_schedule(server.url, crowd, [0.0] * len(crowd)))
    ok = [result for result in results if result["status"] == 200]
    span = max((result["sent"] + result["latency"] for result in ok), default=0.0)
    latencies = [result["latency"] for result in ok]
    return {
        "server": server.name,
        "replicas": replicas,
        "gpus_per_replica": args.gpus_per_replica,
        "alone_s": alone_s,
        "sent": len(results),
        "ok": len(ok),
        "requests_per_min": 60 * len(ok) / span if span > 0 else None,
        "p50_s": percentile(latencies, 0.50),
        "p95_s": percentile(latencies, 0.95),
    }


def compare(rows: list[dict]) -> None:
    """Ray's one-request latency over ``paradit serve``'s at the same replicas, and each server's scaling."""
    by = {(row["server"], row["replicas"]): row for row in rows}
    for row in rows:
        serve_row, one = by.get(("paradit serve", row["replicas"])), by.get((row["server"], 1))
        row["alone_vs_serve"] = row["alone_s"] / serve_row["alone_s"] - 1 if serve_row else None
        rates = one and one["requests_per_min"] and row["requests_per_min"]
        row["scaling"] = row["requests_per_min"] / one["requests_per_min"] if rates else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux2-klein-4b")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    parser.add_argument("--gpus-per-replica", type=int, default=1)
    parser.add_argument("--replica-counts", type=int, nargs="+", help="default: 1 and every GPU's worth")
    parser.add_argument("--size", type=int, default=1024, help="image height and width")
    parser.add_argument("--steps", type=int, help="default: the model's")
    parser.add_argument("--requests", type=int, default=20, help="the crowd sent at once")
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--server-args", default="", help="more options for both servers, e.g. '--max-pixels 1100000'")
    parser.add_argument("--tiny", action="store_true", help="CPU self-check: flux2-tiny, 1 and 2 replicas, 32 px")
    parser.add_argument("--out-dir", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if args.tiny:
        args.model, args.load_format, args.device, args.size = "flux2-tiny", "auto", "cpu", 32
        args.steps, args.requests = args.steps or 2, min(args.requests, 8)
        args.replica_counts = args.replica_counts or [1, 2]
    if args.replica_counts is None:
        import torch

        lent = torch.cuda.device_count() // args.gpus_per_replica
        args.replica_counts = sorted({1, max(1, lent)})
    args.gpus = max(args.replica_counts) * args.gpus_per_replica  # for environment()
    return args


def main() -> int:
    args = parse_args()
    rows = []
    for replicas in args.replica_counts:
        for name, command in commands(args, replicas).items():
            server = ServerProcess(name, command)
            try:
                rows.append(measure(args, server, replicas))
            except httpx.HTTPStatusError as error:  # what the server answered and logged, not only its status
                raise SystemExit(f"{name}: {error}\n{error.response.text}\n" + "".join(server.log[-40:])) from None
            finally:
                server.stop()
            print(f"{name}, {replicas} replica(s): {rows[-1]['ok']}/{rows[-1]['sent']} ok", flush=True)
    compare(rows)
    print()
    print_table(
        rows,
        [
            ("server", "server", "s"),
            ("replicas", "replicas", "d"),
            ("gpus_per_replica", "GPUs each", "d"),
            ("alone_s", "one request s", ".3f"),
            ("alone_vs_serve", "vs paradit serve", "+.1%"),
            ("requests_per_min", "requests/min", ".1f"),
            ("scaling", "vs 1 replica", ".2f"),
            ("p50_s", "crowd p50 s", ".3f"),
            ("p95_s", "crowd p95 s", ".3f"),
            ("ok", "ok", "d"),
            ("sent", "sent", "d"),
        ],
    )
    write_json(args.out_dir, f"ray_replicas_{Path(args.model).name}.json", {"env": environment(args), "rows": rows})
    return 0 if all(row["ok"] == row["sent"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
