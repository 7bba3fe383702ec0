"""FP8 attention (``--attention fp8``) against cuDNN's bf16 SDPA on one GPU, at the self-attention shapes of the
models' default sizes (batch 1): TFLOP/s (4·L²·H·D per call, the kernel's quantization pre-pass included) and the
error of each against exact fp32 attention (relative L2 over a sample of queries, every key). The inputs are random:
queries and keys N(0, 1) plus a per-channel offset shared by every key (real keys have one; K's smoothing removes it),
values N(0, 1).

``--forward``: Wan 2.2 A14B's expert (random weights, FP8 linears, compiled blocks) at 1280×720×81, one forward with
SDPA and with FP8 attention; then a 20-step Euler denoise of that expert at 832×480×81 from the same noise with each
(and FP8 with the first and last 2 steps exact), the relative L2 of each final latent against SDPA's.

    python benchmarks/fp8_attention.py --out-dir $OUT
    python benchmarks/fp8_attention.py --shapes wan-720p --configs 128,128,8,3 64,128,4,2 --out-dir $OUT
    python benchmarks/fp8_attention.py --shapes --forward --out-dir $OUT
    python benchmarks/fp8_attention.py --shapes wan-720p wan-480p --cudnn-fp8 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, quantize_fp8, time_cuda_ms, write_json  # noqa: E402
from benchmarks.wan_step import build_paradit, forward_inputs  # noqa: E402
from paradit.compile import compile_blocks  # noqa: E402
from paradit.families import FAMILIES  # noqa: E402
from paradit.families.wan.model import unpatchify  # noqa: E402
from paradit.layers import fp8_attention as kernel  # noqa: E402
from paradit.layers.attention import apply_fp8_attention, sdpa_attention  # noqa: E402

# name -> (tokens, heads, head_dim): Wan 2.2 A14B at 1280×720×81 and 832×480×81, TI2V-5B at 1280×704×121, FLUX.2-dev
# at 1024² (4096 image tokens and 512 of text), Qwen-Image at 1024² (4096 image tokens and a 256-token prompt).
SHAPES = {
    "wan-720p": (75600, 40, 128),
    "wan-480p": (32760, 40, 128),
    "ti2v-5b-704p": (27280, 24, 128),
    "flux2-dev-1024": (4608, 48, 128),
    "qwen-image-1024": (4352, 24, 128),
    "keys-2048": (2048, 24, 128),
    "keys-8192": (8192, 24, 128),
    "keys-16384": (16384, 24, 128),
}
FORWARD_COLUMNS = [
    ("run", "run", "s"),
    ("attention", "attention", "s"),
    ("ms", "ms", ".0f"),
    ("first_s", "first call s", ".0f"),
    ("rel_l2", "rel L2 vs SDPA", ".4f"),
]
DENOISE_STEPS = 20
COLUMNS = [
    ("shape", "shape", "s"),
    ("tokens", "tokens", "d"),
    ("method", "method", "s"),
    ("ms", "ms", ".2f"),
    ("tflops", "TFLOP/s", ".0f"),
    ("speedup", "speedup", ".2f"),
    ("rel_l2", "rel L2 vs fp32", ".4f"),
    ("vs_ours", "speed-up over paradit's fp8", ".2f"),
    ("config", "config", "s"),
]
SAMPLE_QUERIES = 512
QK = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def exact_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 attention of the queries ``rows`` over every key, head by head (the whole score matrix would not fit)."""
    out = []
    for head in range(q.shape[2]):
        scores = q[0, rows, head].float() @ k[0, :, head].float().T * q.shape[-1] ** -0.5
        out.append(torch.softmax(scores, dim=-1) @ v[0, :, head].float())
    return torch.stack(out, dim=1)


def relative_l2(out: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor) -> float:
    got = out[0, rows].float()
    return ((got - exact).norm() / exact.norm()).item()


E4M3_MAX = 448.0


