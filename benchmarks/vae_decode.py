"""VAE decode across GPUs: diffusers' plain ``vae.decode`` against paradit's banded decode (paradit.parallel.vae).

Rows: the FLUX.2 VAE (AutoencoderKLFlux2's default config, which is the published one) at 2048² and 4096², the
Qwen-Image VAE at 2048², Wan 2.1's VAE at 1280x720x81 and Wan 2.2's (TI2V-5B, 4x16x16) at 1280x704x121, bf16, and
Wan 2.2's again in fp32. Random weights (the same on every rank), random latents. For each row: seconds (median of
``--iters`` after ``--warmup``) and per-GPU peak memory of diffusers' ``vae.decode`` on one GPU (every rank runs
its own copy at the same time) and of ``parallel_decode`` on all ranks of the launch (world 1 without torchrun),
and the relative L2 of paradit's image against diffusers'. fp32 rows turn TF32 off (``--tf32`` keeps it), so
their relative L2 is the exactness check (<= 1e-5); bf16 rows differ by bf16 rounding only.

    python benchmarks/vae_decode.py --out-dir $OUT                             # one GPU
    torchrun --nproc-per-node 4 benchmarks/vae_decode.py --out-dir $OUT        # 4 GPUs
    torchrun --nproc-per-node 2 benchmarks/vae_decode.py --device cpu --tiny   # smoke test on gloo

``--fast`` (experimental, single-GPU speed) adds, for the FLUX.2 rows, diffusers' decoder in channels_last under
``torch.compile`` and paradit's banded decode in channels_last, both checked against the plain decode (exactly
with ``--dtype fp32``). The Wan
rows are long (tens of seconds per decode): run them with ``--rows`` in separate commands if a command has a time
limit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table  # noqa: E402
from paradit.parallel.vae import parallel_decode  # noqa: E402

# Wan 2.2 TI2V-5B's VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json; latents_mean/std left at the defaults,
# decode does not read them).
WAN22 = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}
# The tiny layouts of tests/test_parallel_vae.py, for smoke runs.
TINY = {
    "flux2": {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4, "layers_per_block": 1, "latent_channels": 4},
    "qwen": {"base_dim": 8, "z_dim": 4, "num_res_blocks": 1},
    "wan21": {"base_dim": 8, "z_dim": 4, "num_res_blocks": 1},
    "wan22": {
        "base_dim": 8,
        "decoder_base_dim": 12,
        "z_dim": 8,
        "num_res_blocks": 1,
        "is_residual": True,
        "in_channels": 12,
        "out_channels": 12,
        "patch_size": 2,
        "scale_factor_spatial": 16,
    },
}


@dataclass(frozen=True)
class Row:
    family: str  # flux2 | qwen | wan21 | wan22
    height: int
    width: int
    frames: int | None  # pixel frames; None for an image VAE
    dtype: torch.dtype
    tiny: tuple[int, int, int | None]  # (height, width, frames) with --tiny


ROWS = {
    "flux2-2048": Row("flux2", 2048, 2048, None, torch.bfloat16, (64, 64, None)),
    "flux2-4096": Row("flux2", 4096, 4096, None, torch.bfloat16, (128, 128, None)),
    "qwen-2048": Row("qwen", 2048, 2048, 1, torch.bfloat16, (64, 64, 1)),
    "wan21-720p": Row("wan21", 720, 1280, 81, torch.bfloat16, (48, 80, 9)),
    "wan22-704p": Row("wan22", 704, 1280, 121, torch.bfloat16, (64, 96, 9)),
    "wan22-704p-fp32": Row("wan22", 704, 1280, 121, torch.float32, (64, 96, 9)),
}


def build_vae(row: Row, tiny: bool, device: torch.device) -> torch.nn.Module:
    from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage, AutoencoderKLWan

    cls = {"flux2": AutoencoderKLFlux2, "qwen": AutoencoderKLQwenImage}.get(row.family, AutoencoderKLWan)
    config = TINY[row.family] if tiny else WAN22 if row.family == "wan22" else {}
    torch.manual_seed(0)
    with torch.device(device):
        vae = cls(**config)
    vae = vae.to(row.dtype).eval().requires_grad_(False)
    if dist.is_initialized():  # one set of weights, whatever each rank's generator did
        for tensor in vae.state_dict().values():
            dist.broadcast(tensor, 0)
    return vae


def latent_shape(vae, row: Row, tiny: bool) -> tuple[int, ...]:
    height, width, frames = row.tiny if tiny else (row.height, row.width, row.frames)
    factor = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    channels = vae.config.latent_channels if row.family == "flux2" else vae.config.z_dim
    time_axis = () if frames is None else ((frames - 1) // 4 + 1,)
    return (1, channels, *time_axis, height // factor, width // factor)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run, device: torch.device, warmup: int, iters: int) -> tuple[float, float | None, float | None, object]:
    """(median seconds, peak GiB allocated on this rank, of which above what was allocated before, last output)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    out, times = None, []
    for i in range(warmup + iters):
        out = None  # the previous output is no part of this call's memory
        if dist.is_initialized():
            dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = run()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if device.type != "cuda":
        return statistics.median(times), None, None, out
    peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), peak / 2**30, (peak - base) / 2**30, out


