"""Wan 2.2 A14B with its experts taking turns on one GPU: what a switch costs, and a whole video on a 32 GiB budget.

Part 1: two full-size A14B experts (random bf16 weights), one resident and one in pinned host memory; each switch
copies the incoming expert in (and releases the outgoing one), timed in both directions, with the host-to-device
rate it reached and the expert's output before and after a round trip (it must be bit-identical).

Part 2: a whole request through the Engine on one GPU capped at ``--max-gpu-memory``: A14B (both experts, FP8, the
idle one in host memory), umT5 (placed by the memory plan), the VAE; per-phase seconds (text encoding, the steps of
each expert, the switch, decoding) and the peak.

    python benchmarks/expert_swap.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, init_dummy_weights, write_json  # noqa: E402
from paradit.expert_swap import ExpertSwap  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.wan.model import WanConfig, WanTransformer  # noqa: E402


def switch_costs(repeats: int) -> dict:
    device = torch.device("cuda")
    config = WanConfig.from_dict(PRESETS["wan2.2-t2v-a14b"].transformer)
    experts = {}
    for name in ("transformer", "transformer_2"):
        with torch.device("meta"):
            experts[name] = WanTransformer(config).eval()
        init_dummy_weights(experts[name], device, torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(1, 16, 2, 60, 104, device=device, generator=gen, dtype=torch.bfloat16)
    text = torch.randn(1, 512, config.text_dim, device=device, generator=gen, dtype=torch.bfloat16)
    timestep = torch.tensor([500.0], device=device)
    with torch.inference_mode():
        before = experts["transformer_2"](latents, timestep, text)
    swap = ExpertSwap(device)
    swap.add("transformer_2", experts["transformer_2"], resident=False)
    swap.add("transformer", experts["transformer"], resident=True)
    torch.cuda.synchronize()
    resident_gib = torch.cuda.memory_allocated() / 2**30
    size = swap.bytes_per_expert()["transformer_2"]
    times = {"in": [], "back": []}
    for _ in range(repeats):
        for direction, name in (("in", "transformer_2"), ("back", "transformer")):
            start = time.perf_counter()
            swap.activate(name)
            times[direction].append(time.perf_counter() - start)
    swap.activate("transformer_2")
    with torch.inference_mode():
        after = experts["transformer_2"](latents, timestep, text)
    result = {
        "expert_gib": size / 2**30,
        "resident_gib_after_swap_setup": resident_gib,
        "switch_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
        "round_trip_bit_identical": bool(torch.equal(before, after)),
    }
    result["host_to_device_gb_s"] = size / result["switch_s"]["in"] / 1e9
    print(
        f"switch: expert {result['expert_gib']:.1f} GiB, in {result['switch_s']['in']:.2f} s, back "
        f"{result['switch_s']['back']:.2f} s ({result['host_to_device_gb_s']:.1f} GB/s), device memory with one "
        f"expert resident {resident_gib:.1f} GiB, round trip identical: {result['round_trip_bit_identical']}",
        flush=True,
    )
    return result


def whole_video(args) -> dict:
    from paradit import Engine, GenerationRequest
    from paradit.options import ExecutionOptions

    request = GenerationRequest(
        prompt="a heron lands on a misty lake",
        height=args.height,
        width=args.width,
        frames=args.frames,
        steps=args.steps,
        seed=0,
    )
    start = time.perf_counter()
    engine = Engine(
        "wan2.2-t2v-a14b",
        load_format="dummy",
        max_gpu_memory=args.max_gpu_memory,
        request=request,
        options=ExecutionOptions(quantize="fp8", swap_experts=True),
    )
    load_s = time.perf_counter() - start
    print(f"loaded in {load_s:.0f} s; plan: {engine.memory_plan.describe()}", flush=True)
    swap = engine.pipeline.expert_swap
    engine.generate(request)  # compiles both experts' blocks
    swap.switch_seconds = 0.0
    result = engine.generate(request)
    timings = result.timings
    boundary = PRESETS["wan2.2-t2v-a14b"].details.boundary_ratio * 1000
    scheduler_steps = [float(t) for t in engine.pipeline.make_scheduler(engine.check(request), None)[1]]
    high = [ms for ms, t in zip(timings.step_ms, scheduler_steps) if t >= boundary]
    low = [ms for ms, t in zip(timings.step_ms, scheduler_steps) if t < boundary]
    record = {
        "request": {"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps},
        "max_gpu_memory": args.max_gpu_memory,
        "memory_plan": engine.memory_plan.describe(),
        "load_s": load_s,
        "text_encode_s": timings.text_encode_s,
        "high_noise_steps_ms": high,
        "low_noise_steps_ms": low,
        "switches_s": swap.switch_seconds,
        "vae_decode_s": timings.vae_decode_s,
        "total_s": timings.total_s,
        "peak_gib": timings.peak_memory_bytes / 2**30,
    }
    print(
        f"whole video {args.width}x{args.height}x{args.frames}, {args.steps} steps: text {timings.text_encode_s:.1f}"
        f" s; high-noise steps {[round(ms) for ms in high]} ms; low-noise {[round(ms) for ms in low]} ms (their "
        f"first includes the switch: {swap.switch_seconds:.2f} s); decode {timings.vae_decode_s:.1f} s; total "
        f"{timings.total_s:.1f} s; peak {record['peak_gib']:.1f} GiB under {args.max_gpu_memory}",
        flush=True,
    )
    engine.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-gpu-memory", default="32GiB")
    parser.add_argument("--parts", nargs="+", choices=["switch", "video"], default=["switch", "video"])
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    env = environment()
    print(f"{env['gpu']} torch {env['torch']}", flush=True)
    record = {"env": env, "args": vars(args)}
    if "switch" in args.parts:
        record["switch"] = switch_costs(args.repeats)
        torch.cuda.empty_cache()
        write_json(args.out_dir, "expert_swap.json", record)
    if "video" not in args.parts:
        return
    record["whole_video"] = whole_video(args)
    write_json(args.out_dir, "expert_swap.json", record)


if __name__ == "__main__":
    main()