class CudnnFp8Attention:
    """cuDNN's FP8 attention through the ``nvidia-cudnn-frontend`` wheel (issue 51's optional vendor backend, measured
    here before it is wired in): Q, K and V quantized per tensor (cuDNN's FP8 graph takes one descale each), the
    softmax's probabilities scaled to E4M3's range, each query's log-sum-exp in fp32, the output in bf16 or (where
    this cuDNN writes only FP8) in E4M3 scaled by V's range, which bounds it, and widened after. One graph per shape,
    built on first use."""

    def __init__(self, fp8_output: bool) -> None:
        import cudnn  # after torch: it finds the libcudnn that torch loaded

        self.cudnn, self.graphs, self.fp8_output = cudnn, {}, fp8_output
        self.handle = cudnn.create_handle()
        self.version = cudnn.backend_version_string()

    def graph(self, batch: int, heads: int, q_len: int, k_len: int, dim: int):
        key = (batch, heads, q_len, k_len, dim)
        if key not in self.graphs:
            cudnn = self.cudnn
            graph = cudnn.pygraph(
                io_data_type=cudnn.data_type.FP8_E4M3,
                intermediate_data_type=cudnn.data_type.FLOAT,
                compute_data_type=cudnn.data_type.FLOAT,
            )

            def sequence(uid: int, length: int):  # paradit's (batch, tokens, heads, dim) memory as cuDNN's b, h, s, d
                stride = (length * heads * dim, dim, heads * dim, 1)
                return graph.tensor(
                    uid=uid, dim=(batch, heads, length, dim), stride=stride, data_type=cudnn.data_type.FP8_E4M3
                )

            def scalar(uid: int):
                return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)

            q, k, v = sequence(0, q_len), sequence(1, k_len), sequence(2, k_len)
            out, stats, _, amax_o = graph.sdpa_fp8(
                q=q,
                k=k,
                v=v,
                descale_q=scalar(5),
                descale_k=scalar(6),
                descale_v=scalar(7),
                descale_s=scalar(8),
                scale_s=scalar(9),
                scale_o=scalar(10),
                generate_stats=True,
                attn_scale=dim**-0.5,
                use_causal_mask=False,
            )
            out.set_uid(3).set_output(True).set_dim((batch, heads, q_len, dim)).set_stride(
                (q_len * heads * dim, dim, heads * dim, 1)
            ).set_data_type(cudnn.data_type.FP8_E4M3 if self.fp8_output else cudnn.data_type.BFLOAT16)
            stats.set_uid(4).set_output(True).set_dim((batch, heads, q_len, 1)).set_stride(
                (heads * q_len, q_len, 1, 1)
            ).set_data_type(cudnn.data_type.FLOAT)
            amax_o.set_uid(12).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(
                cudnn.data_type.FLOAT
            )
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
            probability_scale = torch.full((1, 1, 1, 1), E4M3_MAX, device="cuda")
            self.graphs[key] = graph, workspace, probability_scale
        return self.graphs[key]

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.abs().amax().float().clamp(min=1e-12)
        return (x.float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn), (amax / E4M3_MAX).reshape(1, 1, 1, 1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, q_len, heads, dim = q.shape
        graph, workspace, probability_scale = self.graph(batch, heads, q_len, k.shape[1], dim)
        # K less its token mean, as paradit's kernel smooths it: each query's scores move by a constant (softmax
        # keeps them, the log-sum-exp gets it back below), and a per-tensor scale then spans K's spread, not its offset.
        k_mean = k.float().mean(dim=1, keepdim=True)
        (q8, q_descale), (k8, k_descale), (v8, v_descale) = map(self.quantize, (q, k.float() - k_mean, v))
        out = torch.empty(q.shape, device=q.device, dtype=torch.float8_e4m3fn if self.fp8_output else torch.bfloat16)
        lse = torch.empty(batch, heads, q_len, 1, device=q.device, dtype=torch.float32)
        output_scale = 1 / v_descale if self.fp8_output else torch.ones((1, 1, 1, 1), device=q.device)
        pack = {
            0: q8,
            1: k8,
            2: v8,
            5: q_descale,
            6: k_descale,
            7: v_descale,
            8: 1 / probability_scale,
            9: probability_scale,
            10: output_scale,
            3: out,
            4: lse,
            12: torch.empty((1, 1, 1, 1), device=q.device),
        }
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, workspace, handle=self.handle)
        if self.fp8_output:
            out = (out.float() * v_descale.reshape(())).to(torch.bfloat16)
        shift = (q.float() * k_mean).sum(-1).transpose(1, 2) * dim**-0.5
        return out, lse[..., 0] + shift


