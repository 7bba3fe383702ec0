"""Count every preset's transformer on the meta device and write the planner's model facts (``model_facts.json`` in
each family's folder).

For each preset: three forwards of one sample (the preset's size and text length, a smaller image or fewer frames, a
longer text), each counted by ``benchmarks/model_trace.py``, fitted into per-token counts by
``fit_facts``. No GPU and no weights: a few seconds on the CPU. Rerun it when a preset or a
model's code changes:

    python benchmarks/model_facts.py
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_trace import StepTrace, trace_step  # noqa: E402
from benchmarks.parallel_step import BENCHES  # noqa: E402
from paradit.compile import model_blocks  # noqa: E402
from paradit.families import FAMILIES, PRESETS  # noqa: E402
from paradit.families.wan.latents import vae_factors  # noqa: E402
from paradit.family import FACTS_FILE  # noqa: E402
from paradit.planner.facts import AttentionGroup, LinearGroup, ModelFacts, TokenLinear, Workload  # noqa: E402
from paradit.spec import ModelSpec  # noqa: E402

META = torch.device("meta")
WAN_TEXT_TOKENS = 512  # umT5's padded prompt length
# Pixels per image token side of every image family: latents at 1/8 patchified 2x2, or FLUX.2's 1/16 packed (the
# step inputs above are built that way).
IMAGE_TOKEN_SIDE = 16


def on_meta(value):
    """Tensors moved to the meta device, also inside tuples, dicts and records (Qwen-Image 2.1's cached prefix)."""
    if isinstance(value, torch.Tensor):
        return value.to(META)
    if isinstance(value, tuple):
        return tuple(on_meta(item) for item in value)
    if isinstance(value, dict):
        return {key: on_meta(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(
            value, **{f.name: on_meta(getattr(value, f.name)) for f in dataclasses.fields(value)}
        )
    return value


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
    per_token = spec.details.expand_timesteps
    timestep = torch.empty((1, tokens) if per_token else (1,), device=META)
    text = torch.empty(1, text_tokens, config.text_dim, device=META, dtype=torch.bfloat16)
    return lambda m: m(latents, timestep, text)


def workloads(spec: ModelSpec, text_tokens: int):
    """(reference, fewer image tokens, more text tokens): (size, frames, text tokens) each."""
    size, frames = (spec.height, spec.width), spec.frames
    text = (size, frames, text_tokens + 64)
    if frames is not None:  # a video's sizes are tied to its patch grid: fewer frames instead
        return (size, frames, text_tokens), (size, (frames - 1) // 2 + 1, text_tokens), text
    return (size, None, text_tokens), ((size[0] // 2, size[1] // 2), None, text_tokens), text


def fit_facts(
    traces: dict[Workload, StepTrace],
    *,
    preset: str,
    blocks: int,
    width: int,
    token_side: int,
    frame_stride: int | None,
    text_tokens: int,
    experts: int,
) -> ModelFacts:
    """Facts from three traces of one sample each: a reference workload, one with other image tokens, one with
    other text tokens."""
    (base, base_trace), (image, image_trace), (text, text_trace) = _three(traces)

    def line(value) -> TokenLinear:
        at_base = value(base_trace)
        per_image = (value(image_trace) - at_base) / (image.image_tokens - base.image_tokens)
        per_text = (value(text_trace) - at_base) / (text.text_tokens - base.text_tokens)
        fixed = at_base - per_image * base.image_tokens - per_text * base.text_tokens
        return TokenLinear(per_image, per_text, fixed)

    kinds = sorted(base_trace.linear_flops, key=lambda k: (k.in_blocks, k.sharded, k.fp8))
    linear = tuple(LinearGroup(kind, line(lambda t, kind=kind: t.linear_flops[kind])) for kind in kinds)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, call in enumerate(base_trace.attention):
        groups[(call.exchanged, call.heads, call.head_dim)].append(index)
    attention = []
    for (exchanged, heads, head_dim), indices in groups.items():
        # Calls of one shape group may still differ in which streams they attend over (image only, text only).
        by_tokens: dict[tuple[TokenLinear, TokenLinear], int] = defaultdict(int)
        for i in indices:
            query = line(lambda t, i=i: t.attention[i].query_tokens)
            key = line(lambda t, i=i: t.attention[i].key_tokens)
            by_tokens[(query, key)] += 1
        for (query, key), layers in by_tokens.items():
            attention.append(AttentionGroup(exchanged, heads, head_dim, layers, query, key))
    return ModelFacts(
        preset=preset,
        blocks=blocks,
        width=width,
        token_side=token_side,
        frame_stride=frame_stride,
        text_tokens=text_tokens,
        experts=experts,
        linear=linear,
        other_flops=line(lambda t: t.other_flops),
        prediction_elements=line(lambda t: t.prediction_elements),
        all_reduce_elements=line(lambda t: t.all_reduce_elements),
        all_reduce_calls=base_trace.all_reduce_calls,
        attention=tuple(attention),
    )


def _three(traces: dict[Workload, StepTrace]):
    """(reference, other image tokens, other text tokens), recognised by which count differs from the first."""
    items = list(traces.items())
    base = items[0][0]
    image = next(item for item in items[1:] if item[0].image_tokens != base.image_tokens)
    text = next(item for item in items[1:] if item[0].text_tokens != base.text_tokens)
    return items[0], image, text


def preset_facts(spec: ModelSpec) -> dict:
    family = FAMILIES[spec.family]
    with META:
        model = family.build_transformer(spec).to(torch.bfloat16)
    video = spec.frames is not None
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
        experts=1 + len(spec.experts),
    )
    return {key: value for key, value in asdict(facts).items() if key != "preset"}  # the preset's name keys them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    args = parser.parse_args()
    counted = defaultdict(dict)  # family -> preset -> facts
    for name in args.presets:
        facts = counted[PRESETS[name].family][name] = preset_facts(PRESETS[name])
        total = sum(g["flops"]["per_image"] for g in facts["linear"])
        print(f"{name}: {facts['blocks']} blocks, {total / 1e9:.2f} GFLOP of linears per image token")
    about = (
        "Per-sample FLOP counts and attention shapes of each preset's transformer, as linear functions of its "
        "image and text tokens, counted on the meta device. Written by benchmarks/model_facts.py; do not edit."
    )
    for family, models in counted.items():  # the presets counted replace theirs; the family's others stay
        path = FAMILIES[family].measured.folder / FACTS_FILE
        stored = json.loads(path.read_text())["models"] if path.is_file() else {}
        merged = {name: models.get(name, stored.get(name)) for name in PRESETS if name in models or name in stored}
        path.write_text(json.dumps({"about": about, "models": merged}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
