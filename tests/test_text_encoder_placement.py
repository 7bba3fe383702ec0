"""Prompt encoder placements. Offloaded to CPU memory: weights held by accelerate's hooks off the module, brought in
per submodule while encoding, and the same embeddings and images as resident encoders, bit for bit. In FP8: the
linears converted, the memory estimate exact, the embeddings' error measured.

On the CPU the weights are "streamed" to the device they already live on, so these tests check the mechanism (hooks
on every submodule with weights, the module's own weights on the meta device between calls, the copies in host
memory) and the numbers; the GPU only changes where the copies go.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.common import estimate
from paradit import Engine, GenerationRequest
from paradit.cli import main
from paradit.families import FAMILIES, PRESETS
from paradit.layers.fp8 import Fp8Linear
from paradit.parallel import ParallelConfig
from paradit.quantize import converts_to_fp8
from paradit.text_encoder import load_prompt_encoder, stream_weights

CPU = torch.device("cpu")
PROMPTS = ["a lighthouse on a cliff at dusk", "snow"]


def assert_streamed(module: nn.Module) -> None:
    """Every submodule with weights has an offload hook; its weights are on the meta device (nothing held) and the
    hook's copies in host memory."""
    holders = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    assert holders
    for holder in holders:
        hook = holder._hf_hook
        assert hook.offload and hook.execution_device == CPU
        for name, param in holder.named_parameters(recurse=False):
            assert param.device.type == "meta", name
            assert hook.weights_map[name].device == CPU, name


def encoder_modules(encoder) -> list[nn.Module]:
    return [m for m in vars(encoder).values() if isinstance(m, nn.Module)] + getattr(encoder, "clip_encoders", [])


def flat(output) -> list[torch.Tensor]:
    return list(output) if isinstance(output, tuple | list) else [output]


@pytest.mark.parametrize("preset", ["qwen-image-tiny", "z-image-tiny", "sd3.5-tiny"])
def test_offloaded_prompt_encoder_gives_the_resident_ones_embeddings(preset):
    spec = PRESETS[preset]
    pipeline = FAMILIES[spec.family]
    resident = load_prompt_encoder(pipeline, spec, CPU, torch.float32, True, "gpu")
    offloaded = load_prompt_encoder(pipeline, spec, CPU, torch.float32, True, "offload")
    modules = encoder_modules(offloaded)
    assert len(modules) == (3 if spec.family == "sd3" else 1)
    for module in modules:
        assert_streamed(module)
    expected, got = flat(resident.encode(PROMPTS, torch.float32)), flat(offloaded.encode(PROMPTS, torch.float32))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for module in modules:
        assert_streamed(module)  # encoding left nothing behind


def test_engine_with_offloaded_encoder_from_a_checkpoint_makes_the_same_image(dev_checkpoint):
    """FLUX.2-dev's truncated Mistral decoder, loaded from a checkpoint folder."""
    request = GenerationRequest(prompt="a red fox in snow", height=32, width=32, steps=2, seed=5)
    resident = Engine(str(dev_checkpoint), device="cpu", dtype="fp32")
    offloaded = Engine(str(dev_checkpoint), device="cpu", dtype="fp32", text_encoder_placement="offload")
    decoder = offloaded.pipeline.prompt_encoder.decoder
    assert_streamed(decoder)
    expected = resident.pipeline.prompt_encoder.encode(PROMPTS, torch.float32)
    assert torch.equal(offloaded.pipeline.prompt_encoder.encode(PROMPTS, torch.float32), expected)
    assert_streamed(decoder)
    image, expected_image = offloaded.generate(request), resident.generate(request)
    assert torch.equal(image.pixels, expected_image.pixels)
    assert (image.timings.text_encoders, expected_image.timings.text_encoders) == ("offload", "resident")


def test_cli_reports_the_placement(tmp_path, capsys):
    argv = [
        "generate",
        "--model",
        "flux2-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a boat",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--no-progress",
        "--out",
        str(tmp_path / "x.png"),
        "--text-encoder-placement",
        "offload",
    ]
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(row.split() == ["text", "encoder", "placement", "offload"] for row in rows), rows


def test_tied_weights_share_one_host_copy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 10))
    model[1].weight = model[0].weight
    ids = torch.tensor([[1, 2, 3]])
    expected = model(ids)
    stream_weights(model, CPU)
    assert_streamed(model)
    assert model[0]._hf_hook.weights_map["weight"].data_ptr() == model[1]._hf_hook.weights_map["weight"].data_ptr()
    assert torch.equal(model(ids), expected)


@pytest.mark.parametrize("preset", ["qwen-image-tiny", "sd3.5-tiny"])
def test_fp8_prompt_encoder_converts_its_linears_as_the_estimate_counts(preset):
    spec = PRESETS[preset]
    pipeline = FAMILIES[spec.family]
    resident = load_prompt_encoder(pipeline, spec, CPU, torch.float32, True, "gpu")
    converted = load_prompt_encoder(pipeline, spec, CPU, torch.float32, True, "fp8")
    modules = encoder_modules(converted)
    fp8 = [
        f"{i}.{name}"
        for i, module in enumerate(modules)
        for name, m in module.named_modules()
        if isinstance(m, Fp8Linear)
    ]
    chosen = [
        f"{i}.{name}"
        for i, module in enumerate(encoder_modules(resident))
        for name, m in module.named_modules()
        if converts_to_fp8(module, name, m)
    ]
    assert fp8 == chosen and len(fp8) > 10
    if spec.family == "sd3":  # transformers keeps T5's output projections in float32; so does the conversion
        assert all(type(m) is nn.Linear for n, m in converted.t5.named_modules() if n.endswith(".wo"))
    held = sum(p.numel() * p.element_size() for module in modules for p in module.parameters())
    assert held == estimate(spec, ParallelConfig(), torch.float32, fp8=True, placement="fp8").text_encoders
    expected, got = resident.encode(PROMPTS, torch.float32), converted.encode(PROMPTS, torch.float32)
    expected, got = flat(expected)[0], flat(got)[0]
    # FP8 is lossy: ~11% (Qwen2.5-VL) and ~7% (CLIP-L, bigG and T5) relative on these tiny random encoders, whose
    # weights are drawn at full scale (std 1/sqrt(fan_in)); a real checkpoint's error needs a GPU to measure.
    error = ((got - expected).norm() / expected.norm()).item()
    print(f"{preset}: FP8 prompt embeddings, relative L2 {error:.3f}")
    assert 0 < error < 0.15