def max_over_ranks(value: float | None, device: torch.device) -> float | None:
    if value is None or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench_row(name: str, args, device: torch.device, world: int) -> list[dict]:
    row = ROWS[name]
    if args.dtype:
        row = replace(row, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    vae = build_vae(row, args.tiny, device)
    shape = latent_shape(vae, row, args.tiny)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, row.dtype)
    weights_gib = sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**30
    runs = {}
    if not args.skip_plain:
        runs["diffusers"] = (1, lambda: vae.decode(latents).sample)
    runs["paradit"] = (world, lambda: parallel_decode(vae, latents))
    if args.fast and row.family == "flux2":
        fast = copy.deepcopy(vae).to(memory_format=torch.channels_last)
        fast_latents = latents.contiguous(memory_format=torch.channels_last)
        decoder = torch.compile(fast.decoder)
        runs["diffusers-cl-compile"] = (1, lambda: decoder(fast.post_quant_conv(fast_latents)))
        runs["paradit-cl"] = (world, lambda: parallel_decode(fast, fast_latents))
    rows, reference = [], None
    for impl, (ranks, run) in runs.items():
        seconds, peak, working, out = measure(run, device, args.warmup, args.iters)
        rows.append(
            {
                "row": name,
                "impl": impl,
                "gpus": ranks,
                "latent": list(shape),
                "dtype": str(row.dtype).split(".")[-1],
                "seconds": max_over_ranks(seconds, device),
                "peak_gib": max_over_ranks(peak, device),
                "working_gib": max_over_ranks(working, device),
                "weights_gib": weights_gib,
            }
        )
        if impl == "diffusers":
            reference = out.cpu()  # off the GPU, so it counts in no other run's peak
        elif reference is not None:
            rows[-1]["rel_l2_vs_diffusers"] = relative_l2(out, reference.to(out.device))
            rows[-1]["speedup_vs_diffusers"] = rows[0]["seconds"] / rows[-1]["seconds"]
        del out
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on gloo")
    parser.add_argument("--tiny", action="store_true", help="tiny layouts and sizes (smoke runs)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--skip-plain", action="store_true", help="leave out diffusers' one-GPU decode")
    parser.add_argument("--fast", action="store_true", help="experimental single-GPU speed path (FLUX.2 rows)")
    parser.add_argument("--tf32", action="store_true", help="keep TF32 on for fp32 rows")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="override every row's dtype")
    parser.add_argument("--json", default=None, help="where to write the JSON (default: --out-dir/vae_decode.json)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT"))
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    if not args.tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    env = {"torch": torch.__version__, "world": world, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    if rank == 0:
        print(f"VAE decode on {world} x {env.get('gpu', 'cpu')}, torch {torch.__version__}", flush=True)
    rows = []
    for name in args.rows:
        rows += bench_row(name, args, device, world)
        if rank == 0:
            for r in rows:
                if r["row"] == name:
                    print(json.dumps(r), flush=True)
    if rank == 0:
        print_table(
            rows,
            [
                ("row", "row", "s"),
                ("impl", "impl", "s"),
                ("gpus", "GPUs", "d"),
                ("dtype", "dtype", "s"),
                ("seconds", "seconds", ".3f"),
                ("peak_gib", "peak GiB/GPU", ".2f"),
                ("working_gib", "working", ".2f"),
                ("speedup_vs_diffusers", "vs diffusers", ".2f"),
                ("rel_l2_vs_diffusers", "rel L2", ".1e"),
            ],
        )
        path = args.json or (str(Path(args.out_dir) / "vae_decode.json") if args.out_dir else None)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({"env": env, "args": vars(args), "rows": rows}, indent=2))
            print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
