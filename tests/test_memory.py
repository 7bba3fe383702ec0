"""The per-GPU memory cap: sizes parse, the estimate counts the real modules (PipeFusion's stage, the prompt encoders
as placed), the plan offloads the prompt encoders only when they do not fit beside the rest, and a plan over the cap
is refused with its numbers before anything loads."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from benchmarks.common import estimate
from paradit import Engine, InvalidRequest
from paradit.cli import main
from paradit.families import FAMILIES, PRESETS
from paradit.families.flux2.family import FAMILY as FLUX2
from paradit.family import Measured
from paradit.memory import WORKING_MARGIN, check_fits, estimates, parse_size, working_units
from paradit.parallel import ParallelConfig

CAP_32 = 32 * 2**30


@pytest.mark.parametrize(
    "text,expected",
    [("32GiB", 32 * 2**30), ("30GB", 30 * 10**9), ("512 MiB", 512 * 2**20), ("1.5gib", 3 * 2**29), ("1TiB", 2**40)],
)
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


def test_bad_size_names_the_accepted_forms():
    with pytest.raises(
        InvalidRequest, match="'32 parsecs' is not understood; write a number and a unit: B, KB, .* TiB"
    ):
        parse_size("32 parsecs")


def param_bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


def test_estimate_counts_exactly_what_the_engine_loads():
    engine = Engine("flux2-tiny", device="cpu", dtype="fp32", max_gpu_memory="1GiB")
    plan = engine.memory_plan
    pipeline = engine.pipeline
    assert plan.transformer == param_bytes([pipeline.transformer])
    assert plan.text_encoders == param_bytes([pipeline.prompt_encoder.decoder])
    assert plan.vae == param_bytes([pipeline.vae])
    assert 0 < plan.activations < plan.total


def test_tensor_parallel_and_fp8_shrink_the_transformer_share():
    spec = PRESETS["flux2-dev"]
    whole = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=False)
    assert 59 * 2**30 < whole.transformer < 61 * 2**30  # 32.2B parameters in bf16
    halves = estimate(spec, ParallelConfig(tensor=2), torch.bfloat16, fp8=False)
    fp8 = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=True)
    assert 0.49 < halves.transformer / whole.transformer < 0.52
    assert 0.49 < fp8.transformer / whole.transformer < 0.52
    assert halves.text_encoders == whole.text_encoders  # rank 0 still holds the whole prompt encoder


def test_a_plan_over_the_cap_is_refused_before_loading(capsys):
    start = time.monotonic()
    args = ["generate", "--model", "flux2-dev", "--load-format", "dummy", "--device", "cpu", "--dtype", "bf16"]
    assert main([*args, "--prompt", "x", "--max-gpu-memory", "32GiB"]) == 2
    assert time.monotonic() - start < 10  # nothing was built: a 32B model would take far longer
    error = capsys.readouterr().err.strip()
    assert error.startswith("paradit: error: flux2-dev with 1 GPU does not fit under --max-gpu-memory 32.0 GiB")
    assert len(error.splitlines()) == 1
    # Every placement was tried; the smallest plan's numbers are given, and only advice not taken already.
    assert "its smallest plan needs 63.8 GiB on rank 0 (transformer weights 60.0, text encoders 1.3 streamed" in error
    assert "use --quantize fp8" in error and "--text-encoder-placement" not in error
    assert main([*args, "--prompt", "x", "--max-gpu-memory", "32GiB", "--text-encoder-placement", "gpu"]) == 2
    error = capsys.readouterr().err
    assert "needs 96.1 GiB" in error and "--text-encoder-placement offload" in error, error


def test_pipefusion_keeps_only_the_first_stage_on_rank_0():
    spec = PRESETS["flux2-dev"]
    whole = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=False)
    staged = estimate(spec, ParallelConfig(pipefusion=2), torch.bfloat16, fp8=False)
    with torch.device("meta"):
        model = FLUX2.build_transformer(spec)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    later_stage = sum(p.numel() for block in blocks[len(blocks) // 2 :] for p in block.parameters()) * 2
    assert staged.transformer == whole.transformer - later_stage
    # Each of the stage's blocks keeps the whole sequence's K and V for the patched steps, on top of the working set:
    # the larger of a block's (FLUX.2's measured units a token of the width) and the VAE decode's band (half of one
    # GPU's decode, measured per pixel), with the working margin.
    tokens, width = 1024 * 1024 // 256 + 512, 48 * 128
    block = working_units(spec, "activations", False, False) * tokens * width * 2
    decode = working_units(spec, "vae_decode", False, False) * 1024 * 1024 * 2
    assert whole.activations == int(max(block, decode) * WORKING_MARGIN)  # one GPU: the whole decode dominates
    staged_working = max(block, decode / 2) + len(blocks) // 2 * 2 * tokens * width * 2
    assert staged.activations == int(staged_working * WORKING_MARGIN)


def test_working_memory_nobody_measured_takes_the_largest_figure_there_is(monkeypatch):
    """A preset without figures of its own takes its family's largest, and a family measured nowhere the largest of
    any family: an estimate that errs high, where ``max()`` of nothing once failed every capped run."""
    tiny = PRESETS["flux2-tiny"]
    klein = FAMILIES["flux2"].measured.activations["flux2-klein-4b"]["eager"]["bf16"]
    assert working_units(tiny, "activations", False, False) == klein == 22.57  # FLUX.2's largest eager bf16 figure
    every = [family.measured for family in FAMILIES.values()]
    largest = max(
        x for m in every for entry in m.activations.values() for mode in entry.values() for x in mode.values()
    )
    largest_decode = max(x for m in every for x in m.vae_decode.values())
    monkeypatch.setitem(FAMILIES, "flux2", dataclasses.replace(FAMILIES["flux2"], measured=Measured()))
    assert working_units(tiny, "activations", False, False) == largest == 47.5  # Wan TI2V-5B's eager FP8 figure
    assert working_units(tiny, "vae_decode", False, False) == largest_decode == 6158
    plan = check_fits(tiny, ParallelConfig(), torch.float32, False, CAP_32)
    assert plan.activations == int(6158 * 128 * 128 * 4 * WORKING_MARGIN)  # the decode's working set dominates


@pytest.mark.parametrize(
    "model,parallel,fp8,placement",
    [
        ("flux2-dev", ParallelConfig(tensor=2), True, "offload"),  # 16 GiB of blocks leave no room for 32 GiB
        ("flux2-dev", ParallelConfig(pipefusion=2), True, "offload"),
        ("qwen-image", ParallelConfig(tensor=2), False, "offload"),
        ("qwen-image", ParallelConfig(tensor=2), True, "gpu"),  # 9.6 GiB of blocks leave room for its 13.2
        ("qwen-image", ParallelConfig(), True, "offload"),  # its modulation stays bf16: 25.4 GiB leave no room for 7.1
    ],
)
def test_the_plan_offloads_the_prompt_encoders_only_when_they_do_not_fit(model, parallel, fp8, placement):
    plan = check_fits(PRESETS[model], parallel, torch.bfloat16, fp8, CAP_32)
    assert plan.text_encoder_placement == placement
    assert plan.total <= CAP_32
    resident = estimate(PRESETS[model], parallel, torch.bfloat16, fp8, placement="gpu")
    if placement != "gpu":
        assert resident.total > CAP_32
    if placement == "offload":
        assert not fp8 or estimate(PRESETS[model], parallel, torch.bfloat16, fp8, placement="fp8").total > CAP_32
        assert plan.text_encoders < 2 * 2**30 < resident.text_encoders  # about one embedding table on the GPU
        assert "streamed from CPU memory" in plan.describe()


def test_a_tiny_model_offloads_under_a_tiny_cap_and_not_above_it():
    spec = PRESETS["flux2-tiny"]
    plans = estimates(spec, ParallelConfig(), torch.float32, fp8=False)
    resident, offloaded = plans["gpu"], plans["offload"]
    assert offloaded.total < resident.total
    assert check_fits(spec, ParallelConfig(), torch.float32, False, resident.total).text_encoder_placement == "gpu"
    squeezed = check_fits(spec, ParallelConfig(), torch.float32, False, resident.total - 1)
    assert squeezed == offloaded
    with pytest.raises(InvalidRequest, match=r"does not fit .* its smallest plan needs .* streamed from CPU memory"):
        check_fits(spec, ParallelConfig(), torch.float32, False, offloaded.total - 1)


def test_engine_offloads_under_a_tiny_cap_and_a_forced_placement_is_kept():
    spec = PRESETS["flux2-tiny"]
    resident = estimate(spec, ParallelConfig(), torch.float32, fp8=False)
    squeezed = Engine(spec, device="cpu", dtype="fp32", max_gpu_memory=resident.total - 1)
    assert squeezed.text_encoder_placement == squeezed.memory_plan.text_encoder_placement == "offload"
    assert hasattr(squeezed.pipeline.prompt_encoder.decoder, "_hf_hook")  # accelerate's offload hooks
    with pytest.raises(InvalidRequest, match="text encoders .* resident"):
        Engine(spec, device="cpu", dtype="fp32", max_gpu_memory=resident.total - 1, text_encoder_placement="gpu")
    forced = Engine(spec, device="cpu", dtype="fp32", text_encoder_placement="offload")
    assert forced.text_encoder_placement == "offload" and forced.memory_plan is None
    assert Engine(spec, device="cpu", dtype="fp32").text_encoder_placement == "gpu"  # no cap: resident


def test_fp8_prompt_encoders_need_an_fp8_run():
    spec = PRESETS["qwen-image"]
    with pytest.raises(InvalidRequest, match=r"placement fp8 needs FP8 execution \(--quantize fp8\)"):
        check_fits(spec, ParallelConfig(), torch.bfloat16, False, CAP_32, placement="fp8")
    with pytest.raises(InvalidRequest, match="placement fp8 needs FP8 execution"):
        Engine("flux2-tiny", device="cpu", text_encoder_placement="fp8")
    # Without FP8 execution the plan does not try FP8 encoders: offloaded, though FP8 ones would fit.
    bf16 = check_fits(spec, ParallelConfig(tensor=2), torch.bfloat16, False, CAP_32)
    assert bf16.text_encoder_placement == "offload"
    assert estimate(spec, ParallelConfig(tensor=2), torch.bfloat16, False, placement="fp8").total < CAP_32


def test_an_unknown_placement_is_refused_naming_the_allowed_ones(capsys):
    with pytest.raises(InvalidRequest, match="placement 'disk' is not allowed; choose one of auto, gpu, fp8, offload"):
        Engine("flux2-tiny", device="cpu", text_encoder_placement="disk")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--text-encoder-placement", "disk"])
    error = capsys.readouterr().err
    assert "--text-encoder-placement: invalid choice: 'disk'" in error
    assert all(name in error for name in ("auto", "gpu", "fp8", "offload"))


def test_both_experts_of_a_two_expert_model_are_counted():
    """Wan 2.2 A14B keeps its high- and low-noise experts resident on every rank: the estimate holds both."""
    spec = PRESETS["wan2.2-t2v-a14b"]
    both = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=False).transformer
    one = estimate(dataclasses.replace(spec, experts={}), ParallelConfig(), torch.bfloat16, fp8=False).transformer
    assert both == 2 * one and one == 14_288_491_584 * 2  # the published expert's parameters, in bf16


def test_a_decode_that_only_fits_in_tiles_is_tiled_and_its_error_measured():
    """The memory plan's last resort: when no placement fits with the whole decode, the VAE decodes tile by tile (every
    rank alone). sd3.5-tiny's VAE tiles at 128 px, so a 256² image really is decoded in blended tiles; its distance
    from the whole decode is measured here (the blend is not exact): 30.0 dB PSNR on tiny random weights, bound 25."""
    from paradit import GenerationRequest

    spec = dataclasses.replace(PRESETS["sd3.5-tiny"], height=256, width=256)
    whole = estimate(spec, ParallelConfig(), torch.float32, False)
    tiled = estimates(spec, ParallelConfig(), torch.float32, False, vae_tiled=True)["gpu"]
    assert tiled.total < whole.total and tiled.vae_tiled and "VAE decoded in tiles" in tiled.describe()
    cap = (tiled.total + whole.total) // 2
    assert check_fits(spec, ParallelConfig(), torch.float32, False, cap).vae_tiled
    assert not check_fits(spec, ParallelConfig(), torch.float32, False, whole.total).vae_tiled  # tiles only if needed
    request = GenerationRequest(prompt="a tiled roof", height=256, width=256, steps=1, seed=4)
    plain = Engine("sd3.5-tiny", device="cpu", dtype="fp32").generate(request).pixels
    with Engine("sd3.5-tiny", device="cpu", dtype="fp32", max_gpu_memory=f"{cap}B", request=request) as engine:
        assert engine.memory_plan.vae_tiled and engine.pipeline.vae.use_tiling
        pixels = engine.generate().pixels
    mse = ((pixels - plain) ** 2).mean().item()
    psnr = 10 * torch.log10(torch.tensor(1.0 / mse)).item()
    assert 0 < mse and psnr > 25, psnr  # the tiles really changed the decode, and only a little


# Peaks measured on one H200 (docs/benchmarks.md, "Memory estimates against measured peaks"): model, FP8, experts
# swapped, prompt-encoder placement, size, compiled, peak GiB.
MEASURED_PEAKS = [
    ("flux2-dev", False, False, "gpu", "1024x1024", False, 94.92),
    ("flux2-dev", True, False, "gpu", "1024x1024", False, 65.68),
    ("flux2-klein-4b", False, False, "gpu", "1024x1024", False, 15.65),
    ("flux2-klein-4b", True, False, "gpu", "1024x1024", False, 12.25),
    ("flux2-klein-9b", False, False, "gpu", "1024x1024", False, 30.36),
    ("flux2-klein-9b", True, False, "gpu", "1024x1024", False, 22.24),
    ("qwen-image", False, False, "gpu", "1024x1024", False, 55.69),
    ("qwen-image", True, False, "gpu", "1024x1024", False, 43.18),
    ("sd3.5-large", False, False, "gpu", "1024x1024", False, 28.76),
    ("sd3.5-large", True, False, "gpu", "1024x1024", False, 23.49),
    ("sd3.5-medium", False, False, "gpu", "1024x1024", False, 17.88),
    ("sd3.5-medium", True, False, "gpu", "1024x1024", False, 16.47),
    ("z-image", False, False, "gpu", "1024x1024", False, 21.5),
    ("z-image", True, False, "gpu", "1024x1024", False, 15.8),
    ("wan2.2-ti2v-5b", True, False, "offload", "832x480x81", False, 10.74),
    ("wan2.2-ti2v-5b", True, False, "offload", "1280x704x81", False, 16.53),
    ("wan2.2-t2v-a14b", True, True, "offload", "832x480x81", False, 25.49),
    ("wan2.2-t2v-a14b", True, True, "offload", "1280x720x81", False, 40.7),
    ("wan2.2-ti2v-5b", True, False, "offload", "832x480x81", True, 10.74),
    ("wan2.2-ti2v-5b", True, False, "offload", "1280x704x81", True, 16.53),
    ("wan2.2-t2v-a14b", True, True, "offload", "832x480x81", True, 18.95),
    ("wan2.2-t2v-a14b", True, True, "offload", "1280x720x81", True, 25.62),
    ("wan2.2-ti2v-5b", False, False, "offload", "832x480x81", True, 15.29),
    ("wan2.2-ti2v-5b", False, False, "offload", "1280x704x81", True, 21.08),
    ("wan2.2-t2v-a14b", False, True, "offload", "832x480x81", True, 31.42),
    ("wan2.2-t2v-a14b", False, True, "offload", "1280x720x81", True, 37.24),
]


def test_every_estimate_is_at_or_above_its_measured_peak_and_at_most_20_percent_above():
    """The plan said 50.3 GiB for Wan 2.2 A14B at 720p, which peaked at 25.6: a 32 GB card was refused what it runs."""
    for model, fp8, swap, placement, size, compiled, peak in MEASURED_PEAKS:
        width, height, *frames = map(int, size.split("x"))
        spec = dataclasses.replace(PRESETS[model], width=width, height=height, frames=frames[0] if frames else None)
        planned = estimate(spec, ParallelConfig(), torch.bfloat16, fp8, placement, swap, compiled).total / 2**30
        assert peak <= planned <= 1.2 * peak, (model, size, compiled, planned, peak)
