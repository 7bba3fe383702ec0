"""One Wan 2.2 transformer forward on one GPU: paradit against diffusers' WanTransformer3DModel, same weights, same run.

Full-size architectures with random weights: A14B's expert (both experts are this architecture) at 832x480x81 and
1280x720x81, TI2V-5B at 1280x704x121, one sample (a guided step is two of these, or one batch of two). Variants:
diffusers eager and compiled (``compile_repeated_blocks``), paradit compiled (its regional compilation) in bf16 and
with FP8 linears. Prints ms per forward, TFLOP/s and MFU against the bf16 matmul rate measured in the same run, the
share of the step that the self-attention kernel takes (one SDPA call at the step's shape, timed alone, times the
blocks), peak memory, and each variant's relative L2 against diffusers eager.

    python benchmarks/wan_step.py --out-dir $OUT
    python benchmarks/wan_step.py --workloads a14b-480p ti2v-5b-704p --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    announce_device,
    init_dummy_weights,
    print_table,
    quantize_fp8,
    time_cuda_ms,
    write_json,
)
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.wan.latents import vae_factors  # noqa: E402
from paradit.families.wan.model import WanConfig, WanTransformer, unpatchify  # noqa: E402

TEXT_TOKENS = 512  # umT5's padded prompt
# name -> (preset, height, width, frames, exact TFLOP of one forward counted with FlopCounterMode over diffusers'
# model: shared/models/configs.json; None where it was not counted)
WORKLOADS = {
    "a14b-480p": ("wan2.2-t2v-a14b", 480, 832, 81, None),
    "a14b-720p": ("wan2.2-t2v-a14b", 720, 1280, 81, 6523.43659200512),
    "ti2v-5b-704p": ("wan2.2-ti2v-5b", 704, 1280, 121, 517.007759376384),
}
# The 720p figure scaled by tokens (linear layers) and tokens squared (attention), with its attention share 0.7226.
A14B_720P_TOKENS, A14B_720P_ATTENTION_SHARE = 75_600, 0.7225841446848695


def scaled_a14b_tflop(tokens: int) -> float:
    linear = WORKLOADS["a14b-720p"][4] * (1 - A14B_720P_ATTENTION_SHARE) * tokens / A14B_720P_TOKENS
    attention = WORKLOADS["a14b-720p"][4] * A14B_720P_ATTENTION_SHARE * (tokens / A14B_720P_TOKENS) ** 2
    return linear + attention


def build_paradit(workload: str, device: torch.device):
    """paradit's transformer of ``workload``'s preset with random weights, and one forward's inputs."""
    spec = PRESETS[WORKLOADS[workload][0]]
    with torch.device("meta"):
        ours = WanTransformer(WanConfig.from_dict(spec.transformer))
    init_dummy_weights(ours, device, torch.bfloat16)
    return spec, ours.eval(), *forward_inputs(workload, ours.config, device)


def forward_inputs(workload: str, config: WanConfig, device: torch.device):
    """((latents, timestep, text), token grid, tokens) of one forward at ``workload``'s size."""
    spec, height, width, frames = PRESETS[WORKLOADS[workload][0]], *WORKLOADS[workload][1:4]
    temporal, spatial = vae_factors(spec.vae)
    gen = torch.Generator(device).manual_seed(0)
    shape = (1, config.in_channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)
    latents = torch.randn(shape, device=device, generator=gen).bfloat16()
    text = torch.randn(1, TEXT_TOKENS, config.text_dim, device=device, generator=gen).bfloat16()
    grid = config.token_grid(*shape[2:])
    tokens = grid[0] * grid[1] * grid[2]
    per_token = spec.details.expand_timesteps
    timestep = torch.full((1, tokens) if per_token else (1,), 500.0, device=device)
    return (latents, timestep, text), grid, tokens


def build(workload: str, device: torch.device):
    """paradit's transformer with random weights and diffusers' on the very same tensors, and one forward's inputs."""
    from diffusers import WanTransformer3DModel

    spec, ours, inputs, grid, tokens = build_paradit(workload, device)
    with torch.device("meta"):
        reference = WanTransformer3DModel(**spec.transformer)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    rope = reference.rope  # its tables are buffers outside the state dict: built again where the weights are
    with torch.device(device):
        reference.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    reference.eval()
    return spec, ours, reference, inputs, grid, tokens


