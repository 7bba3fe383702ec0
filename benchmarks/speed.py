"""Single-GPU speed of every family's transformer: paradit bf16 eager, compiled, compiled + CUDA graphs, FP8
compiled (+ graphs), against diffusers eager and compiled (regional ``torch.compile`` of its repeated blocks) on the
same weights, in one run.

Prints ms/step, MFU against the bf16 matmul rate measured in the same run, the time of the first call (compilation
or capture), weight memory, peak memory, the GPU busy share of a step (kernel time over the step's time), each
variant's relative L2 against paradit bf16 eager on one step, and FP8's relative L2 against bf16 on the final latents
of a whole denoise run (``--denoise-steps`` Euler steps from the same noise; bf16 compiled against bf16 eager on the
same run is printed beside it as the floor that compilation alone gives).

    python benchmarks/speed.py --out-dir $OUT
    CUDA_VISIBLE_DEVICES=1 python benchmarks/speed.py --models qwen-image z-image-turbo --out-dir $OUT
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    ModelPair,
    announce_device,
    kernel_ms,
    print_table,
    quantize_fp8,
    single_gpu_parser,
    time_cuda_ms,
    write_json,
)
from paradit.compile import compile_blocks  # noqa: E402
from paradit.cuda_graphs import GraphedModule  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402

# family -> (module with model_pair, text tokens of the reference workload)
FAMILY_BENCHES = {
    "flux2": ("benchmarks.flux2_step", 512),
    "qwen_image": ("benchmarks.qwen_image_step", 256),
    "zimage": ("benchmarks.zimage_step", 256),
    "sd3": ("benchmarks.sd3_step", 333),
}
DEFAULT_MODELS = ["flux2-dev", "flux2-klein-4b", "qwen-image", "z-image-turbo", "sd3.5-large", "sd3.5-medium"]


def attention_kernels(name: str, tokens: int, args) -> dict[str, float]:
    """ms of one SDPA call at the model's attention shape with each kernel forced, and with SDPA's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = PRESETS[name]
    heads = spec.attention_heads
    head_dim = spec.transformer.get("attention_head_dim") or spec.transformer["dim"] // heads
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernels = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    timings = {}
    for label, backend in kernels.items():
        try:
            if backend is None:
                timings[label] = time_cuda_ms(lambda: sdpa(q, k, v), warmup=2, iters=args.iters)
            else:
                with sdpa_kernel(backend):
                    timings[label] = time_cuda_ms(lambda: sdpa(q, k, v), warmup=2, iters=args.iters)
        except RuntimeError:  # the kernel does not take this shape or device
            timings[label] = None
    shown = ", ".join(f"{label} {ms:.2f}" if ms else f"{label} -" for label, ms in timings.items())
    print(f"{name} attention ({heads} heads x {head_dim}, {tokens} tokens) ms: {shown}", flush=True)
    return timings


def compile_reference(reference: torch.nn.Module) -> None:
    """diffusers' regional compilation; SD3's model declares no repeated blocks, so its blocks are compiled alike."""
    if getattr(reference, "_repeated_blocks", None):
        reference.compile_repeated_blocks(fullgraph=True)
    else:
        for block in reference.transformer_blocks:
            block.compile(fullgraph=True)


