"""The memory plan's estimate against the measured peak, on one GPU, per model and size (dummy weights).

For each case the engine runs one 2-step request (eager, or ``--compile``d); beside the run's peak
(``max_memory_allocated``) it measures each phase's working memory apart, as the peak above what was resident when
the phase began: the prompt encoding, every transformer forward, and the VAE decode. Those are what
``paradit/memory.py`` estimates per family (per token of the model's width, per decoded pixel), so the JSON is the
source of its coefficients. ``--cap`` runs each engine under a per-GPU cap (the 32 GB card emulated): the estimate then
also chooses the plan, as ``generate --max-gpu-memory`` does. ``--references N`` gives each request N condition images
of its output size (an editing model's input); the estimate is then sized for the request as the engine resolves it,
its references' tokens included.

    python benchmarks/memory_estimates.py --out-dir $OUT
    python benchmarks/memory_estimates.py --cases qwen-image-2.1 flux3-klein --references 3 --out-dir $OUT
    python benchmarks/memory_estimates.py --cases wan2.2-t2v-a14b --cap 32GiB --compile --out-dir $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

import numpy
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    environment,
    estimate,  # noqa: E402
    print_table,
    write_json,
)
from paradit import Engine, GenerationRequest  # noqa: E402
from paradit.errors import ParaditError  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.parallel import ParallelConfig  # noqa: E402

IMAGES = [
    "flux2-dev",
    "flux2-klein-4b",
    "flux2-klein-9b",
    "flux3-klein",
    "qwen-image",
    "qwen-image-2.1",
    "sd3.5-large",
    "sd3.5-medium",
    "z-image",
]
# (preset, quantize, swap experts, prompt-encoder placement, sizes as (width, height, frames))
CASES = [
    *[(name, quantize, False, "gpu", [(1024, 1024, None)]) for name in IMAGES for quantize in ("none", "fp8")],
    ("wan2.2-ti2v-5b", "fp8", False, "offload", [(832, 480, 81), (1280, 704, 81)]),
    ("wan2.2-t2v-a14b", "fp8", True, "offload", [(832, 480, 81), (1280, 720, 81)]),
]


class PhasePeaks:
    """The peak above its start of every call of the wrapped phases, and the whole run's peak kept across the resets
    each phase needs."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peaks, self.run_peak = device, {}, 0

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def measured(*args, **kwargs):
            self.run_peak = max(self.run_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            out = inner(*args, **kwargs)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.run_peak = max(self.run_peak, peak)
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak - start)
            return out

        setattr(owner, name, Delegating(inner, measured))


class Delegating:
    """``call`` in place of ``inner``, which still answers every attribute (a transformer's ``config``)."""

    def __init__(self, inner, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def random_images(count: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    """``count`` RGB images of uniform noise (the same for every case: a fixed seed)."""
    generator = numpy.random.default_rng(seed)
    return [Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=numpy.uint8)) for _ in range(count)]


def run_case(
    name: str,
    quantize: str,
    swap: bool,
    placement: str,
    sizes: list,
    cap: str | None,
    compiled: bool,
    references: int = 0,
) -> list[dict]:
    options = ExecutionOptions(quantize=quantize, compile=compiled, swap_experts=swap)
    rows = []
    try:
        engine = Engine(
            name,
            "cuda",
            "bf16",
            "dummy",
            options=options,
            max_gpu_memory=cap,
            text_encoder_placement=placement if cap is None else "auto",
        )
    except ParaditError as refused:
        return [{"model": name, "quantize": quantize, "refused": str(refused)}]
    pipeline, device = engine.pipeline, engine.device
    peaks = PhasePeaks(device)
    peaks.wrap(pipeline, "transformer", "transformer")
    for component, expert in pipeline.experts.items():
        peaks.wrap(expert, "forward", component)
    peaks.wrap(pipeline.vae, "decode", "vae_decode")
    peaks.wrap(pipeline, "encode", "encode")
    for width, height, frames in sizes:
        images = random_images(references, width, height) or None
        request = GenerationRequest(
            prompt="a fox in the snow", image=images, width=width, height=height, frames=frames, steps=2
        )
        # Sized as ``settings.settle`` sizes the request it is given: as resolved, with its references' tokens.
        try:
            resolved = engine.check(request)
        except ParaditError as refused:  # a model that takes no (or fewer) condition images
            rows.append({"model": name, "quantize": quantize, "references": references, "refused": str(refused)})
            continue
        sized = dataclasses.replace(
            engine.spec, width=resolved.width, height=resolved.height, frames=resolved.frames or engine.spec.frames
        )
        plan = estimate(
            sized,
            ParallelConfig(),
            engine.dtype,
            quantize == "fp8",
            engine.text_encoder_placement,
            engine.options.swap_experts,
            compiled,
            extra_tokens=resolved.reference_tokens,
        )
        peaks.peaks, peaks.run_peak = {}, 0
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result = engine.generate(resolved)
        peaks.run_peak = max(peaks.run_peak, torch.cuda.max_memory_allocated(device))
        rows.append(
            {
                "model": name,
                "quantize": quantize,
                "swap_experts": engine.options.swap_experts,
                "placement": engine.text_encoder_placement,
                "size": f"{width}x{height}" + (f"x{frames}" if frames else ""),
                "references": references,
                "estimate_gib": plan.total / 2**30,
                "estimate": dataclasses.asdict(plan),
                "measured_peak_gib": peaks.run_peak / 2**30,
                "phase_peaks": peaks.peaks,
                "step_ms": result.timings.step_ms,
                "seconds": time.perf_counter() - start,
                "cap": cap,
                "compiled": compiled,
            }
        )
        rows[-1]["over"] = rows[-1]["estimate_gib"] / rows[-1]["measured_peak_gib"] - 1
        print(rows[-1], flush=True)
    engine.close()
    del engine, pipeline
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="presets to run (default: all)")
    parser.add_argument("--cap", help="per-GPU cap, e.g. 32GiB (the plan is then the estimate's choice)")
    parser.add_argument("--compile", action="store_true", help="regional compilation (default: eager, the larger)")
    parser.add_argument("--quantize", choices=["none", "fp8"], help="every case in this precision (default: its own)")
    parser.add_argument(
        "--references", type=int, default=0, help="condition images of the output size in each request (default: 0)"
    )
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    rows = []
    for name, quantize, swap, placement, sizes in CASES:
        if not args.cases or name in args.cases:
            rows += run_case(
                name,
                args.quantize or quantize,
                swap,
                placement,
                sizes,
                args.cap,
                args.compile,
                args.references,
            )
            write_json(args.out_dir, "memory_estimates.json", {"environment": environment(), "rows": rows})
    columns = [
        ("model", "model", ""),
        ("quantize", "quantize", ""),
        ("size", "size", ""),
        ("references", "references", ""),
        ("compiled", "compiled", ""),
        ("estimate_gib", "estimate GiB", ".1f"),
        ("measured_peak_gib", "peak GiB", ".1f"),
        ("over", "over", ".1%"),
        ("refused", "refused", ""),
    ]
    print_table(rows, columns)


if __name__ == "__main__":
    main()
