"""Qwen-Image 2.1 served as the other families are, on the tiny ``save_pretrained`` folder of
``tests/test_qwen_image21.py`` (fp32, CPU): LoRA adapters in diffusers' layout (fused and unfused) and in ComfyUI's
equal diffusers' ``load_lora_weights``; step caching keeps each block's prefix keys and values (a guided request
refused for now); FP8 linears stay within FP8's error of bf16; the denoise step attends without a mask;
the planner proposes only plans the family takes; ``paradit generate --image`` and ``/v1/images/edits`` with 1 and 3
condition images equal ``QwenImage21Pipeline``, and 11 images or a mask are refused naming the field.

The condition images are read at ``output_resolution`` 64 on both sides, as in ``tests/test_qwen_image21.py``."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from PIL import Image
from safetensors.torch import save_file

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.families import FAMILIES, PRESETS, spec_from_folder
from paradit.families.qwen_image21 import family as qwen_image21_family
from paradit.families.qwen_image21.model import PrefixAttention, QwenImage21Config, QwenImage21Transformer
from paradit.families.qwen_image21.presets import QwenImage21Inputs
from paradit.lora import LoraRef, LoraSet
from paradit.options import ExecutionOptions
from paradit.planner.plan import plan
from paradit.planner.profile import all_profiles, load_profile
from paradit.planner.tuned import GPU_COUNTS, tuned_entry
from paradit.quantize import convert_fp8
from paradit.request import StepCacheConfig
from paradit.serving.launch import ServeSettings, build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.server import create_app
from paradit.settings import Asked
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.qwen_image21_checkpoints import build_qwen_image21_checkpoint, processor, tiny_transformer
from tests.test_checkpoint_options import assert_one_line_error, generate, run_cli
from tests.test_editing import picture
from tests.test_lora import comfy_layout, diffusers_layout, levels, write_diffusers_lora
from tests.test_qwen_image21 import COLS, ROWS, inputs
from tests.test_serving_scheduler import app_in_thread

OUTPUT_RESOLUTION, SEED = 64, 11
PROMPT = "a red fox in the snow, picture 1's light"


@pytest.fixture(scope="module")
def folder():
    return cached(build_qwen_image21_checkpoint)


def small_spec(folder):
    spec = spec_from_folder(folder)
    return dataclasses.replace(spec, details=dataclasses.replace(spec.details, output_resolution=OUTPUT_RESOLUTION))


def edit_request(steps: int, **fields) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, image=[picture(60, 40, 3)], steps=steps, seed=SEED, **fields)


def pixels(result) -> np.ndarray:
    return result.pixels.permute(0, 2, 3, 1).numpy() * 255


@pytest.fixture(scope="module")
def adapters(folder, tmp_path_factory):
    """Two adapters over every linear in diffusers' layout: alpha 8 over rank 4 in the metadata, and none."""
    transformer = tiny_transformer(0)
    path = tmp_path_factory.mktemp("qwen21_lora")
    return [
        write_diffusers_lora(QwenImage21Pipeline, diffusers_layout(transformer, 1), path / "a.safetensors", 8.0),
        write_diffusers_lora(QwenImage21Pipeline, diffusers_layout(transformer, 2), path / "b.safetensors", None),
    ]


def diffusers_edit(folder, adapters: list[tuple[str, float]], steps: int) -> np.ndarray:
    pipeline = QwenImage21Pipeline.from_pretrained(folder, processor=processor(folder), dtype=torch.float32)
    for index, (path, _) in enumerate(adapters):
        pipeline.load_lora_weights(str(path), adapter_name=f"a{index}")
    if adapters:
        pipeline.set_adapters([f"a{index}" for index in range(len(adapters))], [scale for _, scale in adapters])
    return (
        pipeline(
            prompt=PROMPT,
            image=[picture(60, 40, 3)],
            num_inference_steps=steps,
            output_resolution=OUTPUT_RESOLUTION,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(SEED),
        ).images
        * 255
    )


