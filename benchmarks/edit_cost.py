"""What reference images cost an editing request on one GPU, end to end through the engine, with random full-size
weights (dummy load): text-to-image at 1024² against the same request with 1 and 3 references of 1024² each
(4096 more tokens each in every block's sequence). An edit-only checkpoint (Qwen-Image-Edit-2511) is set against
its text-to-image sibling's step (Qwen-Image: the same transformer), both with true CFG as their authors run them.
Per case: the median denoise step, the references' share of it (the step's growth over text-to-image), the prompt
encoding (which reads the images too for Qwen-Image-Edit), the time outside encoding, steps and decoding (the
references' VAE encode, mostly), and the request's latency at the model's default steps, projected from those
measured parts.

    python benchmarks/edit_cost.py --out-dir $OUT
    python benchmarks/edit_cost.py --models qwen-image-edit-2511 --out-dir $OUT
    python benchmarks/edit_cost.py --models flux2-klein-4b --quantize none --out-dir $OUT
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, write_json  # noqa: E402
from paradit.engine import Engine  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.options import ExecutionOptions  # noqa: E402
from paradit.request import GenerationRequest  # noqa: E402

COLUMNS = [
    ("model", "model", "s"),
    ("precision", "precision", "s"),
    ("references", "refs", "d"),
    ("tokens", "image tokens", "d"),
    ("step_ms", "step ms", ".1f"),
    ("reference_share", "refs' share", ".1%"),
    ("text_encode_s", "prompt encode s", ".3f"),
    ("encode_s", "refs encode s", ".3f"),
    ("total_s", "total s", ".2f"),
    ("steps", "steps", "d"),
    ("projected_s", "latency at default steps (projected) s", ".2f"),
    ("peak_gib", "peak GiB", ".1f"),
]


def reference(seed: int, side: int) -> Image.Image:
    coarse = np.random.default_rng(seed).integers(0, 256, (side // 32, side // 32, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC)


# Edit-only checkpoints, and the text-to-image model whose step is theirs without input images.
TEXT_TO_IMAGE = {"qwen-image-edit-2511": "qwen-image", "qwen-image-edit-2509": "qwen-image"}


def bench_model(name: str, args) -> list[dict]:
    rows: list[dict] = []
    if name in TEXT_TO_IMAGE:
        rows += bench_engine(TEXT_TO_IMAGE[name], [count for count in args.references if count == 0], args, rows)
        rows += bench_engine(name, [count for count in args.references if count], args, rows)
        return rows
    return bench_engine(name, args.references, args, rows)


def bench_engine(name: str, counts: list[int], args, earlier: list[dict]) -> list[dict]:
    """Rows for ``counts`` references; the references' share is against the text-to-image row among ``earlier``."""
    options = ExecutionOptions(quantize=args.quantize, compile=True)
    precision = args.quantize.replace("none", "bf16")
    plain_ms = next((row["step_ms"] for row in earlier if row["references"] == 0), None)
    rows = []
    # Qwen-Image guides only with a negative prompt; its authors pass " " when nothing is to be excluded.
    negative = " " if PRESETS[name].family == "qwen_image" else None
    with Engine(name, device="cuda", dtype="bf16", load_format="dummy", options=options) as engine:
        for count in counts:
            images = [reference(seed, args.size) for seed in range(count)] or None
            base = dict(
                prompt="the subject of the first image in the room of the second",
                height=args.size,
                width=args.size,
                image=images,
                seed=0,
                negative_prompt=negative,
            )
            engine.generate(GenerationRequest(**base, steps=2))  # compiles this sequence length's blocks
            torch.cuda.reset_peak_memory_stats()
            result = engine.generate(GenerationRequest(**base, steps=args.steps))
            timings = result.timings
            step_ms = timings.median_step_ms
            outside = timings.total_s - timings.text_encode_s - sum(timings.step_ms) / 1000 - timings.vae_decode_s
            rows.append(
                dict(
                    model=name,
                    precision=precision,
                    references=count,
                    tokens=(1 + count) * (args.size // 16) ** 2,
                    step_ms=step_ms,
                    encode_s=outside,
                    total_s=timings.total_s,
                    steps=args.steps,
                    peak_gib=timings.peak_memory_bytes / 2**30,
                    text_encode_s=timings.text_encode_s,
                    vae_decode_s=timings.vae_decode_s,
                )
            )
            plain_ms = step_ms if count == 0 else plain_ms
            rows[-1]["reference_share"] = 1 - plain_ms / step_ms if plain_ms and count else None
            fixed = timings.text_encode_s + outside + timings.vae_decode_s
            rows[-1]["projected_s"] = fixed + PRESETS[name].steps * step_ms / 1000
            print_table(rows[-1:], COLUMNS)
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flux2-dev"])
    parser.add_argument("--references", nargs="+", type=int, default=[0, 1, 3])
    parser.add_argument("--size", type=int, default=1024, help="the output's and each reference's side, pixels")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per case")
    parser.add_argument("--quantize", default="fp8", choices=["none", "fp8"])
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    env = environment()
    print(env, flush=True)
    rows = [row for name in args.models for row in bench_model(name, args)]
    print()
    print_table(rows, COLUMNS)
    write_json(args.out_dir, "edit_cost.json", {"environment": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