def weight_gib(module: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30


def denoise(pair: ModelPair, model, steps: int) -> torch.Tensor:
    """Final latents of ``steps`` Euler flow-matching steps from the bound latents (as noise) with ``model``."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    latents = pair.latents.clone()
    with torch.inference_mode():
        for sigma, next_sigma in zip(sigmas, sigmas[1:]):
            latents = latents + (next_sigma - sigma) * pair.step_ours(model, latents, sigma)
    return latents.float()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def bench_model(name: str, args, matmul_tflops: float) -> list[dict]:
    module, text_len = FAMILY_BENCHES[PRESETS[name].family]
    args.text_len = text_len
    pair = importlib.import_module(module).model_pair(name, args, torch.device("cuda"))
    rows, finals = [], {}
    baseline = None

    def measure(impl: str, run, weights: torch.nn.Module, prepare=None):
        nonlocal baseline
        if prepare is not None:
            prepare()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            ms = time_cuda_ms(run, warmup=args.warmup, iters=args.iters)
            busy = kernel_ms(run)
            out = run().float()
        baseline = out if baseline is None else baseline
        row = {
            "model": name,
            "impl": impl,
            "ms_per_step": ms,
            "first_call_s": first_s,
            "gpu_share": busy / ms,
            "weights_gib": weight_gib(weights),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "rel_l2_vs_bf16_eager": rel_l2(out, baseline),
        }
        if pair.tflop:
            row["mfu_measured"] = pair.tflop / (ms * 1e-3) / matmul_tflops
        rows.append(row)
        print(f"{name} {impl}: {ms:.1f} ms/step, GPU busy {row['gpu_share']:.1%}, 1st call {first_s:.0f} s", flush=True)
        return row

    ours = pair.ours
    kernels = attention_kernels(name, pair.tokens, args)
    measure("paradit bf16 eager", pair.run_ours, ours)["attention_kernel_ms"] = kernels
    finals["bf16 eager"] = denoise(pair, ours, args.denoise_steps)
    measure("diffusers eager", pair.run_reference, pair.reference)
    measure("diffusers compiled", pair.run_reference, pair.reference, prepare=lambda: compile_reference(pair.reference))
    pair.reference = None  # it shares the bf16 weights: dropping it lets FP8 conversion free them below
    measure("paradit bf16 compiled", pair.run_ours, ours, prepare=lambda: compile_blocks(ours))
    graphed = GraphedModule(ours)
    measure("paradit bf16 compiled+graphs", lambda: pair.run_ours(graphed), ours)
    finals["bf16 compiled+graphs"] = denoise(pair, graphed, args.denoise_steps)
    del graphed  # its captured memory pool
    torch.cuda.empty_cache()
    keep = FAMILIES[PRESETS[name].family].keep_high_precision
    measure("paradit fp8 compiled", pair.run_ours, ours, prepare=lambda: quantize_fp8(ours, torch.device("cuda"), keep))
    graphed = GraphedModule(ours)
    fp8 = measure("paradit fp8 compiled+graphs", lambda: pair.run_ours(graphed), ours)
    finals["fp8 compiled+graphs"] = denoise(pair, graphed, args.denoise_steps)
    fp8["final_latents_rel_l2_vs_bf16"] = rel_l2(finals["fp8 compiled+graphs"], finals["bf16 compiled+graphs"])
    fp8["final_latents_rel_l2_floor"] = rel_l2(finals["bf16 compiled+graphs"], finals["bf16 eager"])
    print(
        f"{name}: final latents after {args.denoise_steps} steps, FP8 vs bf16 rel L2 "
        f"{fp8['final_latents_rel_l2_vs_bf16']:.2e} (bf16 compiled vs eager: {fp8['final_latents_rel_l2_floor']:.2e})",
        flush=True,
    )
    return rows


def main() -> None:
    parser = single_gpu_parser(__doc__.splitlines()[0], DEFAULT_MODELS)
    parser.add_argument("--denoise-steps", type=int, default=8)
    parser.add_argument("--tag", default="speed", help="JSON file name (one per concurrent run)")
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(PRESETS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(PRESETS)}")
    env, matmul = announce_device()
    rows = []
    for name in args.models:
        rows += bench_model(name, args, matmul)
        torch.cuda.empty_cache()
        torch.compiler.reset()  # the next model's blocks compile afresh rather than against this one's guards
        write_json(args.out_dir, f"{args.tag}.json", {"env": env, "matmul_tflops": matmul, "rows": rows})
    print_table(
        rows,
        [
            ("model", "model", "s"),
            ("impl", "impl", "s"),
            ("ms_per_step", "ms/step", ".1f"),
            ("mfu_measured", "MFU", ".1%"),
            ("gpu_share", "GPU busy", ".1%"),
            ("first_call_s", "1st call s", ".0f"),
            ("weights_gib", "weights GiB", ".1f"),
            ("peak_gib", "peak GiB", ".1f"),
            ("rel_l2_vs_bf16_eager", "rel L2 vs bf16", ".1e"),
            ("final_latents_rel_l2_vs_bf16", "final rel L2", ".1e"),
        ],
    )


if __name__ == "__main__":
    main()