def test_adapters_fused_and_unfused_equal_diffusers(folder, adapters):
    """One adapter at scale 1, then both at 0.5 and 1.2, each mode, on an edit (prefix and target both adapted)."""
    first, second = adapters
    one = diffusers_edit(folder, [(first, 1.0)], 2)
    two = diffusers_edit(folder, [(first, 0.5), (second, 1.2)], 2)
    plain = pixels(Engine(small_spec(folder), device="cpu", dtype="fp32").generate(edit_request(2)))
    assert levels(plain, one) > 3  # the adapter changes the image: a LoRA left out would show
    for mode in ("fused", "unfused"):
        for refs, expected in (
            ((LoraRef(str(first)),), one),
            ((LoraRef(str(first), 0.5), LoraRef(str(second), 1.2)), two),
        ):
            options = ExecutionOptions(lora=LoraSet(refs, (), mode))
            engine = Engine(small_spec(folder), device="cpu", dtype="fp32", options=options)
            assert levels(pixels(engine.generate(edit_request(2))), expected) <= 1, (mode, len(refs))


def test_a_comfyui_layout_equals_diffusers(folder, tmp_path):
    """ComfyUI's layout (``diffusion_model.`` keys, kohya's down/up, alpha 2 over rank 4) of the attention's
    adapters, converted by diffusers' loader for this family, ``QwenImageLoraLoaderMixin``."""
    factors = {key: value for key, value in diffusers_layout(tiny_transformer(0), 5).items() if ".attn." in key}
    path = tmp_path / "comfy.safetensors"
    save_file(comfy_layout(factors, 2.0), str(path))
    expected = diffusers_edit(folder, [(path, 0.8)], 2)
    options = ExecutionOptions(lora=LoraSet((LoraRef(str(path), 0.8),)))
    ours = pixels(Engine(small_spec(folder), device="cpu", dtype="fp32", options=options).generate(edit_request(2)))
    plain = pixels(Engine(small_spec(folder), device="cpu", dtype="fp32").generate(edit_request(2)))
    assert levels(plain, expected) > 3 and levels(ours, expected) <= 1, levels(ours, expected)


CACHE_STEPS = 6


@pytest.fixture(scope="module")
def engine(folder):
    return Engine(small_spec(folder), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def uncached(engine):
    return pixels(engine.generate(edit_request(CACHE_STEPS)))


@pytest.mark.parametrize(
    "cache",
    [
        StepCacheConfig("first-block", threshold=0.0),
        StepCacheConfig("mag", mag_ratios=(1.0,) * CACHE_STEPS, retention_ratio=1.0),
        StepCacheConfig("taylorseer", cache_interval=1, disable_cache_before_step=CACHE_STEPS),
    ],
    ids=["first-block", "mag", "taylorseer"],
)
def test_a_cache_that_skips_nothing_gives_the_uncached_image(engine, uncached, cache):
    """Every block reads its own prefix keys and values whichever slices of the stack the cache runs."""
    result = engine.generate(edit_request(CACHE_STEPS, cache=cache))
    assert result.timings.features["step_cache"].blocks_skipped == 0
    assert np.abs(pixels(result) - uncached).max() < 1e-3


SKIPPING = {
    # On random tiny weights the head block's residual moves by more than itself from step to step: only a threshold
    # above 1 lets first-block skip (at 1 it skips nothing in 6 steps).
    "first-block": (StepCacheConfig("first-block", threshold=2.0), None),
    "mag": (
        StepCacheConfig("mag", threshold=0.2, mag_ratios=(1.0, 1.1, 1.05, 0.98, 1.0, 1.02)),
        [False, True, False, True, True, True],
    ),
    "taylorseer": (
        StepCacheConfig("taylorseer", cache_interval=2, disable_cache_before_step=2),
        [False, False, True, False, True, False],
    ),
}


@pytest.mark.parametrize("method", ["first-block", "mag", "taylorseer"])
def test_a_cache_that_skips_steps_stays_near_the_uncached_image(engine, uncached, method):
    """The steps diffusers' rules skip (its hooks have no metadata for this model's blocks, so they cannot be the
    reference) replay a computed step's residual: the image moves, within 0.3 relative L2 of the uncached one (on
    random tiny weights one step's residual differs from the next by about a fifth)."""
    cache, pattern = SKIPPING[method]
    result = engine.generate(edit_request(CACHE_STEPS, cache=cache))
    record = result.timings.features["step_cache"]
    assert 0 < record.skipped_steps < CACHE_STEPS and record.blocks_skipped > 0
    if pattern is not None:
        assert [call[0] for call in record.skipped] == pattern
    error = relative_l2(torch.from_numpy(pixels(result)), torch.from_numpy(uncached))
    assert 1e-3 < error < 0.3


def test_a_cache_with_guidance_is_refused_naming_it(engine):
    """Guided, the pipeline calls the model once per branch (each its own prefix): a cache would count two steps."""
    with pytest.raises(InvalidRequest, match="runs each guidance branch apart") as refused:
        engine.generate(edit_request(2, negative_prompt="blurry", guidance=3.0, cache=SKIPPING["mag"][0]))
    assert refused.value.param == "cache"


BLOCK_LINEARS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.proj",
    "img_mlp.gate_layer",
    "img_mlp.out",
)


