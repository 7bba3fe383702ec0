"""paradit's FLUX.3 against diffusers' reference (the transformer module, and the modular pipeline image for image) on
tiny random checkpoint folders (fp32, CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import Flux3Transformer2DModel
from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks
from PIL import Image

from paradit import Engine, GenerationRequest
from paradit.checkpoint import safetensors_files
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.families.flux3.model import Flux3Config, Flux3Transformer
from paradit.loader import load_pipeline
from paradit.lora import LoraRef, LoraSet
from paradit.options import ExecutionOptions
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.pipelines.base import seeded_noise
from tests.checkpoint_cache import cached
from tests.checkpoints import load_module_weights, relative_l2
from tests.distributed import run_on_processes
from tests.flux3_checkpoints import build_flux3_checkpoint, tiny_processor
from tests.test_checkpoint_options import run_cli


@pytest.fixture(scope="module")
def base_checkpoint():
    return cached(build_flux3_checkpoint)


@pytest.fixture(scope="module")
def distilled_checkpoint():
    return cached(build_flux3_checkpoint, True)


def load_ours(folder) -> Flux3Transformer:
    config = Flux3Config.from_dict(Flux3Transformer2DModel.load_config(folder / "transformer"))
    with torch.device("meta"):
        model = Flux3Transformer(config)
    load_module_weights(model, safetensors_files(folder / "transformer"), torch.device("cpu"), torch.float32)
    return model.eval()


def image_ids(rows: int, cols: int, reference: int = 0) -> torch.Tensor:
    """(t, h, w, l) as diffusers lays them: h and w halved, l = -1, -2, ... for the references."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.tensor([-reference]))
    ids = ids.float()
    ids[:, 1:3] *= 0.5
    return ids


