"""What step caching saves on one GPU, through the engine, with random full-size weights (dummy load): the whole
denoise of each model at its default steps uncached, and with caches whose skip pattern is fixed whatever the weights
(random weights make a threshold's decisions meaningless):

- ``mag every other``: MagCache with a flat curve, one skip at most: every other step after the first 4 skips the
  blocks (Wan: each expert counts its own steps, so the low-noise expert starts its own 4);
- ``taylorseer every other``: the first 4 steps computed, then every other one predicted (no block, no head);
- ``first-block never``: the head block, its statistic and the decision every step, never skipping: its step over the
  uncached one is what deciding costs;
- ``first-block always``: every step after the first skips all but the head block: the cost of a skipped step.

Quality needs real weights: where they exist, compare the cached image with the uncached one of the same seed
(``paradit generate --cache first-block --cache-threshold 0.08 --seed 0`` against the run without ``--cache``).

    python benchmarks/step_cache.py --models flux2-dev --out-dir $OUT
    python benchmarks/step_cache.py --models wan2.2-t2v-a14b --caches none "mag every other" --out-dir $OUT
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, write_json  # noqa: E402
from paradit.engine import Engine  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.request import GenerationRequest, StepCacheConfig  # noqa: E402

COLUMNS = [
    ("model", "model", "s"),
    ("cache", "cache", "s"),
    ("steps", "steps", "d"),
    ("skipped", "skipped", "d"),
    ("denoise_s", "denoise s", ".2f"),
    ("speedup", "speedup", ".2f"),
    ("step_ms", "median step ms", ".1f"),
    ("decision_ms", "decision ms/step", ".2f"),
    ("peak_gib", "peak GiB", ".1f"),
]
SIZES = {"wan": {"height": 480, "width": 832, "frames": 81}}


def caches(steps: int) -> dict[str, StepCacheConfig | None]:
    return {
        "none": None,
        "mag every other": StepCacheConfig(
            "mag", threshold=1.0, max_skip_steps=1, retention_ratio=4 / steps, mag_ratios=(1.0,)
        ),
        "taylorseer every other": StepCacheConfig("taylorseer", cache_interval=2, disable_cache_before_step=4),
        "first-block never": StepCacheConfig("first-block", threshold=0.0),
        "first-block always": StepCacheConfig("first-block", threshold=1e9),
    }


def bench_model(name: str, args) -> list[dict]:
    spec = PRESETS[name]
    steps = args.steps or spec.steps
    size = SIZES.get(spec.family, {"height": 1024, "width": 1024})
    negative = " " if spec.family == "qwen_image" else None
    options = ExecutionOptions(quantize=args.quantize, compile=True)
    rows: list[dict] = []
    with Engine(name, device="cuda", dtype="bf16", load_format="dummy", options=options) as engine:
        base = dict(prompt="a lighthouse on a cliff at dusk", seed=0, negative_prompt=negative, **size)
        engine.generate(GenerationRequest(**base, steps=2))  # compiles the blocks for this sequence
        for label, cache in caches(steps).items():
            if label not in args.caches:
                continue
            torch.cuda.reset_peak_memory_stats()
            timings = engine.generate(GenerationRequest(**base, steps=steps, cache=cache)).timings
            record = timings.features.get("step_cache")  # none without a cache
            rows.append(
                dict(
                    model=name,
                    cache=label,
                    steps=steps,
                    skipped=record.skipped_steps if record else 0,
                    denoise_s=sum(timings.step_ms) / 1000,
                    step_ms=timings.median_step_ms,
                    peak_gib=timings.peak_memory_bytes / 2**30,
                    step_ms_all=timings.step_ms,
                )
            )
            plain = rows[0]
            rows[-1]["speedup"] = plain["denoise_s"] / rows[-1]["denoise_s"]
            rows[-1]["decision_ms"] = rows[-1]["step_ms"] - plain["step_ms"] if label == "first-block never" else None
            print_table(rows[-1:], COLUMNS)
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flux2-dev"])
    parser.add_argument("--steps", type=int, help="denoise steps (default: each model's)")
    parser.add_argument("--caches", nargs="+", default=list(caches(28)), help="which of the cases to run")
    parser.add_argument("--quantize", default="fp8", choices=["none", "fp8"])
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    env = environment()
    print(env, flush=True)
    rows = [row for name in args.models for row in bench_model(name, args)]
    print()
    print_table(rows, COLUMNS)
    write_json(args.out_dir, "step_cache.json", {"environment": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