@torch.no_grad()
def test_fp8_linears_stay_within_fp8s_error_of_bf16():
    """The blocks' linears in FP8 (the embedders, the shared modulation and the output kept), prefix and step alike."""
    model = QwenImage21Transformer(QwenImage21Config.from_dict(dict(tiny_transformer(0).config)))
    model.load_state_dict(tiny_transformer(0).state_dict())
    model = model.to(torch.bfloat16).eval()
    given = inputs(images=True, padded=True)

    def step() -> torch.Tensor:
        embeds, condition = given["embeds"].to(torch.bfloat16), given["condition"].to(torch.bfloat16)
        prefix = model.encode_prefix(embeds, given["slots"], given["mask"], condition, given["grids"])
        return model(given["target"].to(torch.bfloat16), given["timesteps"][0], ROWS, COLS, prefix).float()

    expected = step()
    converted = convert_fp8(model, torch.float8_e4m3fn, FAMILIES["qwen_image21"].keep_high_precision)
    assert sorted(converted) == sorted(f"transformer_blocks.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS)
    # Row-wise e4m3 rounds each GEMM's inputs to about 3%; seven GEMMs a block, two blocks, random weights.
    assert 1e-3 < relative_l2(step(), expected) < 0.15


def test_the_denoise_step_attends_over_the_prefix_without_a_mask(engine, monkeypatch):
    """A single prompt pads nothing, so the block-causal mask, all ones for the target, is not passed: SDPA keeps its
    fused kernels."""
    masks = []
    original = PrefixAttention.attend

    def recorded(self, q, k, v, key_mask=None):
        masks.append(key_mask)
        return original(self, q, k, v, key_mask)

    monkeypatch.setattr(PrefixAttention, "attend", recorded)
    engine.generate(edit_request(2))
    assert masks and all(mask is None for mask in masks)


def test_the_tuned_entries_and_the_planner_propose_only_plans_the_family_takes():
    """The plans the family refuses (CUDA graphs, PipeFusion inside a sequence group) are in no tuned entry on any
    profile, and the planner ranks none of them; split plans are among what it ranks."""

    def refused(option) -> bool:
        parallel = option.parallel
        return option.cuda_graphs or (parallel.pipefusion > 1 and parallel.sequence_degree > 1)

    for profile in all_profiles():
        for preset in ("qwen-image-2.1", "qwen-image-2.1-turbo"):
            for gpus in GPU_COUNTS:
                entry = tuned_entry(preset, gpus, profile)
                assert entry is not None and entry.refused is None, (profile, preset, gpus)
                assert not refused(entry), (profile, preset, gpus)
    choice = plan(PRESETS["qwen-image-2.1"], 4, load_profile("h200-nvlink"))
    assert choice.ranked and not any(refused(option) for option in choice.ranked)
    assert any(option.parallel.sequence_degree > 1 for option in choice.ranked)


CONDITIONS = [(60, 40), (40, 52), (48, 48)]  # (width, height): the last one's aspect sizes the output


@pytest.fixture(scope="module")
def small_resolution():
    """Checkpoint folders read with ``output_resolution`` 64 on the command line's and the server's paths, where
    no spec can be handed in (diffusers takes it as a call argument), and a default size of 64x64 (the server's
    warm-up runs it)."""
    with pytest.MonkeyPatch.context() as patch:
        small = functools.partial(QwenImage21Inputs, output_resolution=OUTPUT_RESOLUTION)
        patch.setattr(qwen_image21_family, "QwenImage21Inputs", small)
        defaults = dict(qwen_image21_family.PIPELINE_DEFAULTS, height=64, width=64)
        patch.setattr(qwen_image21_family, "PIPELINE_DEFAULTS", defaults)
        yield


@pytest.fixture(scope="module")
def condition_files(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("qwen21_conditions")
    paths = [folder / f"condition_{index}.png" for index in range(len(CONDITIONS))]
    for seed, (path, (width, height)) in enumerate(zip(paths, CONDITIONS), start=3):
        picture(width, height, seed).save(path)
    return paths


@pytest.fixture(scope="module")
def diffusers_edits(folder) -> dict[int, np.ndarray]:
    """diffusers' RGBA images of 1 and 3 condition images, 0..255 rounded."""
    pipeline = QwenImage21Pipeline.from_pretrained(folder, processor=processor(folder), dtype=torch.float32)
    images = {}
    for count in (1, 3):
        output = pipeline(
            prompt=PROMPT,
            image=[picture(w, h, seed) for seed, (w, h) in enumerate(CONDITIONS[:count], start=3)],
            num_inference_steps=2,
            output_resolution=OUTPUT_RESOLUTION,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(SEED),
        )
        images[count] = (output.images[0] * 255).round()
    return images


def cli_edit(folder, paths: list[Path], out: Path, *extra: str) -> list[str]:
    images = [arg for path in paths for arg in ("--image", str(path))]
    return [
        "generate",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--prompt",
        PROMPT,
        "--steps",
        "2",
        "--seed",
        str(SEED),
        "--no-progress",
        "--out",
        str(out),
        *images,
        *extra,
    ]


@pytest.mark.parametrize("count", [1, 3])
def test_the_command_line_edits_as_diffusers(
    folder, small_resolution, condition_files, diffusers_edits, count, tmp_path, capfd
):
    out = tmp_path / "edit.png"
    generate(cli_edit(folder, condition_files[:count], out), capfd)
    with Image.open(out) as image:
        assert image.mode == "RGBA"
        got = np.asarray(image, dtype=np.float64)
    assert got.shape == diffusers_edits[count].shape
    assert np.abs(got - diffusers_edits[count]).max() <= 1


def test_the_server_edits_as_diffusers_and_refuses_what_the_model_cannot_take(
    folder, small_resolution, condition_files, diffusers_edits
):
    """``/v1/images/edits`` with three images gives diffusers' image; eleven images, or a mask, get a 400 naming the
    field, and the server serves on."""
    scheduler, config = build_scheduler(ServeSettings(Asked(model=str(folder), device="cpu", dtype="fp32")), Metrics())
    scheduler.start()
    try:
        with app_in_thread(create_app(scheduler, config, Metrics())) as url:
            form = {"prompt": PROMPT, "steps": "2", "seed": str(SEED)}
            uploads = [("image[]", (path.name, path.read_bytes())) for path in condition_files]
            refused = {
                "11 images": (uploads[:1] * 11, "image", "11 images sent; this server takes at most 10"),
                "a mask": (
                    uploads[:1] + [("mask", ("m.png", condition_files[0].read_bytes()))],
                    "mask",
                    "takes no mask",
                ),
            }
            for case, (files, param, message) in refused.items():
                response = httpx.post(url + "/v1/images/edits", data=form, files=files, timeout=60)
                assert response.status_code == 400, (case, response.text)
                error = response.json()["error"]
                assert error["param"] == param and message in error["message"], (case, error)
            response = httpx.post(url + "/v1/images/edits", data=form, files=uploads, timeout=60)
            assert response.status_code == 200, response.text
            with Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))) as image:
                got = np.asarray(image, dtype=np.float64)
            assert got.shape == diffusers_edits[3].shape
            assert np.abs(got - diffusers_edits[3]).max() <= 1
    finally:
        scheduler.close()


def test_the_command_line_refuses_eleven_images_or_a_mask_before_anything_loads(
    folder, condition_files, tmp_path, capfd, monkeypatch
):
    def started(*args, **kwargs):
        raise AssertionError("a worker or pipeline started before the refusal")

    for name in ("paradit.engine.WorkerGroup", "paradit.loader.build_pipeline"):
        monkeypatch.setattr(name, started)
    monkeypatch.setattr("paradit.cli.start_worker_server", lambda device: None)
    out = tmp_path / "x.png"
    code, _, err = run_cli(cli_edit(folder, condition_files[:1] * 11, out), capfd)
    assert_one_line_error(code, err, "takes at most 10 input images; 11 given")
    code, _, err = run_cli(cli_edit(folder, condition_files[:1], out, "--mask", str(condition_files[0])), capfd)
    assert_one_line_error(code, err, "takes no mask")
    assert not out.exists()