def cudnn_fp8_rows(name: str, q, k, v, exact, rows, flop: int, iters: int, sdpa_ms: float, ours_ms: float):
    """cuDNN's FP8 attention beside paradit's (bf16 output, then FP8 output), or the reason each did not run."""
    found = []
    for fp8_output in (False, True):
        base = {"shape": name, "tokens": q.shape[1], "method": f"cudnn fp8, {'fp8' if fp8_output else 'bf16'} out"}
        try:
            vendor = CudnnFp8Attention(fp8_output)
            out, lse = vendor(q, k, v)
            ms = time_cuda_ms(lambda vendor=vendor: vendor(q, k, v), warmup=3, iters=iters)
            quantize_ms = time_cuda_ms(
                lambda vendor=vendor: [vendor.quantize(x) for x in (q, k.float() - k.float().mean(1, True), v)],
                warmup=3,
                iters=iters,
            )
            ours_lse = kernel.fp8_attention_with_lse(q, k, v)[1]
            row = {
                **base,
                "ms": ms,
                "tflops": flop / ms / 1e9,
                "speedup": sdpa_ms / ms,
                "rel_l2": relative_l2(out, exact, rows),
                "config": f"cuDNN {vendor.version}",
                "vs_ours": ours_ms / ms,
                "quantize_ms": quantize_ms,
                "lse_max_diff_vs_ours": (lse - ours_lse).abs().max().item(),
            }
            print(
                f"{name}: {base['method']} {ms:.2f} ms ({quantize_ms:.2f} of them quantizing), {ours_ms / ms:.2f}x "
                f"paradit's kernel; lse max diff {row['lse_max_diff_vs_ours']:.2e}",
                flush=True,
            )
            found.append(row)
        except Exception as exc:  # noqa: BLE001 - an optional vendor path: its absence or refusal is a result
            print(f"{name}: {base['method']} did not run: {type(exc).__name__}: {exc}", flush=True)
            found.append({**base, "config": f"not run: {type(exc).__name__}: {str(exc)[:300]}"})
    return found


