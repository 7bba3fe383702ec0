"""Count every preset's transformer on the meta device and write the planner's model facts (planner/models.json).

For each preset: three forwards of one sample (the preset's size and text length, a smaller image or fewer frames, a
longer text), each counted by ``paradit.planner.trace.trace_step``, fitted into per-token counts by
``paradit.planner.facts.fit_facts``. No GPU and no weights: a few seconds on the CPU. Rerun it when a preset or a
model's code changes:

    python benchmarks/model_facts.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.parallel_step import BENCHES  # noqa: E402
from paradit.compile import model_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.wan.pipeline import vae_factors  # noqa: E402
from paradit.planner.facts import FACTS_FILE, Workload, fit_facts  # noqa: E402
from paradit.planner.trace import trace_step  # noqa: E402
from paradit.spec import ModelSpec  # noqa: E402

META = torch.device("meta")
WAN_TEXT_TOKENS = 512  # umT5's padded prompt length
# Pixels per image token side of every image family: latents at 1/8 patchified 2x2, or FLUX.2's 1/16 packed (the
# step inputs above are built that way).
IMAGE_TOKEN_SIDE = 16


def on_meta(value):
    return value.to(META) if isinstance(value, torch.Tensor) else value


def image_call(spec: ModelSpec, model, size: tuple[int, int], text_tokens: int):
    """The benchmarks' one-step inputs for an image family, moved to the meta device, and how to call the model."""
    module, _ = BENCHES[spec.family]
    inputs = importlib.import_module(module).step_inputs(model.config, *size, text_tokens, torch.device("cpu"))
    if isinstance(inputs, dict):
        inputs = {key: on_meta(value) for key, value in inputs.items()}
        return lambda m: m(**inputs)
    inputs = tuple(on_meta(value) for value in inputs)
    return lambda m: m(*inputs)


def video_call(spec: ModelSpec, model, size: tuple[int, int], frames: int, text_tokens: int):
    config = model.config
    temporal, spatial = vae_factors(spec.vae)
    latents = torch.empty(
        1,
        config.in_channels,
        (frames - 1) // temporal + 1,
        size[0] // spatial,
        size[1] // spatial,
        device=META,
        dtype=torch.bfloat16,
    )
    tokens = latents[0, 0].numel() // (config.patch_size[1] * config.patch_size[2])
    per_token = spec.extra.get("expand_timesteps", False)
    timestep = torch.empty((1, tokens) if per_token else (1,), device=META)
    text = torch.empty(1, text_tokens, config.text_dim, device=META, dtype=torch.bfloat16)
    return lambda m: m(latents, timestep, text)


def workloads(spec: ModelSpec, text_tokens: int):
    """(reference, fewer image tokens, more text tokens): (size, frames, text tokens) each."""
    size, frames = (spec.height, spec.width), spec.extra.get("frames")
    text = (size, frames, text_tokens + 64)
    if frames is not None:  # a video's sizes are tied to its patch grid: fewer frames instead
        return (size, frames, text_tokens), (size, (frames - 1) // 2 + 1, text_tokens), text
    return (size, None, text_tokens), ((size[0] // 2, size[1] // 2), None, text_tokens), text


def preset_facts(spec: ModelSpec) -> dict:
    family = FAMILIES[spec.family]
    with META:
        model = family.pipeline.build_transformer(spec).to(torch.bfloat16)
    video = spec.extra.get("frames") is not None
    text_tokens = WAN_TEXT_TOKENS if video else BENCHES[spec.family][1]
    temporal, spatial = vae_factors(spec.vae)
    side = spatial * model.config.patch_size[1] if video else IMAGE_TOKEN_SIDE
    traces = {}
    for size, frames, text in workloads(spec, text_tokens):
        call = video_call(spec, model, size, frames, text) if video else image_call(spec, model, size, text)
        latent_frames = 1 if frames is None else (frames - 1) // temporal + 1
        image_tokens = (size[0] // side) * (size[1] // side) * latent_frames
        traces[Workload(image_tokens, text)] = trace_step(model, call, family.tensor_plan, family.keep_high_precision)
    widest = max(next(iter(traces.values())).attention, key=lambda call: call.heads * call.head_dim)
    facts = fit_facts(
        traces,
        preset=spec.name,
        blocks=len(model_blocks(model)),
        width=widest.heads * widest.head_dim,
        token_side=side,
        frame_stride=temporal if video else None,
        text_tokens=text_tokens,
        experts=1 + len(family.pipeline.expert_configs(spec)),
    )
    return facts.to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--out", default=str(FACTS_FILE))
    args = parser.parse_args()
    models = {}
    for name in args.presets:
        models[name] = preset_facts(PRESETS[name])
        total = sum(g["flops"]["per_image"] for g in models[name]["linear"])
        print(f"{name}: {models[name]['blocks']} blocks, {total / 1e9:.2f} GFLOP of linears per image token")
    about = (
        "Per-sample FLOP counts and attention shapes of each preset's transformer, as linear functions of its "
        "image and text tokens, counted on the meta device. Written by benchmarks/model_facts.py; do not edit."
    )
    Path(args.out).write_text(json.dumps({"about": about, "models": models}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
