"""One Qwen-Image 2.1 denoise step on one GPU, the prefix cached: paradit (bf16 and FP8) against diffusers'
``QwenImage21Transformer2DModel`` (bf16), both compiled, on the same random full-size weights.

Cases: 1024x1024 and 2048x2048 without references, and 1024x1024 with 1 and 3 references of 1024x1024 (each 4,096
prefix tokens, as the pipeline reads a reference at about ``output_resolution`` squared). The diffusers model is built
on the meta device and handed paradit's tensors (identical parameter names): one copy of the bf16 weights. Each side
runs its prefix once per case (paradit ``encode_prefix``, diffusers its ``extract`` step) and then times its cached
step (``kv_cache_mode="cached"``, as its pipeline runs steps 2 onwards); both prefix times are reported beside. FP8
converts paradit's block linears in place after the bf16 cases, then times every case again. Both sides compile each
block (``dynamic=False``), as ``paradit.compile.compile_blocks`` does; diffusers' model declares no repeated blocks.

What the prompt encoder would give is random embeddings of its lengths: the prompt's tokens after the system turn
(``TEXT_TOKENS``), and per reference its numbered marker (``MARKER_TOKENS``) and its 2x2-token slots.

    python benchmarks/qwen_image21_step.py --out-dir $OUT                 (every case, ~6 minutes on an H100)
    python benchmarks/qwen_image21_step.py --cases 1024:0 1024:3 --out-dir $OUT
    python benchmarks/qwen_image21_step.py --tiny --device cpu            (a tiny model, both sides, seconds)

Goals (issue 52): paradit's compiled step at most diffusers' on every row (diffusers compiled bf16 on an H100: 120.3 ms
at 1024^2, 138.5 / 171.7 ms with 1 / 3 references, 657 ms at 2048^2), and 3 references at most 1.6x none.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import init_dummy_weights, median_ms, print_table, quantize_fp8, write_json  # noqa: E402
from benchmarks.edit_step import environment  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.qwen_image21.model import (  # noqa: E402
    TOKENS_PER_SLOT,
    QwenImage21Config,
    QwenImage21Prefix,
    QwenImage21Transformer,
)
from paradit.layers.prefix_attention import keep_whole  # noqa: E402

PRESET = "qwen-image-2.1"
CASES = [(1024, 0), (1024, 1), (1024, 3), (2048, 0)]
TINY_CASES = [(64, 0), (64, 1), (64, 3), (128, 0)]
# A tiny model of the preset's layout (head dim 16 split 4/6/6), for --tiny.
TINY_TRANSFORMER = {
    **PRESETS[PRESET].transformer,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
# Qwen3-VL's tokens after the dropped system turn: "<|im_start|>user\n" (3), a prompt of about a sentence, and
# "<|im_end|>\n<|im_start|>assistant\n" (5). Each reference adds "<imageN><|vision_start|>", its slots,
# "<|vision_end|>" and the space between markers.
HEAD_TOKENS, TEXT_TOKENS, MARKER_TOKENS = 3, 32, 8
TOKEN_PIXELS = 16
MID_SIGMA = 0.5
GPU_DEADLINE_S = 480  # no case starts past it on a GPU without --deadline-s, so the command ends within 10 minutes

COLUMNS = [
    ("size", "size", "d"),
    ("refs", "refs", "d"),
    ("precision", "paradit", "s"),
    ("prefix_tokens", "prefix tokens", "d"),
    ("target_tokens", "target tokens", "d"),
    ("paradit_ms", "paradit ms/step", ".1f"),
    ("diffusers_ms", "diffusers ms/step", ".1f"),
    ("ratio", "paradit/diffusers", ".2f"),
    ("vs_no_refs", "x no refs", ".2f"),
    ("paradit_prefix_ms", "paradit prefix ms", ".1f"),
    ("diffusers_prefix_ms", "diffusers extract ms", ".1f"),
    ("rel_l2", "rel L2", ".1e"),
    ("error", "note", "s"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def slot_layout(refs: int, side: int, text_tokens: int) -> torch.Tensor:
    """(slots,) True at the references' slots: [head | marker, slots per reference | the prompt's tokens]."""
    slots = (side // TOKEN_PIXELS) ** 2 // TOKENS_PER_SLOT
    parts = [torch.zeros(HEAD_TOKENS, dtype=torch.bool)]
    for _ in range(refs):
        parts += [torch.zeros(MARKER_TOKENS, dtype=torch.bool), torch.ones(slots, dtype=torch.bool)]
    parts.append(torch.zeros(text_tokens - HEAD_TOKENS, dtype=torch.bool))
    return torch.cat(parts)


def case_inputs(config: QwenImage21Config, size: int, refs: int, text_tokens: int, device: torch.device) -> dict:
    """The encoder's states and slots, the references' packed latents and grids, the target's latents (bf16)."""
    side = size // TOKEN_PIXELS
    reference_side = 1024 // TOKEN_PIXELS if size >= 1024 else side
    slots = slot_layout(refs, reference_side * TOKEN_PIXELS, text_tokens).to(device)
    gen = torch.Generator(device).manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).bfloat16()

    return dict(
        embeds=draw(1, slots.shape[0], config.context_in_dim),
        slots=slots,
        condition=draw(1, refs * reference_side**2, config.in_channels) if refs else None,
        grids=((reference_side, reference_side),) * refs,
        target=draw(1, side * side, config.in_channels),
        rows=side,
        cols=side,
    )


