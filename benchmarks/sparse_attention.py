"""Block-sparse attention (``--sparse-attention``) against dense FP8 attention on one GPU, Wan 2.2's transformers with
random weights and FP8 linears (compiled blocks): A14B's expert at 832x480x81 and 1280x720x81, TI2V-5B at 1280x704x121,
one sample. For each variant (radial at the paper's settings; svg2 at SVG2's settings and at a lower top-p, and with
each of its k-means passes), at a step past the dense warm-up: the density its masks kept, one self-attention call's ms
(the first block every variant attends sparsely: its Q, K, V, the mask's making included, SVG2's k-means warm from the
call before; SVG2's clustering and mask alone in "layout ms") against the dense FP8 kernel's, one forward's ms against
the dense one's, the forward less its self-attention calls ("rest": what a graph break or host work around the calls
costs), the graphs the sparse forward compiled, the speed-ups, and the relative L2 of that block's attention output
against dense FP8 attention's and against bf16 SDPA's. Random weights spread attention evenly, so SVG2's top-p keeps
nearly every tile and the error is far above what real weights give (docs give the command that measures PSNR against
dense with them).

    python benchmarks/sparse_attention.py --out-dir $OUT
    python benchmarks/sparse_attention.py --workloads a14b-720p --methods radial --deadline-s 400 --out-dir $OUT
    python benchmarks/sparse_attention.py --tiny --out-dir out/sparse      (the CPU: a tiny model, the reference)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, quantize_fp8, time_cuda_ms, write_json  # noqa: E402
from paradit.compile import compile_blocks, model_blocks  # noqa: E402
from paradit.families import FAMILIES  # noqa: E402
from paradit.families.wan.model import WanConfig, WanTransformer  # noqa: E402
from paradit.layers import semantic_permutation  # noqa: E402
from paradit.layers.attention import AttentionDispatch, apply_fp8_attention, sdpa_attention  # noqa: E402
from paradit.layers.semantic_permutation import SVG2_TOP_P, semantic_layout  # noqa: E402
from paradit.layers.sparse_attention import SPARSE_METHODS, SparseSettings, apply_sparse_attention  # noqa: E402
from paradit.layers.sparse_masks import video_grid  # noqa: E402

WORKLOADS = ("a14b-480p", "a14b-720p", "ti2v-5b-704p")  # benchmarks/wan_step.py's
KMEANS_PASSES = ("fused", "torch")  # semantic_permutation.KMEANS_PASSES'
COLUMNS = [
    ("workload", "workload", "s"),
    ("variant", "mask", "s"),
    ("tokens", "tokens", "d"),
    ("density", "density", ".3f"),
    ("dense_attention_ms", "dense attn ms", ".2f"),
    ("attention_ms", "sparse attn ms", ".2f"),
    ("layout_ms", "layout ms", ".2f"),
    ("attention_speedup", "attn x", ".2f"),
    ("dense_forward_ms", "dense fwd ms", ".0f"),
    ("forward_ms", "sparse fwd ms", ".0f"),
    ("forward_speedup", "fwd x", ".2f"),
    ("dense_other_ms", "dense rest ms", ".0f"),
    ("other_ms", "sparse rest ms", ".0f"),
    ("graphs", "graphs", "d"),
    ("rel_l2_vs_dense_fp8", "rel L2 vs fp8", ".3f"),
    ("rel_l2_vs_sdpa", "rel L2 vs sdpa", ".3f"),
]


@dataclass(frozen=True)
class Variant:
    """One measured row: a mask, its top-p (SVG2), SVG2's k-means passes, and whether the forward is timed (a variant
    that differs only in its call is timed at the call)."""

    method: str
    kmeans: str = KMEANS_PASSES[0]
    top_p: float | None = None
    forward: bool = True

    @property
    def label(self) -> str:
        if self.method == "radial":
            return "radial"
        return f"svg2 p={self.top_p:g} {self.kmeans}"


def variants(args) -> list[Variant]:
    """Radial, forward timed; SVG2 at each top-p with the first k-means passes, forward timed, and its other k-means
    passes at the first top-p, timed at the call."""
    chosen = []
    if "radial" in args.methods:
        chosen.append(Variant("radial"))
    if "svg2" in args.methods:
        chosen += [Variant("svg2", args.kmeans[0], top_p) for top_p in args.svg2_top_p]
        chosen += [Variant("svg2", passes, args.svg2_top_p[0], False) for passes in args.kmeans[1:]]
    return chosen


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tiny_model():
    """Two heads of 24 channels over (6, 8, 16) tokens: a frame a tile, six tiles; float32 on the CPU."""
    config = WanConfig(num_attention_heads=2, attention_head_dim=24, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3)
    torch.manual_seed(0)
    model = WanTransformer(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 6, 16, 32, generator=generator)
    text = torch.randn(1, 8, 32, generator=generator)
    return model.eval(), (latents, torch.tensor([500.0]), text), config.token_grid(*latents.shape[2:])


def gpu_model(workload: str, compile_: bool):
    from benchmarks.wan_step import build_paradit

    spec, model, inputs, grid, _ = build_paradit(workload, torch.device("cuda"))
    quantize_fp8(model, torch.device("cuda"), FAMILIES[spec.family].keep_high_precision)
    apply_fp8_attention(model, 0)
    if compile_:
        compile_blocks(model)
    return model, inputs, grid


def timer(device: torch.device, warmup: int, iters: int):
    def timed(fn) -> float:
        if device.type == "cuda":
            return time_cuda_ms(fn, warmup=warmup, iters=iters)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    return timed


def self_attentions(model) -> list[AttentionDispatch]:
    return [m for m in model.modules() if isinstance(m, AttentionDispatch) and m.sequence_streams == ("video",)]


def captured_inputs(model, inputs, block: int) -> tuple[torch.Tensor, ...]:
    """The Q, K, V ``block``'s self-attention is called with in one forward."""
    module, held = self_attentions(model)[block], {}
    kernel = module.attention_fn

    def capture(query, key, value, key_mask=None):
        held["qkv"] = (query, key, value)
        return kernel(query, key, value, key_mask)

    module.attention_fn = capture
    try:
        with torch.inference_mode():
            model(*inputs)
    finally:
        module.attention_fn = kernel
    return held["qkv"]


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def graphs_compiled() -> int:
    """Dynamo's graphs so far: a sparse forward's increase shows whether its blocks split or recompile."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def settings_of(variant: Variant, blocks: int) -> SparseSettings:
    given = {"dense_steps": 0} | ({"top_p": variant.top_p} if variant.method == "svg2" else {})
    return SparseSettings.of(variant.method, blocks, **given)


def layout_ms(call, q, k, timed) -> float:
    """SVG2's clustering and block mask alone (k-means warm from the call before), as the call makes them."""
    settings, state = call.run.settings, call.run.block_state(call.block)
    warm = tuple(
        torch.stack([state["centroids"][head][side] for head in range(q.shape[2])], dim=1).flatten(0, 1)
        for side in (0, 1)
    )
    arguments = (settings.query_clusters, settings.key_clusters, settings.top_p, settings.min_key_share)
    return timed(lambda: semantic_layout(q, k, *arguments, settings.iterations, warm))


