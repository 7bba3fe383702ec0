"""Ray Serve replicas against ``paradit serve`` with the same groups: for 1 and N groups of ``--group-size`` GPUs,
``paradit serve --gpus N*G --group-size G`` and ``paradit serve --ray --replicas N --gpus-per-replica G`` (a local Ray
started by it), each its own process. For each it reports the latency of one request at a time (the median of a few:
request sent to answer read, base64 image included) and requests per minute under a closed loop of two requests in
flight per group; the Ray rows add the proxy's cost over ``paradit serve``'s latency (goal: at most 5%) and the
speed-up of N replicas over one.

    python benchmarks/ray_replicas.py --model flux2-klein-4b --load-format dummy --groups 1 8   # 8 GPUs, 1 each
    python benchmarks/ray_replicas.py --model flux2-klein-4b --load-format dummy --groups 1 2 --group-size 4
    python benchmarks/ray_replicas.py --tiny   # CPU self-check: tiny FLUX.2, groups of one process, 1 and 2 groups

Prints a table and writes ``ray_replicas_<model>.json`` under ``--out-dir`` (default ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402

START_S = 1200  # loading a full-size model in every group, Ray's start included
PROMPT = "a lighthouse on a cliff at dusk"
# The line each server prints once it serves, with its address.
STARTED = re.compile(r"(?:Uvicorn running on|paradit: serving \S+ on) (http://[\d.]+:\d+)")


class Server:
    """A ``paradit serve`` command in a process of its own until ``stop`` (SIGTERM: it drains, then ends)."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        deadline, self.url = time.monotonic() + START_S, None
        while self.url is None and time.monotonic() < deadline and self.process.poll() is None:
            line = self.process.stdout.readline()
            self.log.append(line)
            found = STARTED.search(line)
            self.url = found and found[1]
        if self.url is None:
            self.stop()
            raise SystemExit(f"{' '.join(command)} did not start:\n" + "".join(self.log[-30:]))
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def commands(args: argparse.Namespace, groups: int) -> dict[str, list[str]]:
    common = [sys.executable, "-m", "paradit", "serve", "--model", args.model, "--load-format", args.load_format]
    common += ["--port", "0", "--max-queue", "1000", "--timeout", "3600"]
    common += ["--device", args.device] if args.device else []
    size = args.group_size
    return {
        "paradit serve": [*common, "--gpus", str(groups * size), "--group-size", str(size)],
        "ray": [*common, "--ray", "--replicas", str(groups), "--gpus-per-replica", str(size)],
    }


def payload(args: argparse.Namespace, seed: int) -> dict:
    return {
        "prompt": PROMPT,
        "size": f"{args.size}x{args.size}",
        "seed": seed,
        **({"steps": args.steps} if args.steps else {}),
    }


def one_at_a_time(url: str, args: argparse.Namespace) -> float:
    """The median seconds of ``--single`` requests sent one after another (after one to warm the path)."""
    times = []
    with httpx.Client(base_url=url, timeout=3600) as client:
        for seed in range(args.single + 1):
            start = time.perf_counter()
            answer = client.post("/v1/images/generations", json=payload(args, seed))
            answer.raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def closed_loop(url: str, args: argparse.Namespace, in_flight: int) -> tuple[float, int]:
    """(requests per minute, failures) for ``--requests`` requests, ``in_flight`` of them out at any time."""
    seeds = iter(range(1000, 1000 + args.requests))
    failures = 0

    async def sender(client: httpx.AsyncClient) -> None:
        nonlocal failures
        for seed in seeds:
            answer = await client.post("/v1/images/generations", json=payload(args, seed))
            failures += answer.status_code != 200

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(sender(client) for _ in range(in_flight)))
        return 60 * args.requests / (time.perf_counter() - start), failures


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for groups in args.groups:
        for kind, command in commands(args, groups).items():
            server = Server(command)
            try:
                latency = one_at_a_time(server.url, args)
                per_minute, failures = asyncio.run(closed_loop(server.url, args, 2 * groups))
            finally:
                server.stop()
            rows.append(
                {"server": kind, "groups": groups, "latency_s": latency, "per_minute": per_minute, "failed": failures}
            )
            print(f"{kind}, {groups} group(s): {latency:.3f} s alone, {per_minute:.1f} requests/min", flush=True)
    plain = {row["groups"]: row for row in rows if row["server"] == "paradit serve"}
    first = {row["server"]: row["per_minute"] for row in rows if row["groups"] == args.groups[0]}
    for row in rows:
        row["proxy_cost"] = row["latency_s"] / plain[row["groups"]]["latency_s"] - 1 if row["server"] == "ray" else None
        row["speedup"] = row["per_minute"] / first[row["server"]]
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux2-klein-4b")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    parser.add_argument("--groups", type=int, nargs="+", default=[1], help="group counts to compare (1 and N)")
    parser.add_argument("--group-size", type=int, default=1, help="GPUs a group (a replica) runs over")
    parser.add_argument("--size", type=int, default=1024, help="image height and width")
    parser.add_argument("--steps", type=int, help="default: the model's")
    parser.add_argument("--single", type=int, default=5, help="requests timed one at a time")
    parser.add_argument("--requests", type=int, default=40, help="requests in the closed loop")
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="CPU self-check: flux2-tiny, 1 and 2 groups, 32 px")
    parser.add_argument("--out-dir", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if args.tiny:
        args.model, args.load_format, args.device, args.size, args.groups = "flux2-tiny", "auto", "cpu", 32, [1, 2]
        args.steps, args.single, args.requests = args.steps or 2, 3, min(args.requests, 12)
    return args


def main() -> int:
    args = parse_args()
    rows = measure(args)
    print()
    print_table(
        rows,
        [
            ("server", "server", "s"),
            ("groups", "groups", "d"),
            ("latency_s", "one request s", ".3f"),
            ("proxy_cost", "over paradit serve", ".1%"),
            ("per_minute", "requests/min", ".1f"),
            ("speedup", "vs first count", ".2f"),
            ("failed", "failed", "d"),
        ],
    )
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else None
    environment = {"torch": torch.__version__, "gpu": gpu, "python": platform.python_version()}
    write_json(
        args.out_dir,
        f"ray_replicas_{Path(args.model).name}.json",
        {"env": environment, "args": vars(args), "rows": rows},
    )
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