def attention_ms(spec, tokens: int, iters: int) -> float:
    """One self-attention call at the step's shape, SDPA's own kernel choice (as both implementations make it)."""
    heads, head_dim = spec.transformer["num_attention_heads"], spec.transformer["attention_head_dim"]
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return time_cuda_ms(lambda: sdpa(q, k, v), warmup=1, iters=iters)


def bench(workload: str, args, matmul_tflops: float) -> list[dict]:
    spec, ours, reference, (latents, timestep, text), grid, tokens = build(workload, torch.device("cuda"))
    tflop = WORKLOADS[workload][4] or (scaled_a14b_tflop(tokens) if "a14b" in workload else None)
    patch = ours.config.patch_size
    self_attention_ms = attention_ms(spec, tokens, args.iters) * spec.transformer["num_layers"]
    rows, baseline = [], None

    def measure(impl: str, run, prepare=None) -> None:
        nonlocal baseline
        if prepare is not None:
            prepare()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            start = time.perf_counter()
            out = run().float()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            ms = time_cuda_ms(run, warmup=args.warmup, iters=args.iters)
        baseline = out if baseline is None else baseline
        row = {
            "workload": workload,
            "impl": impl,
            "tokens": tokens,
            "ms_per_forward": ms,
            "first_call_s": first_s,
            "attention_share": self_attention_ms / ms,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "rel_l2_vs_diffusers_eager": ((out - baseline).norm() / baseline.norm()).item(),
        }
        if tflop:
            row["tflops"] = tflop / (ms * 1e-3)
            row["mfu_measured"] = row["tflops"] / matmul_tflops
        rows.append(row)
        print(f"{workload} {impl}: {ms:.0f} ms/forward ({first_s:.0f} s first call)", flush=True)
        del out

    held = {"reference": reference}
    del reference

    def run_reference():
        return held["reference"](latents, timestep, text, return_dict=False)[0]

    def run_ours():
        return unpatchify(ours(latents, timestep, text), grid, patch)

    measure("diffusers eager", run_reference)
    measure(
        "diffusers compiled", run_reference, prepare=lambda: held["reference"].compile_repeated_blocks(fullgraph=True)
    )
    held.clear()  # diffusers' model shares the bf16 weights: dropping it lets FP8 conversion free them below
    measure("paradit bf16 compiled", run_ours, prepare=lambda: compile_blocks(ours))
    keep = FAMILIES[spec.family].keep_high_precision
    measure("paradit fp8 compiled", run_ours, prepare=lambda: quantize_fp8(ours, torch.device("cuda"), keep))
    compiled = rows[1]["ms_per_forward"]
    for row in rows:
        row["speedup_vs_diffusers_compiled"] = compiled / row["ms_per_forward"]
    print(f"{workload}: self-attention kernel alone {self_attention_ms:.0f} ms of each forward", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=0, help="runs besides the first call (which is timed apart)")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    env, matmul = announce_device()
    rows = []
    for workload in args.workloads:
        rows += bench(workload, args, matmul)
        torch.cuda.empty_cache()
        torch.compiler.reset()
        write_json(args.out_dir, "wan_step.json", {"env": env, "matmul_tflops": matmul, "rows": rows})
    print_table(
        rows,
        [
            ("workload", "workload", "s"),
            ("impl", "impl", "s"),
            ("tokens", "tokens", "d"),
            ("ms_per_forward", "ms/forward", ".0f"),
            ("tflops", "TFLOP/s", ".0f"),
            ("mfu_measured", "MFU", ".1%"),
            ("attention_share", "attn share", ".0%"),
            ("peak_gib", "peak GiB", ".1f"),
            ("speedup_vs_diffusers_compiled", "vs diffusers compiled", ".2f"),
            ("rel_l2_vs_diffusers_eager", "rel L2", ".1e"),
        ],
    )


if __name__ == "__main__":
    main()