def step_inputs(config: QwenImage21Config, height: int, width: int, text_len: int, device: torch.device) -> dict:
    """One cached step's arguments of text-to-image (the planner's model facts count it): the target's latents and
    a prefix of ``text_len`` text tokens' keys and values in every block (zeros broadcast: no memory)."""
    rows, cols = height // TOKEN_PIXELS, width // TOKEN_PIXELS
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    zeros = torch.zeros(1, 1, 1, 1, device=device, dtype=torch.bfloat16).expand(1, text_len, heads, head_dim)
    return dict(
        hidden_states=torch.randn(1, rows * cols, config.in_channels, device=device).bfloat16(),
        timestep=torch.full((1,), MID_SIGMA, device=device, dtype=torch.bfloat16),
        rows=rows,
        cols=cols,
        prefix=QwenImage21Prefix(
            {index: keep_whole(zeros, zeros, None) for index in range(config.num_layers)}, text_len
        ),
    )


def diffusers_model(spec_config: dict, ours: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope, QwenImage21TemporalTimesteps

    with torch.device("meta"):
        reference = QwenImage21Transformer2DModel(**spec_config)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    # Its rotary tables (plain attributes) and timestep frequencies (a buffer it does not save) are made in
    # __init__: rebuilt off the meta device.
    reference.pos_embed = QwenImage21Rope(theta=10000, axes_dim=list(spec_config["axes_dims_rope"]))
    with device:
        reference.time_text_embed.time_proj = QwenImage21TemporalTimesteps(timestep_dim=256)
    return reference.eval()


def diffusers_call(reference, given: dict, sigma: float, cache, mode: str) -> torch.Tensor:
    """diffusers' pipeline's call: condition latents then the target's, the image slots with the target's appended."""
    hidden = given["target"]
    if given["condition"] is not None:
        hidden = torch.cat([given["condition"], hidden], dim=1)
    target_slots = torch.ones(given["rows"] * given["cols"] // TOKENS_PER_SLOT, dtype=torch.bool, device=hidden.device)
    shapes = [[*((1, rows, cols) for rows, cols in given["grids"]), (1, given["rows"], given["cols"])]]
    out = reference(
        hidden_states=hidden,
        encoder_hidden_states=given["embeds"],
        timestep=torch.full((1,), sigma, device=hidden.device, dtype=hidden.dtype),
        img_shapes=shapes,
        img_mask=torch.cat([given["slots"], target_slots])[None],
        kv_cache=cache,
        kv_cache_mode=mode,
        return_dict=False,
    )[0]
    return out[:, -given["target"].shape[1] :]


def run_case(ours, reference, size: int, refs: int, precision: str, args, device) -> dict:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    given = case_inputs(ours.config, size, refs, TEXT_TOKENS, device)
    sigma = torch.full((1,), MID_SIGMA, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():

        def prefix_ours():
            return ours.encode_prefix(given["embeds"], given["slots"], None, given["condition"], given["grids"])

        prefix = prefix_ours()
        row = dict(size=size, refs=refs, precision=precision, target_tokens=given["target"].shape[1])
        row["prefix_tokens"] = prefix.kv[0].key.shape[1]
        row["paradit_ms"] = median_ms(
            lambda: ours(given["target"], sigma, given["rows"], given["cols"], prefix), device, args.warmup, args.iters
        )
        row["paradit_prefix_ms"] = median_ms(prefix_ours, device, args.warmup, args.iters)
        log(f"  paradit {precision}: {row['paradit_ms']:.1f} ms a step, {row['paradit_prefix_ms']:.1f} ms the prefix")
        if reference is None:
            return row
        cache = QwenImage21KVCache(len(reference.transformer_blocks))

        # Each extract step stores the prefix afresh (the cache's layers are overwritten).
        extract = lambda: diffusers_call(reference, given, MID_SIGMA, cache, "extract")  # noqa: E731
        row["diffusers_prefix_ms"] = median_ms(extract, device, args.warmup, args.iters)
        theirs = diffusers_call(reference, given, MID_SIGMA, cache, "cached")
        row["diffusers_ms"] = median_ms(
            lambda: diffusers_call(reference, given, MID_SIGMA, cache, "cached"), device, args.warmup, args.iters
        )
        row["ratio"] = row["paradit_ms"] / row["diffusers_ms"]
        mine = ours(given["target"], sigma, given["rows"], given["cols"], prefix).float()
        row["rel_l2"] = ((mine - theirs.float()).norm() / theirs.float().norm()).item()
        log(f"  diffusers: {row['diffusers_ms']:.1f} ms a step (rel L2 against paradit {row['rel_l2']:.1e})")
    return row


def parse_case(text: str) -> tuple[int, int]:
    size, _, refs = text.partition(":")
    return int(size), int(refs or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=None, help="SIZE:REFS (default: every case)")
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=None, help="default both on GPUs")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on GPUs")
    parser.add_argument("--iters", type=int, default=None, help="timed runs, median (10; --tiny 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first, compiling (3; --tiny 0)")
    parser.add_argument(
        "--deadline-s", type=float, default=None, help=f"no case starts past it (GPU: {GPU_DEADLINE_S})"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same layout (a CPU check)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    cases = args.cases or (TINY_CASES if args.tiny else CASES)
    precisions = args.precisions or (["bf16", "fp8"] if gpu else ["bf16"])
    args.iters = args.iters or (1 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    compiled = gpu if args.compile is None else args.compile
    deadline = args.deadline_s if args.deadline_s is not None else (GPU_DEADLINE_S if gpu else None)
    env = environment(device)
    log(f"{env}, compiled {compiled}")
    started = time.perf_counter()

    config_dict = TINY_TRANSFORMER if args.tiny else PRESETS[PRESET].transformer
    with torch.device("meta"):
        ours = QwenImage21Transformer(QwenImage21Config.from_dict(config_dict))
    init_dummy_weights(ours, device, torch.bfloat16)
    ours.eval()
    reference = diffusers_model(config_dict, ours, device)
    if compiled:
        compile_blocks(ours)
        for block in reference.transformer_blocks:
            block.compile(dynamic=False)
    rows: list[dict] = []
    payload = {"environment": env, "args": {**vars(args), "cases": cases, "compiled": compiled}, "rows": rows}
    for precision in precisions:
        if precision == "fp8":
            quantize_fp8(ours, device, FAMILIES["qwen_image21"].keep_high_precision)
            reference = None  # diffusers runs bf16 only: its rows are the bf16 pass's
        for size, refs in cases:
            if deadline is not None and time.perf_counter() - started > deadline:
                log(f"{size}^2 refs={refs} {precision}: skipped, past --deadline-s {deadline:g}")
                rows.append(dict(size=size, refs=refs, precision=precision, error="skipped: past --deadline-s"))
                continue
            log(f"{size}^2 refs={refs} {precision}")
            try:
                rows.append(run_case(ours, reference, size, refs, precision, args, device))
            except Exception as exc:  # noqa: BLE001 - one case failing (memory) must not lose the others' figures
                traceback.print_exc()
                rows.append(dict(size=size, refs=refs, precision=precision, error=f"{type(exc).__name__}: {exc}"))
            write_json(args.out_dir, "qwen_image21_step.json", payload)
    # The prefix cache's goal: a step with references against one without, of the same size and precision.
    without = {(r["size"], r["precision"]): r["paradit_ms"] for r in rows if r["refs"] == 0 and "paradit_ms" in r}
    for row in rows:
        if "paradit_ms" in row and (row["size"], row["precision"]) in without:
            row["vs_no_refs"] = row["paradit_ms"] / without[row["size"], row["precision"]]
    print()
    print_table(rows, COLUMNS)
    print("ms/step: the cached step (the target's tokens over the prefix's keys and values); prefix: once a request.")
    write_json(args.out_dir, "qwen_image21_step.json", payload)


if __name__ == "__main__":
    main()
