"""What Qwen-Image 2.1's prefix encode (its prompt and condition images through every block at t = 0, once per
request) costs beside a denoise step, with random weights: the transformer alone, at one output size with 0, 1 and 3
condition images of the same size. Under Ulysses and USP each rank runs the prefix encode whole (it is once per
request; Ring alone splits it), while its step is about 1 / degree of the one-process step: the table gives the
encode against one process's step and against a sequence rank's share of it (``--degree``).

    python benchmarks/qwen_image21_prefix_cost.py --out-dir $OUT                 # full size, bf16, on the GPU
    python benchmarks/qwen_image21_prefix_cost.py --tiny --device cpu --size 256  # the tiny shape, on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, init_dummy_weights, print_table, write_json  # noqa: E402
from paradit.families.qwen_image21.latents import TOKEN_PIXELS  # noqa: E402
from paradit.families.qwen_image21.model import TOKENS_PER_SLOT, QwenImage21Config, QwenImage21Transformer  # noqa: E402
from paradit.families.qwen_image21.presets import QWEN_IMAGE21_TRANSFORMER  # noqa: E402

# The tests' tiny shape, widened to 4 heads and 4 blocks so the CPU figures are not all overhead.
TINY = {
    "num_layers": 4,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "context_in_dim": 64,
    "axes_dims_rope": [8, 12, 12],
}
PROMPT_TOKENS = 128  # a long-ish prompt after the system turn

COLUMNS = [
    ("references", "refs", "d"),
    ("prefix_tokens", "prefix tokens", "d"),
    ("target_tokens", "target tokens", "d"),
    ("prefix_ms", "prefix encode ms", ".1f"),
    ("step_ms", "step ms", ".1f"),
    ("prefix_per_step", "encode / step", ".2f"),
    ("prefix_per_rank_step", "encode / a rank's step", ".2f"),
    ("share_of_request", "encode's share of a request", ".1%"),
]


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def measure(model: QwenImage21Transformer, references: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    side = args.size // TOKEN_PIXELS
    grids = ((side, side),) * references
    image_slots = side * side // TOKENS_PER_SLOT
    slots = torch.tensor([False] * PROMPT_TOKENS + [True] * image_slots * references, device=device)
    gen = torch.Generator(device).manual_seed(0)
    embeds = torch.randn(1, slots.shape[0], model.config.context_in_dim, generator=gen, device=device, dtype=dtype)
    condition = None
    if references:
        condition = torch.randn(1, references * side * side, 64, generator=gen, device=device, dtype=dtype)
    target = torch.randn(1, side * side, 64, generator=gen, device=device, dtype=dtype)
    timestep = torch.tensor([0.5], device=device)
    with torch.inference_mode():
        prefix = model.encode_prefix(embeds, slots, None, condition, grids)
        prefix_ms = timed_ms(lambda: model.encode_prefix(embeds, slots, None, condition, grids), device, args.repeats)
        step_ms = timed_ms(lambda: model(target, timestep, side, side, prefix), device, args.repeats)
    return dict(
        references=references,
        prefix_tokens=PROMPT_TOKENS + references * side * side,
        target_tokens=side * side,
        prefix_ms=prefix_ms,
        step_ms=step_ms,
        prefix_per_step=prefix_ms / step_ms,
        prefix_per_rank_step=prefix_ms / (step_ms / args.degree),
        share_of_request=prefix_ms / (prefix_ms + args.steps * step_ms / args.degree),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (the CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024, help="the output's and each condition image's side")
    parser.add_argument("--references", nargs="+", type=int, default=[0, 1, 3])
    parser.add_argument("--degree", type=int, default=2, help="the sequence degree a rank's step share is taken at")
    parser.add_argument("--steps", type=int, default=40, help="steps of a request (the base model's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = dict(QWEN_IMAGE21_TRANSFORMER, **(TINY if args.tiny else {}))
    with torch.device("meta"):
        model = QwenImage21Transformer(QwenImage21Config.from_dict(config)).eval()
    init_dummy_weights(model, device, dtype)
    env = environment() if device.type == "cuda" else {"device": "cpu", "threads": torch.get_num_threads()}
    print(env, flush=True)
    rows = [measure(model, count, args, device, dtype) for count in args.references]
    print_table(rows, COLUMNS)
    write_json(args.out_dir, "qwen_image21_prefix_cost.json", {"environment": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
