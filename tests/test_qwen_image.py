"""Qwen-Image against diffusers' reference on tiny random checkpoint folders (fp32, CPU), and sequence / CFG
parallelism against one process (gloo, 2 and 4 processes), with prompts of different lengths (masked text) batched."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline as ReferencePipeline
from diffusers import QwenImageTransformer2DModel

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.checkpoint import safetensors_files
from paradit.errors import CheckpointError
from paradit.families import PRESETS
from paradit.families.qwen_image.family import resolve_request, uses_cfg
from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer
from paradit.parallel import ParallelConfig
from paradit.request import StepCacheConfig
from tests.checkpoint_cache import cached
from tests.checkpoints import load_module_weights, relative_l2
from tests.qwen_image_checkpoints import build_qwen_image_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint():
    return cached(build_qwen_image_checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return ReferencePipeline.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(str(checkpoint), device="cpu", dtype="fp32")


def load_ours(folder) -> QwenImageTransformer:
    config = QwenImageConfig.from_dict(QwenImageTransformer2DModel.load_config(folder / "transformer"))
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    load_module_weights(model, safetensors_files(folder / "transformer"), CPU, torch.float32)  # strict keys
    return model.eval()


def transformer_inputs(config, batch: int, rows: int, cols: int, text_lengths: list[int] | None, seed: int):
    """``text_lengths``: each sample's real text tokens (the rest padding, masked), or None for no mask."""
    gen = torch.Generator().manual_seed(seed)
    text_len = max(text_lengths) if text_lengths else 6
    mask = None
    if text_lengths:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(text_lengths)[:, None]).long()
    return dict(
        hidden_states=torch.randn(batch, rows * cols, config["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], generator=gen),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=gen),
    )


@pytest.mark.parametrize(
    "batch,rows,cols,text_lengths",
    [(1, 4, 4, None), (2, 3, 5, [13, 6]), (3, 7, 2, [1, 5, 3]), (1, 5, 7, [1])],
    ids=["square", "odd-grid-masked", "tall-masked", "one-token"],
)
def test_transformer_matches_diffusers(checkpoint, batch, rows, cols, text_lengths):
    """Centred image rotary positions (odd and even sides), text positions after them, masked padding."""
    reference = QwenImageTransformer2DModel.from_pretrained(checkpoint / "transformer").eval()
    ours = load_ours(checkpoint)
    inputs = transformer_inputs(reference.config, batch, rows, cols, text_lengths, seed=batch * 100 + rows)
    with torch.no_grad():
        expected = reference(**inputs, img_shapes=[[(1, rows, cols)]] * batch, return_dict=False)[0]
        got = ours(**inputs, rows=rows, cols=cols)
    assert got.shape == expected.shape
    assert relative_l2(got, expected) <= 1e-5


def test_padding_is_masked_out(checkpoint):
    """A sample's prediction does not depend on what its padded text positions hold."""
    ours = load_ours(checkpoint)
    inputs = transformer_inputs(dataclasses.asdict(ours.config), 2, 3, 4, [9, 4], seed=1)
    scrambled = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"].clone()}
    scrambled["encoder_hidden_states"][1, 4:] = 100.0
    with torch.no_grad():
        a, b = ours(**inputs, rows=3, cols=4), ours(**scrambled, rows=3, cols=4)
    assert torch.equal(a, b)


def test_prompt_encoding_matches_diffusers(reference, engine):
    """Template, 34 dropped tokens, last hidden state, padding to the longest prompt and its mask."""
    prompts = ["a fox", "an old lighthouse on a cliff at dusk, oil painting"]
    expected, expected_mask = reference.encode_prompt(prompts, device=CPU)
    got, got_mask = engine.pipeline.prompt_encoder.encode(prompts, torch.float32)
    assert got.shape == expected.shape and got_mask.shape == expected_mask.shape
    assert torch.equal(got_mask, expected_mask.bool()) and not got_mask.all()
    assert torch.equal(got, expected)


def to_hwc(result) -> np.ndarray:
    return result.pixels.permute(0, 2, 3, 1).numpy()


IMAGE_CASES = {
    # CFG with prompts and negative prompts of different lengths: every branch padded and masked.
    "cfg-masked-batch": dict(
        prompt=["a red fox in snow", "a lighthouse at dusk, oil on canvas"],
        negative_prompt=["blurry", "low quality, watermark, text"],
        height=48,
        width=80,
        steps=3,
        guidance=4.0,
        seed=7,
    ),
    # One prompt, three images, the blank negative prompt Qwen-Image's authors use.
    "cfg-images-per-prompt": dict(
        prompt="a bowl of ramen",
        negative_prompt=" ",
        height=32,
        width=32,
        steps=2,
        guidance=2.5,
        seed=3,
        num_images_per_prompt=3,
    ),
    # No negative prompt: diffusers runs no CFG whatever the guidance, and neither does paradit.
    "no-negative-no-cfg": dict(
        prompt=["a cat", "a dog"],
        height=64,
        width=32,
        steps=2,
        seed=1,
        num_images_per_prompt=2,
    ),
}


def diffusers_images(reference, request: GenerationRequest) -> np.ndarray:
    """What diffusers' pipeline makes of ``request``, as float HWC arrays."""
    return reference(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        true_cfg_scale=request.guidance or 4.0,
        height=request.height,
        width=request.width,
        num_inference_steps=request.steps,
        num_images_per_prompt=request.num_images_per_prompt,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
    ).images


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_images_match_diffusers(reference, engine, case):
    request = GenerationRequest(**IMAGE_CASES[case])
    expected = diffusers_images(reference, request)
    got = to_hwc(engine.generate(request))
    assert got.shape == expected.shape == (len(request.prompts) * request.num_images_per_prompt, *expected.shape[1:])
    assert np.abs(got - expected).max() <= 1e-4
    # The images differ from each other: seeds and prompts reached the right samples.
    assert all(np.abs(got[0] - other).max() > 1e-3 for other in got[1:])


def test_each_image_keeps_its_own_prompts_mask(reference, engine):
    """Several prompts of different lengths x several images: diffusers' encode_prompt tiles the text mask in
    prompt order while it repeats the embeddings per image (pipeline_qwenimage.py, ``prompt_embeds_mask.repeat``),
    so images get another prompt's padding. paradit keeps each image's own mask; the reference here is diffusers fed
    its own embeddings, correctly repeated, with the same seeded noise."""
    prompts, negatives = ["a fox", "a lighthouse at dusk"], ["ugly, blurry", "dark"]
    request = GenerationRequest(
        prompt=prompts,
        negative_prompt=negatives,
        height=32,
        width=48,
        steps=2,
        guidance=3.0,
        seed=5,
        num_images_per_prompt=2,
    )
    embeds, mask = reference.encode_prompt(prompts, device=CPU)
    negative, negative_mask = reference.encode_prompt(negatives, device=CPU)
    expected = reference(
        prompt_embeds=embeds.repeat_interleave(2, dim=0),
        prompt_embeds_mask=mask.repeat_interleave(2, dim=0),
        negative_prompt_embeds=negative.repeat_interleave(2, dim=0),
        negative_prompt_embeds_mask=negative_mask.repeat_interleave(2, dim=0),
        true_cfg_scale=3.0,
        height=32,
        width=48,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
    ).images
    got = to_hwc(engine.generate(request))
    assert got.shape == expected.shape == (4, 32, 48, 3)
    assert np.abs(got - expected).max() <= 1e-4


def test_checkpoint_spec_has_diffusers_defaults(engine):
    spec = engine.spec
    assert (spec.family, spec.guidance_mode, spec.steps, spec.guidance) == ("qwen_image", "cfg", 50, 4.0)
    assert (spec.height, spec.width) == (1024, 1024)


def test_variant_checkpoints_are_refused(checkpoint):
    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="use_layer3d_rope"):
        QwenImageConfig.from_dict({**config, "use_layer3d_rope": True})


BAD_REQUESTS = [
    (dict(height=40), "height 40 is not allowed; this model takes multiples of 16"),
    (dict(width=8), "width 8 is not allowed"),
    (dict(steps=0), "steps 0"),
    (dict(prompt=["a fox", " "]), "prompt is empty"),
    (dict(guidance=-1.0), "guidance -1.0"),
    (dict(num_images_per_prompt=0), "num_images_per_prompt 0"),
    (dict(prompt=["a", "b"], negative_prompt=["x", "y", "z"]), "3 negative prompts for 2 prompts; give 1 or 2"),
]


@pytest.mark.parametrize("overrides,message", BAD_REQUESTS)
def test_bad_requests_are_refused(overrides, message):
    spec = PRESETS["qwen-image-tiny"]
    with pytest.raises(InvalidRequest, match=message):
        resolve_request(spec, GenerationRequest(**{"prompt": "a fox", **overrides}))


def test_cfg_needs_a_negative_prompt_and_guidance_above_one():
    spec = PRESETS["qwen-image-tiny"]
    assert not uses_cfg(spec, resolve_request(spec, GenerationRequest(prompt="a fox")))
    assert not uses_cfg(
        spec, resolve_request(spec, GenerationRequest(prompt="a fox", negative_prompt=" ", guidance=1.0))
    )
    both = resolve_request(spec, GenerationRequest(prompt=["a", "b"], negative_prompt=" "))
    assert uses_cfg(spec, both) and both.negative_prompts == [" ", " "]


def test_full_size_preset_matches_published_sizes():
    """The preset's transformer is the 20.4B model (shared/models/configs.json) and its text encoder config the
    8.29B Qwen2.5-VL-7B, counted on the meta device."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = PRESETS["qwen-image"]
    with torch.device("meta"):
        ours = QwenImageTransformer(QwenImageConfig.from_dict(spec.transformer))
        reference = QwenImageTransformer2DModel(**spec.transformer)
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**spec.text_encoder))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters()) == 20430401088
    assert sum(p.numel() for p in encoder.parameters()) == 8292166656
    assert ours.state_dict().keys() == reference.state_dict().keys()


# Prompts and negative prompts of different lengths, so every branch carries padding; 3 x 5 tokens per image.
ENGINE_REQUEST = GenerationRequest(
    prompt=["a red fox", "a lighthouse on a cliff at dusk"],
    negative_prompt=["blurry", "text, watermark, frame"],
    height=48,
    width=80,
    steps=2,
    guidance=4.0,
    seed=11,
)


@pytest.fixture(scope="module")
def serial_pixels() -> torch.Tensor:
    return Engine("qwen-image-tiny", device="cpu", dtype="fp32").generate(ENGINE_REQUEST).pixels


@pytest.mark.parametrize("plan", [ParallelConfig(cfg=2), ParallelConfig(ulysses=2)], ids=lambda p: p.describe())
def test_engine_plan_gives_the_serial_image(plan, serial_pixels):
    with Engine("qwen-image-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(ENGINE_REQUEST)
    assert result.timings.plan == plan.describe() and result.timings.comm_bytes_per_step > 0
    assert result.pixels.shape == serial_pixels.shape == (2, 3, 48, 80)
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4


class TextLengths:
    """The transformer, recording the text length of each call."""

    def __init__(self, transformer, lengths: list[int]) -> None:
        self.transformer, self.lengths = transformer, lengths

    def __getattr__(self, name: str):
        return getattr(self.transformer, name)

    def __call__(self, x, embeds, *args, **kwargs):
        self.lengths.append(embeds.shape[1])
        return self.transformer(x, embeds, *args, **kwargs)


def test_guidance_branches_of_different_text_lengths_run_apart_unpadded(reference, engine, monkeypatch):
    """A mask sends attention off its flash kernel: where the negative prompt is shorter, each branch runs with its
    own text, unmasked (two calls a step, as diffusers makes them), and the image is still diffusers'. Step caching,
    which decides per call, keeps the one batch."""
    lengths = []
    monkeypatch.setattr(engine.pipeline, "transformer", TextLengths(engine.pipeline.transformer, lengths))
    request = GenerationRequest(**{**IMAGE_CASES["cfg-images-per-prompt"], "num_images_per_prompt": 1})
    got = to_hwc(engine.generate(request))
    expected = diffusers_images(reference, request)
    assert np.abs(got - expected).max() <= 1e-4
    assert len(lengths) == 2 * request.steps and lengths[0] > lengths[1] and lengths[:2] * request.steps == lengths
    lengths.clear()
    engine.generate(dataclasses.replace(request, cache=StepCacheConfig("first-block")))
    assert len(lengths) == request.steps
