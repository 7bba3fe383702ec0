"""How long a worker group takes to start, forked from the preloaded forkserver against spawned, and whether a
forked worker's image equals the engine's own: one isolated worker (the server's kind of group) on the first GPU,
which is the worker path a one-GPU machine has.

    python3 benchmarks/worker_start.py --out-dir $OUT      # on the GPU machine (PYTHONPATH=$PWD)
    python3 benchmarks/worker_start.py --device cpu        # anywhere

Each row is one Engine built and closed: the first forked group pays for starting the forkserver (its imports of
torch and the model code), the next ones only for the fork and the model's load; a spawned group pays for a whole
interpreter's imports every time. The forkserver is made unusable for the spawned rows by pointing the temporary
folder somewhere too deep for its socket, as ``worker_context`` checks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from paradit import Engine, GenerationRequest
from paradit.worker import worker_context

REQUEST = GenerationRequest(prompt="a lighthouse on a cliff at dusk", height=256, width=256, steps=4, seed=7)


def timed_group(model: str, device: str) -> tuple[float, float, torch.Tensor]:
    """Seconds to build the isolated engine (the group ready), seconds for the request, and its pixels."""
    start = time.perf_counter()
    with Engine(model, device=device, dtype="fp32", isolate=True) as engine:
        ready = time.perf_counter()
        pixels = engine.generate(REQUEST).pixels
        done = time.perf_counter()
    return ready - start, done - ready, pixels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux2-tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()

    own = Engine(args.model, device=args.device, dtype="fp32").generate(REQUEST).pixels
    rows = []
    deep = Path(tempfile.mkdtemp()) / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    for method in ("forkserver", "spawn"):
        if method == "spawn":
            tempfile.tempdir = str(deep)
        assert worker_context(torch.device(args.device).type).get_start_method() == method
        for attempt in range(args.repeats):
            start_s, request_s, pixels = timed_group(args.model, args.device)
            diff = (pixels - own).abs().max().item()
            rows.append(
                dict(
                    method=method,
                    group=attempt + 1,
                    start_s=round(start_s, 2),
                    request_s=round(request_s, 3),
                    max_diff=diff,
                )
            )
    tempfile.tempdir = None

    environment = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "cpus": os.cpu_count(),
        "model": args.model,
    }
    print(f"{environment}")
    print(f"{'start method':<12}  {'group':>5}  {'start s':>8}  {'request s':>9}  max diff against the engine's own")
    for row in rows:
        print(
            f"{row['method']:<12}  {row['group']:>5}  {row['start_s']:>8.2f}  {row['request_s']:>9.3f}  "
            f"{row['max_diff']:.3g}"
        )
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "worker_start.json").write_text(json.dumps({"environment": environment, "rows": rows}))


if __name__ == "__main__":
    main()
