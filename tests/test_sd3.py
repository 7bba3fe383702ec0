"""paradit's Stable Diffusion 3.5 against diffusers' reference on the same tiny random checkpoints and seeds
(fp32, CPU), and parallel (Ulysses, Ring, USP, CFG) against one process, on gloo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.checkpoint import read_json, safetensors_files
from paradit.families import PRESETS
from paradit.families.sd3.family import published_defaults, resolve_request
from paradit.families.sd3.family import read_checkpoint as spec_from_folder
from paradit.families.sd3.model import SD3Config, SD3Transformer, sincos_position_table, unpatchify
from paradit.families.sd3.presets import SD3_TEXT_ENCODERS
from paradit.parallel import ParallelConfig
from tests.checkpoint_cache import cached
from tests.checkpoints import load_module_weights, relative_l2
from tests.sd3_checkpoints import build_sd3_checkpoint, tiny_transformer


@pytest.fixture(scope="module")
def sd3_checkpoint(tmp_path_factory):
    return cached(build_sd3_checkpoint)


def transformer_inputs(config: dict, batch: int, height: int, width: int, text_len: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, config["in_channels"], height, width, generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen) * 1000,
    )


LAYOUTS = {
    "3.5-medium": {"dual_attention_layers": (0,)},  # MMDiT-X: image-only attention in the first block
    "3.5-large": {"dual_attention_layers": ()},
    "3.0": {"dual_attention_layers": (), "qk_norm": None},
}


@pytest.mark.parametrize(
    "layout,batch,height,width,text_len",
    [
        ("3.5-medium", 1, 4, 4, 8),
        ("3.5-medium", 2, 6, 10, 13),  # non-square
        ("3.5-medium", 2, 24, 8, 1),  # the position table's full height: the crop reaches both edges
        ("3.5-large", 2, 10, 6, 5),
        ("3.0", 1, 8, 14, 3),
    ],
)
def test_transformer_matches_diffusers(tmp_path, layout, batch, height, width, text_len):
    reference = tiny_transformer(seed=batch + height, **LAYOUTS[layout])
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(safetensors_files(tmp_path)) > 1
    with torch.device("meta"):
        ours = SD3Transformer(SD3Config.from_dict(read_json(tmp_path / "config.json")))
    load_module_weights(ours, safetensors_files(tmp_path), torch.device("cpu"), torch.float32)  # strict: every key
    inputs = transformer_inputs(reference.config, batch, height, width, text_len, seed=height * width)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        got = unpatchify(ours.eval()(**inputs), 2, height, width)
    assert got.shape == expected.shape == inputs["hidden_states"].shape
    assert relative_l2(got, expected) <= 1e-5


def generate_both(folder, prompt, negative_prompt=None, **settings):
    """diffusers' and paradit's images for one request on one checkpoint, (batch, height, width, 3) arrays."""
    kwargs = {"negative_prompt": negative_prompt} if negative_prompt is not None else {}
    if "guidance" in settings:
        kwargs["guidance_scale"] = settings["guidance"]
    reference = StableDiffusion3Pipeline.from_pretrained(folder, dtype=torch.float32)
    expected = reference(
        prompt=prompt,
        height=settings["height"],
        width=settings["width"],
        num_inference_steps=settings["steps"],
        num_images_per_prompt=settings.get("num_images_per_prompt", 1),
        generator=torch.Generator("cpu").manual_seed(settings["seed"]),
        output_type="np",
        **kwargs,
    ).images
    engine = Engine(str(folder), device="cpu", dtype="fp32")
    got = engine.generate(GenerationRequest(prompt=prompt, negative_prompt=negative_prompt, **settings)).pixels
    return got.permute(0, 2, 3, 1).numpy(), expected


def test_images_match_diffusers_with_negative_prompts(sd3_checkpoint):
    """CFG with a negative prompt, two prompts x two images, a non-square size."""
    prompts = ["a red fox in snow", "a lighthouse at dusk"]
    got, expected = generate_both(
        sd3_checkpoint,
        prompts,
        negative_prompt="blurry",
        height=48,
        width=80,
        steps=3,
        guidance=4.0,
        seed=7,
        num_images_per_prompt=2,
    )
    assert got.shape == expected.shape == (4, 48, 80, 3)
    assert np.abs(got - expected).max() <= 1e-4
    # The four images differ from each other: seeds and prompts reached the right samples.
    assert np.abs(got[0] - got[1]).max() > 1e-2 and np.abs(got[0] - got[2]).max() > 1e-2


@pytest.mark.parametrize(
    "settings",
    [
        dict(height=64, width=32, steps=2, seed=3),  # the pipeline's default guidance (7.0) and negative prompt ("")
        dict(height=32, width=32, steps=2, seed=4, guidance=1.0),  # no CFG
    ],
    ids=["default-cfg", "no-cfg"],
)
def test_images_match_diffusers_with_defaults(sd3_checkpoint, settings):
    got, expected = generate_both(sd3_checkpoint, "a bowl of ramen", **settings)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


def test_checkpoint_spec_and_published_defaults(sd3_checkpoint):
    spec = spec_from_folder(sd3_checkpoint, read_json(sd3_checkpoint / "model_index.json"))
    # Not a published transformer: diffusers' pipeline defaults; default size = sample_size x the VAE's stride.
    assert (spec.steps, spec.guidance, spec.height, spec.width) == (28, 7.0, 64, 64)
    assert spec.attention_heads == 3
    assert published_defaults(PRESETS["sd3.5-large"].transformer) == (28, 3.5)
    medium = {**PRESETS["sd3.5-medium"].transformer, "_class_name": "SD3Transformer2DModel"}  # as config.json has it
    assert published_defaults(medium) == (40, 4.5)


def test_requests_are_checked():
    spec = PRESETS["sd3.5-tiny"]  # 16-pixel tokens, a 32 x 32-token position table: at most 512 pixels a side
    resolved = resolve_request(spec, GenerationRequest(prompt=["a", "b"], negative_prompt="c", height=512))
    assert resolved.negative_prompts == ["c", "c"] and resolved.height == 512 and resolved.steps == spec.steps
    assert resolve_request(spec, GenerationRequest(prompt="a")).negative_prompts == [""]
    for bad, message in [
        (dict(height=40), "multiples of 16 from 16 to 512"),
        (dict(width=528), "multiples of 16 from 16 to 512"),
        (dict(steps=0), "give 1 or more"),
        (dict(guidance=-1.0), ">= 0"),
        (dict(negative_prompt=["x", "y", "z"]), "3 negative prompts for 1 prompts"),
        (dict(prompt=" "), "prompt is empty"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            resolve_request(spec, GenerationRequest(**{"prompt": "a", **bad}))


def test_full_size_presets_have_the_published_parameter_counts():
    """Counts from shared/models/configs.json (the published checkpoints)."""
    expected = {"sd3.5-large": 8_056_627_520, "sd3.5-medium": 2_243_171_520}
    for name, count in expected.items():
        with torch.device("meta"):
            model = SD3Transformer(SD3Config.from_dict(PRESETS[name].transformer))
        assert sum(p.numel() for p in model.parameters()) == count
    encoders = [
        (CLIPTextModelWithProjection, CLIPTextConfig, SD3_TEXT_ENCODERS.clip_l, 123_650_304),
        (CLIPTextModelWithProjection, CLIPTextConfig, SD3_TEXT_ENCODERS.clip_g, 694_659_840),
        (T5EncoderModel, T5Config, SD3_TEXT_ENCODERS.t5, 4_762_310_656),
    ]
    for model_class, config_class, config, count in encoders:
        with torch.device("meta"):
            model = model_class(config_class.from_dict(config))
        assert sum(p.numel() for p in model.parameters()) == count


def test_tiny_preset_runs_on_random_weights():
    """The dummy path: offline tokenizers, random encoders and VAE, and the position table refilled after the random
    initialisation zeroed it."""
    engine = Engine("sd3.5-tiny", device="cpu", dtype="fp32")
    table = engine.pipeline.transformer.pos_embed.pos_embed
    assert torch.equal(table, sincos_position_table(64, 32, 8))
    pixels = engine.generate(GenerationRequest(prompt=["a fox", "a cat"], height=48, width=64, steps=2, seed=1)).pixels
    assert pixels.shape == (2, 3, 48, 64) and torch.isfinite(pixels).all()
    assert (pixels[0] - pixels[1]).abs().max() > 1e-3


PARALLEL_REQUEST = GenerationRequest(
    prompt=["a red fox", "a blue bird"], negative_prompt="blurry", height=48, width=80, steps=2, seed=11, guidance=3.0
)


@pytest.fixture(scope="module")
def serial_pixels(sd3_checkpoint) -> torch.Tensor:
    return Engine(str(sd3_checkpoint), device="cpu", dtype="fp32").generate(PARALLEL_REQUEST).pixels


@pytest.mark.parametrize(
    "plan",
    [ParallelConfig(cfg=2), ParallelConfig(ulysses=2)],  # Ulysses 2 splits the checkpoint's 3 heads (2, 1)
    ids=lambda plan: plan.describe(),
)
def test_plan_gives_the_serial_image(sd3_checkpoint, serial_pixels, plan):
    with Engine(str(sd3_checkpoint), device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(PARALLEL_REQUEST)
    assert result.timings.plan == plan.describe() and result.timings.comm_bytes_per_step > 0
    assert result.pixels.shape == serial_pixels.shape == (2, 3, 48, 80)
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4
