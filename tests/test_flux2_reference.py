"""paradit's FLUX.2 against diffusers' reference, on the same tiny random checkpoint folders and seeds (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

from paradit import Engine, GenerationRequest
from paradit.checkpoint import safetensors_files
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from tests.checkpoints import load_module_weights, relative_l2


def load_ours(folder) -> Flux2Transformer:
    config = Flux2Config.from_dict(Flux2Transformer2DModel.load_config(folder / "transformer"))
    with torch.device("meta"):
        model = Flux2Transformer(config)
    load_module_weights(model, safetensors_files(folder / "transformer"), torch.device("cpu"), torch.float32)
    return model.eval()


def transformer_inputs(config, batch, rows, cols, text_len, seed):
    gen = torch.Generator().manual_seed(seed)
    one = torch.arange(1)
    return dict(
        hidden_states=torch.randn(batch, rows * cols, config["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_ids=torch.cartesian_prod(one, torch.arange(rows), torch.arange(cols), one),
        txt_ids=torch.cartesian_prod(one, one, one, torch.arange(text_len)),
    )


@pytest.mark.parametrize(
    "checkpoint,batch,rows,cols,text_len",
    [
        ("klein_checkpoint", 1, 4, 4, 8),
        ("klein_checkpoint", 2, 3, 5, 13),
        ("dev_checkpoint", 2, 6, 2, 5),
        ("dev_checkpoint", 1, 5, 7, 1),
    ],
)
def test_transformer_matches_diffusers(request, checkpoint, batch, rows, cols, text_len):
    folder = request.getfixturevalue(checkpoint)
    reference = Flux2Transformer2DModel.from_pretrained(folder / "transformer").eval()
    ours = load_ours(folder)
    inputs = transformer_inputs(reference.config, batch, rows, cols, text_len, seed=batch * 100 + rows)
    guidance = torch.full((batch,), 3.5) if reference.config.guidance_embeds else None
    with torch.no_grad():
        expected = reference(**inputs, guidance=guidance, return_dict=False)[0]
        got = ours(**inputs, guidance=guidance)
    assert got.shape == expected.shape
    assert relative_l2(got, expected) <= 1e-5


def test_klein_images_match_diffusers(klein_checkpoint):
    """True CFG (default empty negative prompt), two prompts x two images, a non-square size."""
    prompts = ["a red fox in snow", "a lighthouse at dusk"]
    kwargs = dict(height=48, width=80, num_inference_steps=3, guidance_scale=4.0, num_images_per_prompt=2)
    reference = Flux2KleinPipeline.from_pretrained(klein_checkpoint, dtype=torch.float32)
    expected = reference(prompt=prompts, generator=torch.Generator("cpu").manual_seed(7), output_type="np", **kwargs)
    engine = Engine(str(klein_checkpoint), device="cpu", dtype="fp32")
    result = engine.generate(
        GenerationRequest(prompt=prompts, height=48, width=80, steps=3, guidance=4.0, seed=7, num_images_per_prompt=2)
    )
    got = result.pixels.permute(0, 2, 3, 1).numpy()
    assert got.shape == expected.images.shape == (4, 48, 80, 3)
    assert np.abs(got - expected.images).max() <= 1e-4
    # The four images differ from each other: seeds and prompts reached the right samples.
    assert np.abs(got[0] - got[1]).max() > 1e-3 and np.abs(got[0] - got[2]).max() > 1e-3


def test_dev_images_match_diffusers(dev_checkpoint):
    """Mistral3 prompt format with its system message, embedded guidance, truncated encoder (layer 30 of 32)."""
    reference = Flux2Pipeline.from_pretrained(dev_checkpoint, dtype=torch.float32)
    expected = reference(
        prompt="a bowl of ramen",
        height=64,
        width=32,
        num_inference_steps=3,
        guidance_scale=2.5,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    )
    engine = Engine(str(dev_checkpoint), device="cpu", dtype="fp32")
    result = engine.generate(
        GenerationRequest(prompt="a bowl of ramen", height=64, width=32, steps=3, guidance=2.5, seed=3)
    )
    got = result.pixels.permute(0, 2, 3, 1).numpy()
    assert got.shape == expected.images.shape
    assert np.abs(got - expected.images).max() <= 1e-4


def test_distilled_klein_matches_diffusers_without_cfg(tmp_path):
    from tests.checkpoint_cache import cached
    from tests.checkpoints import build_klein_checkpoint

    folder = cached(build_klein_checkpoint, 1, True)  # distilled
    reference = Flux2KleinPipeline.from_pretrained(folder, dtype=torch.float32)
    expected = reference(
        prompt="a cat",
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    )
    engine = Engine(str(folder), device="cpu", dtype="fp32")
    assert engine.spec.guidance_mode == "none" and engine.spec.steps == 4
    got = engine.generate(GenerationRequest(prompt="a cat", height=32, width=32, steps=2, seed=0)).pixels
    assert np.abs(got.permute(0, 2, 3, 1).numpy() - expected.images).max() <= 1e-4