def transformer_inputs(config, batch: int, grid: tuple[int, int], text_len: int, references: list, seed: int):
    gen = torch.Generator().manual_seed(seed)
    one = torch.arange(1)
    inputs = dict(
        hidden_states=torch.randn(batch, grid[0] * grid[1], config["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_ids=image_ids(*grid),
        txt_ids=torch.cartesian_prod(one, one, one, torch.arange(text_len)).float(),
    )
    if references:
        tokens = sum(rows * cols for rows, cols in references)
        inputs["image_cond_hidden_states"] = torch.randn(batch, tokens, config["cond_in_channels"], generator=gen)
        inputs["image_cond_ids"] = torch.cat([image_ids(*size, n + 1) for n, size in enumerate(references)])
    if config["flow_map"]:
        inputs["target_timestep"] = inputs["timestep"] * torch.rand(batch, generator=gen)
    return inputs


@pytest.mark.parametrize("checkpoint", ["base_checkpoint", "distilled_checkpoint"])
@pytest.mark.parametrize(
    "batch,grid,text_len,references",
    [(1, (4, 4), 8, []), (2, (3, 5), 13, [(2, 3)]), (1, (2, 6), 5, [(3, 3), (2, 2), (1, 4)])],
)
def test_transformer_matches_diffusers(request, checkpoint, batch, grid, text_len, references):
    """Text to image and the reference path (1 and 3 references), base and flow map, loaded from the same folder."""
    folder = request.getfixturevalue(checkpoint)
    reference = Flux3Transformer2DModel.from_pretrained(folder / "transformer").eval()
    inputs = transformer_inputs(reference.config, batch, grid, text_len, references, seed=batch * 10 + len(references))
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        got = load_ours(folder)(**inputs)
    assert got.shape == expected.shape
    assert relative_l2(got, expected) <= 1e-5


def reference_pipeline(folder, flow_map: bool):
    """diffusers' modular pipeline from the folder, its prompt upsampler (a separate model) popped, as paradit runs."""
    blocks = Flux3DistilledAutoBlocks() if flow_map else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(torch_dtype=torch.float32)
    # The folder's processor loads as its tokenizer here (no torchvision for Qwen3-VL's video processor).
    pipe.update_components(tokenizer=tiny_processor())
    return pipe


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Smooth random structure (a VAE of random weights sees gradients, not only noise)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)


# Text alone, non-square; one reference of 50x70 (padded to its 64x80 canvas, the output cropped back to 50x70); three
# of different sizes, each cropped to the token grid, for a 48x64 image.
CASES = {
    "text": dict(height=64, width=96),
    "one reference": dict(image=[picture(50, 70, 0)]),
    "three references": dict(image=[picture(40, 56, 1), picture(64, 36, 2), picture(33, 33, 3)], height=48, width=64),
}
SHAPES = {"text": (1, 64, 96, 3), "one reference": (1, 70, 50, 3), "three references": (1, 48, 64, 3)}


@pytest.fixture(scope="module")
def engines(base_checkpoint, distilled_checkpoint):
    return {
        flow_map: Engine(str(folder), device="cpu", dtype="fp32")
        for flow_map, folder in ((False, base_checkpoint), (True, distilled_checkpoint))
    }


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("checkpoint,flow_map", [("base_checkpoint", False), ("distilled_checkpoint", True)])
def test_images_match_diffusers(request, engines, checkpoint, flow_map, case):
    """The base model with true CFG (empty negative prompt), the flow map with its step targets; text alone and
    editing from one and three references, as diffusers' modular pipeline makes them."""
    asked = CASES[case]
    folder = request.getfixturevalue(checkpoint)
    expected = reference_pipeline(folder, flow_map)(
        prompt="a red fox",
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(3),
        output="images",
        output_type="np",
        **asked,
    )
    guidance = None if flow_map else 3.5
    result = engines[flow_map].generate(
        GenerationRequest(prompt="a red fox", steps=2, seed=3, guidance=guidance, **asked)
    )
    got = result.pixels.permute(0, 2, 3, 1).numpy()
    assert got.shape == expected.shape == SHAPES[case]
    assert np.abs(got - expected).max() <= 1 / 255
    # The references matter: others of the same sizes make an image further off than the tolerance above.
    if "image" in asked:
        others = [picture(*image.size, seed=10 + n) for n, image in enumerate(asked["image"])]
        changed = dict(asked, image=others)
        other = engines[flow_map].generate(GenerationRequest(prompt="a red fox", steps=2, seed=3, **changed))
        assert (other.pixels - result.pixels).abs().max() > 1 / 255


def test_a_folder_reads_as_its_variant(base_checkpoint, distilled_checkpoint):
    """The modular index's pipeline class names the variant: its defaults, diffusers' blocks' own."""
    base, distilled = spec_from_folder(base_checkpoint), spec_from_folder(distilled_checkpoint)
    assert (base.family, base.guidance_mode, base.steps, base.guidance) == ("flux3", "cfg", 50, 3.5)
    assert (distilled.guidance_mode, distilled.steps, distilled.guidance) == ("none", 16, None)
    assert distilled.transformer["flow_map"] and not base.transformer["flow_map"]
    assert base.text_encoder.layers == (4, 8, 12, 16, 20, 24, 28, 32)


@pytest.mark.parametrize(
    "flow_map,changes,refusal",
    [
        (True, dict(negative_prompt="blurry"), "does not use classifier-free guidance, so it takes no negative"),
        (False, dict(image=[picture(32, 32, n) for n in range(11)]), "takes at most 10 input images; 11 given"),
        (False, dict(image=[picture(32, 32, 0)], mask=Image.new("L", (32, 32))), "does no inpainting; drop the mask"),
        (False, dict(image=[picture(32, 32, 0)], strength=0.5), "strength"),
        (True, dict(scheduler="dpmpp-2m"), "dpmpp-2m"),
    ],
)
def test_what_it_does_not_take_is_refused_in_one_line(engines, flow_map, changes, refusal):
    with pytest.raises(InvalidRequest, match=refusal) as refused:
        engines[flow_map].check(GenerationRequest(prompt="a red fox", **changes))
    assert "\n" not in str(refused.value)


def plan_checkpoint(flow_map: bool):
    """Four heads, which degrees of 2 divide."""
    return cached(build_flux3_checkpoint, flow_map, 0, 4)


# Prompts of different windows (80 and 160 tokens): the shorter one's padding masked in the batch.
PLAN_REQUEST = dict(
    prompt=["a red fox", "two cats asleep on a mat " * 12], image=[picture(40, 56, 1), picture(64, 36, 2)]
)


def generated_pixels(plan: ParallelConfig | None, flow_map: bool) -> torch.Tensor | None:
    spec, device = spec_from_folder(plan_checkpoint(flow_map)), torch.device("cpu")
    pipeline = load_pipeline(spec, device, torch.float32, None if plan is None else ParallelContext.build(plan, device))
    guidance = None if flow_map else 3.5
    request = GenerationRequest(**PLAN_REQUEST, height=48, width=64, steps=2, seed=3, guidance=guidance)
    results = pipeline.generate([FAMILIES["flux3"].resolve_request(spec, request)])
    return None if results is None else results[0].pixels


@pytest.mark.parametrize(
    "world,plan,flow_map",
    [
        (2, ParallelConfig(tensor=2), False),
        (2, ParallelConfig(cfg=2), False),
        (3, ParallelConfig(ring=3), False),
        (2, ParallelConfig(ulysses=2, shard_weights=2), False),
        (2, ParallelConfig(pipefusion=2), True),
        (2, ParallelConfig(ulysses=2), True),
    ],
    ids=["tensor 2", "cfg 2", "ring 3", "ulysses 2 sharded", "pipefusion 2 flow map", "ulysses 2 flow map"],
)
def test_plans_equal_one_process(world, plan, flow_map):
    """Two prompts of different lengths and two references, where the prefix runs once (tensor, CFG parallel) and
    where it runs each step (split tokens, sharded weights, stages); Ring over 3 splits every stream unevenly."""
    plan_checkpoint(flow_map)  # built here, not by each process
    expected = generated_pixels(None, flow_map)
    assert relative_l2(run_on_processes(world, generated_pixels, plan, flow_map), expected) <= 1e-5


@pytest.mark.parametrize("flow_map", [False, True])
def test_the_prefix_runs_once_per_request_without_a_flow_map(flow_map):
    """The text's and the references' per-mode blocks run once per request (base), or at every step (flow map, its
    target embedding reaching them); the image's at every step."""
    spec = spec_from_folder(plan_checkpoint(flow_map))
    pipeline = load_pipeline(spec, torch.device("cpu"), torch.float32, None)
    model, calls = pipeline.runtime.model, []
    for stream, block in (("txt", model.txt_mode_blocks[0]), ("cond", model.mode_blocks.image_cond[0])):
        block.register_forward_hook(lambda *_, stream=stream: calls.append(stream))
    request = GenerationRequest(prompt="a red fox", image=[picture(32, 32, 0)], steps=3, seed=3)
    pipeline.generate([FAMILIES["flux3"].resolve_request(spec, request)])
    assert calls.count("txt") == calls.count("cond") == (3 if flow_map else 1)


def test_a_batch_of_prompts_of_different_windows_equals_diffusers_one_by_one(engines, base_checkpoint):
    """diffusers takes one prompt a call; in a batch the shorter prompt's padding is masked, so each image is its own
    call's (a window of 80 tokens beside one of 320; CFG, the prefix run once)."""
    prompts = PLAN_REQUEST["prompt"]
    reference = reference_pipeline(base_checkpoint, flow_map=False)
    got = engines[False].generate(GenerationRequest(prompt=prompts, height=32, width=48, steps=2, seed=3))
    for index, prompt in enumerate(prompts):
        expected = reference(
            prompt=prompt,
            height=32,
            width=48,
            num_inference_steps=2,
            # paradit seeds a batch's noise in one draw; each of diffusers' calls draws its own rows
            latents=seeded_noise((2, 16, 2, 3), 3, torch.float32, torch.device("cpu"))[index : index + 1],
            output="images",
            output_type="np",
        )
        assert np.abs(got.pixels[index].permute(1, 2, 0).numpy() - expected[0]).max() <= 1 / 255


def test_an_adapter_in_diffusers_layout_equals_load_lora_weights(engines, distilled_checkpoint, tmp_path):
    """Rank-4 factors on every linear of the transformer (alpha 8 in the file's metadata), at scale 0.7, fused and
    unfused, against diffusers' ``load_lora_weights`` and ``set_adapters`` on the same folder."""
    reference = reference_pipeline(distilled_checkpoint, flow_map=True)
    generator, factors = torch.Generator().manual_seed(1), {}
    for name, module in reference.transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            factors[f"{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=generator) * 0.3
            factors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=generator) * 0.3
    targets = sorted({key.rsplit(".lora_", 1)[0] for key in factors})
    reference.save_lora_weights(
        tmp_path,
        transformer_lora_layers=factors,
        weight_name="adapter.safetensors",
        transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8.0, "target_modules": targets},
    )
    path = str(tmp_path / "adapter.safetensors")
    reference.load_lora_weights(path, adapter_name="a")
    reference.set_adapters(["a"], [0.7])
    asked = dict(prompt="a red fox", height=32, width=48)
    expected = reference(
        **asked, num_inference_steps=2, generator=torch.Generator().manual_seed(3), output="images", output_type="np"
    )
    plain = engines[True].generate(GenerationRequest(**asked, steps=2, seed=3)).pixels.permute(0, 2, 3, 1).numpy()
    assert np.abs(plain - expected).max() > 3 / 255  # the adapter changes the image: one left out would show
    for mode in ("fused", "unfused"):
        options = ExecutionOptions(lora=LoraSet((LoraRef(path, 0.7),), (), mode))
        engine = Engine(str(distilled_checkpoint), device="cpu", dtype="fp32", options=options)
        got = engine.generate(GenerationRequest(**asked, steps=2, seed=3)).pixels.permute(0, 2, 3, 1).numpy()
        assert np.abs(got - expected).max() <= 1 / 255, mode