def bench(workload: str, args, device: torch.device) -> list[dict]:
    model, inputs, grid = tiny_model() if args.tiny else gpu_model(workload, not args.no_compile)
    tokens, blocks = math.prod(grid), len(model_blocks(model))
    timed = timer(device, args.warmup, args.iters)
    timed_forward = timer(device, 0, args.iters)  # after a forward of its own
    attentions = self_attentions(model)
    dense_kernels = [module.kernel for module in attentions]
    chosen = variants(args)
    # The first block every variant attends sparsely (past the dense ones).
    measured = max(settings_of(variant, blocks).dense_blocks for variant in chosen)
    q, k, v = captured_inputs(model, inputs, measured)
    dense_call = dense_kernels[measured]
    with torch.inference_mode():
        dense_out = dense_call(q, k, v)
        exact_out = sdpa_attention(q, k, v)
        dense_attention_ms = timed(lambda: dense_call(q, k, v))
        model(*inputs)
        dense_forward_ms = timed_forward(lambda: model(*inputs))
    log(f"{workload} dense: attention {dense_attention_ms:.2f} ms, forward {dense_forward_ms:.0f} ms")
    rows = []
    for variant in chosen:
        for module, kernel in zip(attentions, dense_kernels, strict=True):
            module.kernel = module.attention_fn = kernel
        semantic_permutation.KMEANS_PASSES = variant.kmeans
        run = apply_sparse_attention(model, settings_of(variant, blocks))
        run.begin_request(None)
        sparse_call = attentions[measured].kernel
        graphs_before = graphs_compiled()
        forward_ms = graphs = None
        with torch.inference_mode():
            if variant.forward:
                model(*inputs)  # SVG2's first, cold k-means; radial's mask and tile rows made
                graphs = graphs_compiled() - graphs_before
                run.kept, run.sparse_calls = 0.0, 0
                forward_ms = timed_forward(lambda: model(*inputs))
                density = float(run.kept) / max(run.sparse_calls, 1)
            with video_grid(grid):  # as the model sets it around its blocks
                run.kept, run.sparse_calls = 0.0, 0
                out = sparse_call(q, k, v)  # without a forward before it: SVG2's cold k-means
                if not variant.forward:  # the measured call's
                    density = float(run.kept)
                attention_ms = timed(lambda call=sparse_call: call(q, k, v))
                layout = layout_ms(sparse_call, q, k, timed) if variant.method == "svg2" else None
        dense_blocks = run.settings.dense_blocks
        row = {
            "workload": workload,
            "method": variant.method,
            "variant": variant.label,
            "tokens": tokens,
            "density": density,
            "dense_attention_ms": dense_attention_ms,
            "attention_ms": attention_ms,
            "layout_ms": layout,
            "attention_speedup": dense_attention_ms / attention_ms,
            "dense_forward_ms": dense_forward_ms,
            "forward_ms": forward_ms,
            "forward_speedup": dense_forward_ms / forward_ms if forward_ms else None,
            # The forward less its self-attention calls (each block's at the measured block's time).
            "dense_other_ms": dense_forward_ms - blocks * dense_attention_ms,
            "other_ms": forward_ms - (blocks - dense_blocks) * attention_ms - dense_blocks * dense_attention_ms
            if forward_ms
            else None,
            "graphs": graphs,
            "rel_l2_vs_dense_fp8": relative_l2(out, dense_out),
            "rel_l2_vs_sdpa": relative_l2(out, exact_out),
            "settings": {name: getattr(run.settings, name) for name in ("dense_blocks", "decay_factor", "top_p")},
            "kmeans": variant.kmeans if variant.method == "svg2" else None,
        }
        rows.append(row)
        forward = "-" if forward_ms is None else f"{forward_ms:.0f}"
        log(f"{workload} {variant.label}: density {density:.3f}, attention {attention_ms:.2f} ms, forward {forward} ms")
    semantic_permutation.KMEANS_PASSES = KMEANS_PASSES[0]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--methods", nargs="+", default=list(SPARSE_METHODS), choices=SPARSE_METHODS)
    parser.add_argument(
        "--kmeans", nargs="+", default=list(KMEANS_PASSES), choices=KMEANS_PASSES, help="SVG2's k-means passes"
    )
    # Random weights spread attention evenly, so SVG2's top-p of 0.9 keeps nearly every tile; a lower top-p shows
    # what SVG2 costs where it keeps less (SVG2 has no setting of a kept fraction: top-p and a least share only).
    parser.add_argument("--svg2-top-p", nargs="+", type=float, default=[SVG2_TOP_P, 0.3])
    parser.add_argument("--tiny", action="store_true", help="on the CPU: a tiny model through the masked reference")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks (compiling A14B takes minutes)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=None, help="start no workload past this many seconds")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    workloads = ["tiny"] if args.tiny else args.workloads
    environment = {"device": "cpu" if args.tiny else torch.cuda.get_device_name(), "torch": torch.__version__}
    started, rows = time.perf_counter(), []
    for workload in workloads:
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            log(f"{workload}: skipped, past --deadline-s {args.deadline_s:g}")
            rows.append({"workload": workload, "error": "skipped: past --deadline-s"})
            continue
        rows += bench(workload, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.compiler.reset()
        write_json(args.out_dir, "sparse_attention.json", {"env": environment, "rows": rows})
    print_table([row for row in rows if "error" not in row], COLUMNS)


if __name__ == "__main__":
    main()