def bench_shape(name: str, args) -> list[dict]:
    tokens, heads, dim = SHAPES[name]
    generator = torch.Generator("cuda").manual_seed(0)
    shape = (1, tokens, heads, dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    offset = 2 * torch.randn(1, 1, heads, dim, device="cuda", generator=generator)
    k = (torch.randn(shape, device="cuda", generator=generator) + offset).to(torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    rows = torch.randperm(tokens, device="cuda", generator=generator)[:SAMPLE_QUERIES]
    exact = exact_sample(q, k, v, rows)
    flop = 4 * tokens * tokens * heads * dim
    iters = max(3, min(50, int(2e15 / flop)))
    sdpa_ms = time_cuda_ms(lambda: sdpa_attention(q, k, v), warmup=3, iters=iters)
    result = [
        {
            "shape": name,
            "tokens": tokens,
            "method": "sdpa bf16",
            "ms": sdpa_ms,
            "tflops": flop / sdpa_ms / 1e9,
            "speedup": 1.0,
            "rel_l2": relative_l2(sdpa_attention(q, k, v), exact, rows),
        }
    ]
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] or [None]
    tune = kernel._configs
    for qk, config in ((qk, config) for qk in args.qk for config in configs):
        kernel._CHOSEN.clear()
        kernel._configs = tune if config is None else lambda device, config=config: [config]
        kernel.QK_FORMAT = QK[qk]
        out = kernel.fp8_attention_with_lse(q, k, v)[0]
        ms = time_cuda_ms(lambda: kernel.fp8_attention_with_lse(q, k, v), warmup=3, iters=iters)
        chosen = next(iter(kernel._CHOSEN.values()))
        result.append(
            {
                "shape": name,
                "tokens": tokens,
                "method": f"fp8 (QK {qk})",
                "ms": ms,
                "tflops": flop / ms / 1e9,
                "speedup": sdpa_ms / ms,
                "rel_l2": relative_l2(out, exact, rows),
                "config": ",".join(map(str, chosen)),
            }
        )
    prepass = time_cuda_ms(
        lambda: kernel.quantize_keys_values(k, v, kernel.QK_FORMAT, torch.float8_e4m3fn), warmup=3, iters=iters
    )
    result[-1]["prepass_ms"] = prepass
    print(f"{name}: pre-pass {prepass:.2f} ms", flush=True)
    if args.cudnn_fp8:
        result += cudnn_fp8_rows(name, q, k, v, exact, rows, flop, iters, sdpa_ms, result[-1]["ms"])
    return result


def expert_forward_and_denoise() -> list[dict]:
    """The expert's 720p forward with each attention, then the 20-step denoises at 480p (one model: Wan's blocks take
    any token count)."""
    device = torch.device("cuda")
    spec, model, (latents, timestep, text), grid, _ = build_paradit("a14b-720p", device)
    quantize_fp8(model, device, FAMILIES[spec.family].keep_high_precision)
    compile_blocks(model)
    fp8 = apply_fp8_attention(model, 0)
    rows, outputs = [], {}
    for attention in ("sdpa", "fp8"):
        fp8.fp8_now = attention == "fp8"
        with torch.inference_mode():
            start = time.perf_counter()
            outputs[attention] = model(latents, timestep, text).float()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            ms = time_cuda_ms(lambda: model(latents, timestep, text), warmup=0, iters=3)
        rows.append(
            {
                "run": "A14B expert 1280×720×81 forward",
                "attention": attention,
                "ms": ms,
                "first_s": first,
                "rel_l2": relative_l2_of(outputs[attention], outputs["sdpa"]),
            }
        )
        print(rows[-1], flush=True)
    del outputs
    (noise, _, text), grid, tokens = forward_inputs("a14b-480p", model.config, device)
    sigmas = torch.linspace(1.0, 0.0, DENOISE_STEPS + 1).tolist()
    finals = {}
    for name, exact_steps in (("sdpa", None), ("fp8", 0), ("fp8, 2 exact steps at each end", 2)):
        x = noise.float()
        start = time.perf_counter()
        with torch.inference_mode():
            for step in range(DENOISE_STEPS):
                fp8.exact_steps = exact_steps or 0
                fp8.at_step(step, DENOISE_STEPS)
                fp8.fp8_now = fp8.fp8_now and exact_steps is not None
                t = torch.full((1,), 1000 * sigmas[step], device=device)
                velocity = unpatchify(model(x.bfloat16(), t, text), grid, model.config.patch_size).float()
                x = x + (sigmas[step + 1] - sigmas[step]) * velocity
        torch.cuda.synchronize()
        finals[name] = x
        ms = (time.perf_counter() - start) * 1e3
        rows.append(
            {
                "run": f"denoise 832×480×81, {DENOISE_STEPS} steps",
                "attention": name,
                "ms": ms,
                "rel_l2": relative_l2_of(x, finals["sdpa"]),
            }
        )
        print(rows[-1], flush=True)
    return rows


def relative_l2_of(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--configs", nargs="*", default=[], help="query tile,key tile,warps,stages (default: tuned)")
    parser.add_argument("--qk", nargs="+", default=["int8"], choices=list(QK), help="Q·Kᵀ's 8-bit format")
    parser.add_argument("--forward", action="store_true", help="also Wan A14B's expert forward and denoise")
    parser.add_argument(
        "--cudnn-fp8", action="store_true", help="also cuDNN's FP8 attention (needs the nvidia-cudnn-frontend wheel)"
    )
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    env = environment()
    import triton

    env["triton"] = triton.__version__
    print(env, flush=True)
    rows = [row for name in args.shapes for row in bench_shape(name, args)]
    write_json(args.out_dir, "fp8_attention", {"environment": env, "rows": rows})
    forward = expert_forward_and_denoise() if args.forward else []
    write_json(args.out_dir, "fp8_attention", {"environment": env, "rows": rows, "forward": forward})
    print_table(rows, COLUMNS)
    if forward:
        print_table(forward, FORWARD_COLUMNS)


if __name__ == "__main__":
    main()
