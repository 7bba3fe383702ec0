"""The Hopper (Gluon) FP8 attention kernel against the portable Triton kernel and cuDNN's bf16 SDPA, on one GPU, at
the models' self-attention shapes: time (pre-pass included), TFLOP/s, the error against exact fp32 attention, and the
log-sum-exp against the portable kernel's. Each config is (K and V tiles in flight, schedule: 0 together, 1 ping-pong,
2 early Q·Kᵀ; see ``fp8_attention_hopper``). A masked, ragged case checks masks and tails first.

    python benchmarks/fp8_attention_hopper.py --out-dir $OUT
    python benchmarks/fp8_attention_hopper.py --shapes wan-720p --configs 4,1 4,0 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, time_cuda_ms, write_json  # noqa: E402
from benchmarks.fp8_attention import SAMPLE_QUERIES, SHAPES, exact_sample, relative_l2  # noqa: E402
from paradit.layers import fp8_attention as portable  # noqa: E402
from paradit.layers import fp8_attention_hopper as hopper  # noqa: E402
from paradit.layers.attention import sdpa_attention  # noqa: E402

COLUMNS = [
    ("shape", "shape", "s"), ("method", "method", "s"), ("ms", "ms", ".2f"), ("tflops", "TFLOP/s", ".0f"),
    ("speedup", "vs SDPA", ".2f"), ("rel_l2", "rel L2 vs fp32", ".4f"), ("lse_diff", "LSE vs portable", ".2e"),
]  # fmt: skip


def run_hopper(q, k, v, config, key_mask=None):
    batch, q_length, heads, dim = q.shape
    pv = torch.float8_e4m3fn
    k8, k_scale, k_mean, v8, v_scale = portable.quantize_keys_values(k, v, torch.int8, pv, permute_keys=True)
    padded = k8.shape[2]
    if key_mask is not None:
        mask = torch.zeros(batch, padded, dtype=torch.uint8, device=q.device)
        mask[:, : k.shape[1]] = key_mask
    else:
        mask = k_scale
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_length, dtype=torch.float32, device=q.device)
    hopper.launch(q, k.shape[1], k8, k_scale, v8, v_scale, k_mean, mask, out, lse, heads=heads, dim=dim,
                  has_mask=key_mask is not None, qmax=portable.INT8_MAX, p_exponent=portable.p_exponent(pv),
                  config=config)  # fmt: skip
    return out, lse


def inputs(tokens, heads, dim, seed=0, q_tokens=None):
    generator = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn((1, q_tokens or tokens, heads, dim), device="cuda", dtype=torch.bfloat16, generator=generator)
    offset = 2 * torch.randn(1, 1, heads, dim, device="cuda", generator=generator)
    k = (torch.randn((1, tokens, heads, dim), device="cuda", generator=generator) + offset).to(torch.bfloat16)
    v = torch.randn((1, tokens, heads, dim), device="cuda", dtype=torch.bfloat16, generator=generator)
    return q, k, v, generator


def ragged_check(configs) -> list[dict]:
    """Keys not a whole number of tiles, queries not a whole block, a key mask, an all-masked batch row: each config
    against exact attention and the portable kernel's log-sum-exp."""
    rows = []
    q, k, v, generator = inputs(1000, 4, 128, seed=1, q_tokens=777)
    q, k, v = (torch.cat([x, x.flip(1)]) for x in (q, k, v))
    key_mask = torch.rand(2, 1000, device="cuda", generator=generator) > 0.3
    key_mask[1] = False
    ref_out, ref_lse = portable.fp8_attention_with_lse(q, k, v, key_mask)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * 128**-0.5
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    exact = torch.nan_to_num(torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v.float()))
    for config in configs:
        out, lse = run_hopper(q, k, v, config, key_mask)
        error = ((out[0].float() - exact[0]).norm() / exact[0].norm()).item()
        rows.append({"shape": "ragged 777×1000, masked", "method": f"hopper {config}", "rel_l2": error,
                     "lse_diff": (lse[0] - ref_lse[0]).abs().max().item(),
                     "masked_row_zero": bool((out[1] == 0).all()),
                     "masked_lse_inf": bool(torch.isinf(lse[1]).all())})  # fmt: skip
        print(rows[-1], flush=True)
    portable_error = ((ref_out[0].float() - exact[0]).norm() / exact[0].norm()).item()
    rows.append({"shape": "ragged 777×1000, masked", "method": "portable", "rel_l2": portable_error})
    return rows


def bench_shape(name: str, configs) -> list[dict]:
    tokens, heads, dim = SHAPES[name]
    q, k, v, generator = inputs(tokens, heads, dim)
    sample = torch.randperm(tokens, device="cuda", generator=generator)[:SAMPLE_QUERIES]
    exact = exact_sample(q, k, v, sample)
    flop = 4 * tokens * tokens * heads * dim
    iters = max(3, min(50, int(2e15 / flop)))
    sdpa_ms = time_cuda_ms(lambda: sdpa_attention(q, k, v), warmup=3, iters=iters)
    rows = [{"shape": name, "method": "sdpa bf16", "ms": sdpa_ms, "tflops": flop / sdpa_ms / 1e9, "speedup": 1.0,
             "rel_l2": relative_l2(sdpa_attention(q, k, v), exact, sample)}]  # fmt: skip
    ref_out, ref_lse = portable.fp8_attention_with_lse(q, k, v)
    ms = time_cuda_ms(lambda: portable.fp8_attention_with_lse(q, k, v), warmup=3, iters=iters)
    rows.append({"shape": name, "method": "portable triton", "ms": ms, "tflops": flop / ms / 1e9,
                 "speedup": sdpa_ms / ms, "rel_l2": relative_l2(ref_out, exact, sample)})  # fmt: skip
    for config in configs:
        try:
            out, lse = run_hopper(q, k, v, config)
            ms = time_cuda_ms(lambda config=config: run_hopper(q, k, v, config), warmup=3, iters=iters)
        except Exception as error:  # a config that does not compile or fit is reported, not fatal
            rows.append({"shape": name, "method": f"hopper {config}", "error": repr(error)[:300]})
            print(rows[-1], flush=True)
            continue
        rows.append({"shape": name, "method": f"hopper {config}", "ms": ms, "tflops": flop / ms / 1e9,
                     "speedup": sdpa_ms / ms, "rel_l2": relative_l2(out, exact, sample),
                     "lse_diff": (lse - ref_lse).abs().max().item()})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["wan-720p", "wan-480p", "ti2v-5b-704p", "flux2-dev-1024"])
    parser.add_argument(
        "--configs", nargs="*", default=[",".join(str(int(part)) for part in config) for config in hopper.CONFIGS]
    )
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    configs = [tuple(int(part) for part in config.split(",")) for config in args.configs]
    portable._hopper_configs = lambda *_: []  # the portable kernel's rows time it alone
    env = environment()
    import triton

    env["triton"] = triton.__version__
    print(env, flush=True)
    rows = ragged_check(configs)
    for name in args.shapes:
        rows += bench_shape(name, configs)
        write_json(args.out_dir, "fp8_attention_hopper", {"environment": env, "rows": rows})
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