def test_the_step_benchmark_runs_tiny_and_its_steps_equal_diffusers(monkeypatch, tmp_path):
    """benchmarks/flux3_step.py --tiny: paradit's step (on the prefix for the base model) is diffusers' step."""
    from benchmarks import flux3_step

    argv = ["flux3_step.py", "--tiny", "--refs", "0", "1", "--text-len", "16", "--warmup", "0", "--iters", "1"]
    monkeypatch.setattr("sys.argv", [*argv, "--out-dir", str(tmp_path)])
    flux3_step.main()
    rows = json.loads((tmp_path / "flux3_step.json").read_text())["rows"]
    ours = [row for row in rows if row["impl"] == "paradit"]
    assert {(row["model"], row["refs"]) for row in ours} == {(m, r) for m in flux3_step.MODELS for r in (0, 1)}
    assert all(row["rel_l2_vs_diffusers"] <= 1e-5 and row["ms_per_step"] > 0 for row in ours)


def test_paradit_generate_edits_as_diffusers(base_checkpoint, tmp_path, capfd):
    """``paradit generate --image`` on the folder: the written PNG is diffusers' image, cropped back to the single
    reference's own 50x70, to one 8-bit level."""
    reference_file, out = tmp_path / "reference.png", tmp_path / "out.png"
    picture(50, 70, 0).save(reference_file)
    argv = ["generate", "--model", str(base_checkpoint), "--device", "cpu", "--dtype", "fp32", "--prompt", "a red fox"]
    argv += ["--image", str(reference_file), "--steps", "2", "--seed", "3", "--out", str(out)]
    code, _, err = run_cli(argv, capfd)
    assert code == 0, err
    expected = reference_pipeline(base_checkpoint, flow_map=False)(
        prompt="a red fox",
        image=Image.open(reference_file),
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(3),
        output="images",
        output_type="np",
    )
    written = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32)
    assert written.shape == expected.shape[1:] == (70, 50, 3)
    assert np.abs(written - (expected[0] * 255).round()).max() <= 1
