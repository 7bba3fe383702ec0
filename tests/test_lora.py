"""LoRA adapters against diffusers: on tiny ``save_pretrained`` folders of every family (fp32, CPU), paradit's image
with adapters fused or unfused equals diffusers' pipeline after ``load_lora_weights`` and ``set_adapters`` (PEFT's
side paths) to one 8-bit level; adapters in diffusers' layout (with and without the alpha metadata) and in a
non-diffusers layout that diffusers converts; bad adapters refused in one line before anything loads."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from diffusers import (
    Flux2KleinPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    WanPipeline,
    ZImagePipeline,
)
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from paradit import runtime
from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.lora import LoraRef, LoraSet
from paradit.lora.apply import LoraSidePath
from paradit.options import ExecutionOptions, check_conflicts
from paradit.parallel.config import ParallelConfig
from paradit.request import GenerationRequest
from paradit.serving.launch import ServeSettings, build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.server import create_app
from paradit.settings import Asked
from tests.checkpoint_cache import cached
from tests.test_checkpoint_options import (
    assert_one_line_error,
    build_checkpoint,
    generate_args,
    run_cli,
    verify_serial_line,
)
from tests.test_serving_scheduler import app_in_thread
from tests.test_wan import wan_checkpoint

PIPELINES = {
    "flux2": Flux2KleinPipeline,
    "qwen_image": QwenImagePipeline,
    "sd3": StableDiffusion3Pipeline,
    "zimage": ZImagePipeline,
    "wan": WanPipeline,
}
REQUEST = dict(prompt="a lighthouse on a cliff", height=32, width=48, steps=3, seed=3, guidance=4.0)
RANK = 4


def folder_of(family: str) -> Path:
    return wan_checkpoint("t2v") if family == "wan" else cached(build_checkpoint, family)


def diffusers_layout(transformer: nn.Module, seed: int) -> dict:
    """Random rank-4 factors for every linear of ``transformer`` under diffusers' keys (without ``transformer.``)."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for name, module in transformer.named_modules():
        if isinstance(module, nn.Linear):
            factors[f"{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=generator) * 0.3
            factors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=generator) * 0.3
    return factors


def write_diffusers_lora(pipeline_class: type, factors: dict, path: Path, alpha: float | None) -> Path:
    """The file diffusers' own ``save_lora_weights`` writes (``alpha`` in its LoraConfig metadata, or none)."""
    targets = sorted({key.rsplit(".lora_", 1)[0] for key in factors})
    metadata = None if alpha is None else {"r": RANK, "lora_alpha": alpha, "target_modules": targets}
    pipeline_class.save_lora_weights(
        path.parent, transformer_lora_layers=factors, weight_name=path.name, transformer_lora_adapter_metadata=metadata
    )
    return path


def reference_images(family: str, adapters: list[tuple[Path, float, str]]) -> np.ndarray:
    """diffusers' images (0..255, unrounded) with ``adapters`` (file, scale, component) loaded through PEFT."""
    pipeline = PIPELINES[family].from_pretrained(folder_of(family), dtype=torch.float32)
    names, scales = [], []
    for index, (path, scale, component) in enumerate(adapters):
        extra = {"load_into_transformer_2": True} if component == "transformer_2" else {}
        pipeline.load_lora_weights(str(path), adapter_name=f"a{index}", **extra)
        names.append(f"a{index}")
        scales.append(scale)
    if names:
        pipeline.set_adapters(names, scales)
    kwargs = dict(
        prompt=REQUEST["prompt"],
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_inference_steps=REQUEST["steps"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type="np",
    )
    if family == "qwen_image":
        kwargs.update(true_cfg_scale=REQUEST["guidance"], negative_prompt=" ")
    elif family == "wan":
        kwargs.update(guidance_scale=REQUEST["guidance"], guidance_scale_2=2.5, num_frames=5, max_sequence_length=512)
    else:
        kwargs.update(guidance_scale=REQUEST["guidance"])
    output = pipeline(**kwargs)
    return (output.frames if family == "wan" else output.images) * 255


def paradit_images(family: str, lora: LoraSet | None) -> np.ndarray:
    extra = {"negative_prompt": " "} if family == "qwen_image" else {}
    extra.update({"frames": 5, "guidance_2": 2.5} if family == "wan" else {})
    engine = Engine(
        str(folder_of(family)), device="cpu", dtype="fp32", options=ExecutionOptions(lora=lora or LoraSet())
    )
    pixels = engine.generate(GenerationRequest(**REQUEST, **extra)).pixels
    pixels = pixels.permute(0, 1, 3, 4, 2) if family == "wan" else pixels.permute(0, 2, 3, 1)
    return pixels.numpy() * 255


def levels(ours: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(ours.round() - expected.round()).max())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, list[Path]]:
    """Per family: two adapters in diffusers' layout, the first with alpha 8 over rank 4 in its metadata, the second
    without metadata (alpha equals rank); Wan's second is for its low-noise expert."""
    folder = tmp_path_factory.mktemp("lora")
    files = {}
    for family, pipeline_class in PIPELINES.items():
        reference = pipeline_class.from_pretrained(folder_of(family), dtype=torch.float32)
        second = reference.transformer_2 if family == "wan" else reference.transformer
        files[family] = [
            write_diffusers_lora(
                pipeline_class, diffusers_layout(reference.transformer, 1), folder / f"{family}_a.safetensors", 8.0
            ),
            write_diffusers_lora(pipeline_class, diffusers_layout(second, 2), folder / f"{family}_b.safetensors", None),
        ]
    return files


@pytest.mark.parametrize("family", list(PIPELINES))
def test_adapters_fused_and_unfused_equal_diffusers(family, adapters):
    """One adapter at scale 1, then two at 0.5 and 1.2 (Wan: the second on the low-noise expert), each mode."""
    first, second = adapters[family]
    second_component = "transformer_2" if family == "wan" else "transformer"
    one = reference_images(family, [(first, 1.0, "transformer")])
    two = reference_images(family, [(first, 0.5, "transformer"), (second, 1.2, second_component)])
    plain = paradit_images(family, None)
    assert levels(plain, one) > 3  # the adapter changes the image: a LoRA left out would show
    for mode in ("fused", "unfused"):
        ours = paradit_images(family, LoraSet((LoraRef(str(first)),), (), mode))
        assert levels(ours, one) <= 1, (mode, levels(ours, one))
        pair = (LoraRef(str(first), 0.5), LoraRef(str(second), 1.2))
        lora = LoraSet(pair[:1], pair[1:], mode) if family == "wan" else LoraSet(pair, (), mode)
        ours = paradit_images(family, lora)
        assert levels(ours, two) <= 1, (mode, levels(ours, two))


def comfy_layout(factors: dict, alpha: float) -> dict:
    """ComfyUI's layout of diffusers-named factors: ``diffusion_model.`` keys, kohya's down/up and an alpha each."""
    converted = {}
    for key, tensor in factors.items():
        module, _, part = key.rpartition(".lora_")
        kind = "lora_down" if part.startswith("A") else "lora_up"
        converted[f"diffusion_model.{module}.{kind}.weight"] = tensor
        converted[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    return converted


def musubi_layout(transformer: nn.Module, seed: int, alpha: float) -> dict:
    """musubi-tuner's layout of a Wan LoRA: Wan's original module names flattened under ``lora_unet_``, kohya's
    down/up and an alpha for every attention and feed-forward linear of every block, as its converter requires."""
    generator = torch.Generator().manual_seed(seed)
    originals = {"attn1": "self_attn", "attn2": "cross_attn"}
    projections = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    converted = {}
    for index, block in enumerate(transformer.blocks):
        linears = {
            f"{originals[a]}_{p}": getattr(block, a).get_submodule(d) for a in originals for d, p in projections.items()
        }
        linears.update(ffn_0=block.ffn.net[0].proj, ffn_2=block.ffn.net[2])
        for name, linear in linears.items():
            key = f"lora_unet_blocks_{index}_{name}"
            converted[f"{key}.lora_down.weight"] = torch.randn(RANK, linear.in_features, generator=generator)
            converted[f"{key}.lora_up.weight"] = torch.randn(linear.out_features, RANK, generator=generator)
            converted[f"{key}.alpha"] = torch.tensor(alpha)
    return converted


def kohya_flux2_layout(transformer: nn.Module, seed: int, alpha: float) -> dict:
    """sd-scripts' (kohya's) layout of a FLUX.2 LoRA: BFL's original module names under ``lora_unet_``, the joint
    image QKV as one linear, kohya's down/up and an alpha; each double block's image attention and first MLP layer."""
    generator = torch.Generator().manual_seed(seed)
    converted = {}
    for index, block in enumerate(transformer.transformer_blocks):
        attention = block.attn
        qkv_out = sum(getattr(attention, name).out_features for name in ("to_q", "to_k", "to_v"))
        shapes = {
            "img_attn_qkv": (qkv_out, attention.to_q.in_features),
            "img_attn_proj": tuple(attention.to_out[0].weight.shape),
            "img_mlp_0": tuple(block.ff.linear_in.weight.shape),
        }
        for name, (out_features, in_features) in shapes.items():
            key = f"lora_unet_double_blocks_{index}_{name}"
            converted[f"{key}.lora_down.weight"] = torch.randn(RANK, in_features, generator=generator)
            converted[f"{key}.lora_up.weight"] = torch.randn(out_features, RANK, generator=generator)
            converted[f"{key}.alpha"] = torch.tensor(alpha)
    return converted


def test_a_fixed_adapters_side_paths_fold_into_their_gemms_where_the_width_pays(adapters, monkeypatch):
    """As the runtime loads a run's adapter unfused, the side paths of the linears no narrower than their input fold
    (``[W, up]`` times ``[x, x @ down.T]``), each equal to its unfolded side path on the loaded weights."""
    spec = spec_from_folder(folder_of("flux2"))
    options = ExecutionOptions(lora=LoraSet((LoraRef(str(adapters["flux2"][0])),), (), "unfused"))

    def side_paths() -> list[LoraSidePath]:
        loaded = runtime.load_transformer(FAMILIES["flux2"], spec, torch.device("cpu"), torch.float32, None, options)
        return [module for module in loaded.model.modules() if isinstance(module, LoraSidePath)]

    folded = side_paths()
    monkeypatch.setattr(runtime, "fold_side_paths", lambda model: 0)
    unfolded = side_paths()
    kinds = [(path.folded_scale is not None, path.linear.out_features >= path.down.shape[1]) for path in folded]
    assert all(folds == widening for folds, widening in kinds) and 0 < sum(folds for folds, _ in kinds) < len(kinds)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ours, theirs in zip(folded, unfolded, strict=True):
            x = torch.randn(2, 3, theirs.linear.in_features, generator=generator)
            assert torch.allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["flux2", "qwen_image", "zimage", "wan"])
def test_a_non_diffusers_layout_equals_diffusers(family, tmp_path):
    """kohya's for FLUX.2, ComfyUI's for Qwen-Image and Z-Image, musubi-tuner's for Wan; alpha 2 over rank 4,
    converted by diffusers (SD3.5's loader reads diffusers' layout only)."""
    reference = PIPELINES[family].from_pretrained(folder_of(family), dtype=torch.float32)
    if family == "flux2":
        state = kohya_flux2_layout(reference.transformer, 5, 2.0)
    elif family == "wan":
        state = musubi_layout(reference.transformer, 5, 2.0)
    else:
        blocks = {
            k: v for k, v in diffusers_layout(reference.transformer, 5).items() if ".attn" in k or "attention" in k
        }
        state = comfy_layout(blocks, 2.0)
    path = tmp_path / f"{family}_comfy.safetensors"
    save_file(state, str(path))
    expected = reference_images(family, [(path, 0.8, "transformer")])
    ours = paradit_images(family, LoraSet((LoraRef(str(path), 0.8),)))
    assert levels(paradit_images(family, None), expected) > 3
    assert levels(ours, expected) <= 1, levels(ours, expected)


# One plan of every kind, each with two adapters (scales 0.5 and 1.2; Wan's second on its low-noise expert), through
# the CLI against the same run in one process; unfused where the plan cuts or prunes the linears the side paths sit by.
PLAN_CASES = {
    "tensor": ("flux2", "unfused", ("--gpus", "2", "--tensor", "2"), "tensor 2"),
    "pipefusion": (
        "qwen_image",
        "unfused",
        ("--gpus", "2", "--pipefusion", "2"),
        "pipefusion 2 (1 patch after 1 warm-up step)",
    ),
    "cfg-ulysses": ("sd3", "fused", ("--gpus", "4", "--cfg-parallel", "--ulysses", "2"), "cfg 2 x ulysses 2"),
    "ring": ("zimage", "unfused", ("--gpus", "3", "--ring", "3"), "ring 3"),
    "sharded": (
        "wan",
        "unfused",
        ("--gpus", "2", "--ulysses", "2", "--shard-weights", "2"),
        "ulysses 2, weights sharded over 2 (ulysses)",
    ),
}


def lora_flags(family: str, files: list[Path], mode: str) -> list[str]:
    second = "--lora-2" if family == "wan" else "--lora"
    return ["--lora", f"{files[0]}:0.5", second, f"{files[1]}:1.2", "--lora-mode", mode]


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_every_plan_with_adapters_equals_one_process(case, adapters, tmp_path, capfd):
    family, mode, flags, described = PLAN_CASES[case]
    out = tmp_path / ("out.mp4" if family == "wan" else "out.png")
    extra = ("--frames", "5") if family == "wan" else ()
    argv = generate_args(folder_of(family), out, *flags, *extra, *lora_flags(family, adapters[family], mode))
    code, stdout, err = run_cli([*argv, "--verify-serial"], capfd)
    assert code == 0, err
    assert verify_serial_line(stdout)[:2] == (described, "equals")


def test_the_adapters_are_recorded_and_a_distilled_one_runs_the_steps_and_guidance_asked(adapters, tmp_path, capfd):
    """A step-distilled adapter is used as its card says (Lightning: few steps, guidance 1): the run takes the
    steps and guidance given, and the PNG and --json name the adapters with their scales."""
    out, record = tmp_path / "distilled.png", tmp_path / "run.json"
    flags = ("--steps", "4", "--guidance", "1.0", "--lora", f"{adapters['flux2'][1]}:1.0", "--json", str(record))
    argv = [arg for arg in generate_args(folder_of("flux2"), out) if arg not in ("--steps", "2")]
    code, _, err = run_cli([*argv, *flags], capfd)
    assert code == 0, err
    written = json.loads(record.read_text())
    assert (written["steps"], written["guidance"], len(written["timings"]["step_ms"])) == (4, 1.0, 4)
    expected = {
        "transformer": [{"source": str(adapters["flux2"][1]), "scale": 1.0, "weight_name": None}],
        "transformer_2": [],
        "mode": "fused",
    }
    assert written["lora"] == expected
    with Image.open(out) as image:
        assert json.loads(image.text["lora"]) == expected


def bad_adapters(folder: Path, good: Path, wan: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter file, what the refusal says)."""
    state = load_file(good)
    truncated = folder / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    pickle = folder / "adapter.bin"
    torch.save(state, pickle)
    nan = folder / "nan.safetensors"
    first = next(key for key in state if key.endswith("lora_A.weight"))
    save_file({**state, first: torch.full_like(state[first], float("nan"))}, str(nan))
    encoder = folder / "encoder.safetensors"
    save_file({**state, "text_encoder.layers.0.q.lora_A.weight": torch.zeros(4, 8)}, str(encoder))
    rank = folder / "rank.safetensors"
    save_file({**state, first: state[first][:2]}, str(rank))
    return {
        "another model's": (wan, "modules the transformer does not have"),
        "truncated": (truncated, "not a readable"),
        "pickle": (pickle, "only .safetensors"),
        "NaN": (nan, "NaN"),
        "text encoder": (encoder, "text-encoder LoRA"),
        "rank mismatch": (rank, "ranks that do not match"),
    }


def test_bad_adapters_are_refused_in_one_line_and_nothing_is_written(adapters, tmp_path, capfd):
    cases = bad_adapters(tmp_path, adapters["flux2"][0], adapters["wan"][0])
    cases["--lora-2 without a second expert"] = (None, "--lora-2 is for a second transformer")
    for name, (path, fragment) in cases.items():
        out = tmp_path / f"{name}.png"
        flags = ("--lora-2", str(adapters["flux2"][0])) if path is None else ("--lora", str(path))
        code, _, err = run_cli(generate_args(folder_of("flux2"), out, *flags), capfd)
        assert_one_line_error(code, err, fragment)
        assert not out.exists(), name


def test_a_server_applies_the_adapters_each_request_names_and_refuses_unknown_ones(adapters, tmp_path, capfd):
    """Named adapters loaded once as side paths; each request's choice and scales equal a run fused with them, a
    request naming none gets the base model, concurrent requests with different choices never share a batch."""
    first, second = adapters["flux2"]
    folder = folder_of("flux2")
    served = LoraSet((LoraRef(str(first), name="style"), LoraRef(str(second), name="detail")), (), "unfused", True)
    scheduler, config = build_scheduler(
        ServeSettings(
            Asked(model=str(folder), device="cpu", dtype="fp32", options=ExecutionOptions(lora=served)), max_batch=2
        ),
        Metrics(),
    )
    choices = {
        "both": (
            [{"name": "style", "scale": 0.5}, {"name": "detail", "scale": 1.2}],
            LoraSet((LoraRef(str(first), 0.5), LoraRef(str(second), 1.2))),
        ),
        "style": ([{"name": "style"}], LoraSet((LoraRef(str(first)),))),
        "none": (None, None),
    }
    expected = {name: paradit_images("flux2", lora)[0] for name, (_, lora) in choices.items()}
    scheduler.start()
    try:
        with app_in_thread(create_app(scheduler, config, Metrics())) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            assert [card.lora for card in client.models.list().data] == [["detail", "style"]]

            def generate(name: str) -> np.ndarray:
                lora = choices[name][0]
                body = {"steps": REQUEST["steps"], "seed": REQUEST["seed"], "guidance": REQUEST["guidance"]}
                answer = client.images.generate(
                    prompt=REQUEST["prompt"], size="48x32", extra_body={**body, **({"lora": lora} if lora else {})}
                )
                with Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))) as image:
                    return np.asarray(image.convert("RGB"), dtype=np.float64)

            with ThreadPoolExecutor(3) as pool:  # queued together: one batch each all the same
                answers = dict(zip(choices, pool.map(generate, choices)))
            for name in ("none", "style", "both", "none"):
                assert levels(answers[name], expected[name]) <= 1, name
                answers[name] = generate(name)  # again, alone, after the others' choices
            with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'nope'"):
                client.images.generate(prompt="a fox", extra_body={"lora": [{"name": "nope"}]})
            # generate --server names the server's adapters as NAME:SCALE
            out = tmp_path / "remote.png"
            remote = [
                "generate",
                "--server",
                url,
                "--prompt",
                REQUEST["prompt"],
                "--height",
                "32",
                "--width",
                "48",
                "--steps",
                str(REQUEST["steps"]),
                "--seed",
                str(REQUEST["seed"]),
                "--guidance",
                "4.0",
                "--out",
                str(out),
                "--lora",
                "style:0.5",
                "--lora",
                "detail:1.2",
            ]
            assert run_cli(remote, capfd)[0] == 0
            with Image.open(out) as image:
                assert levels(np.asarray(image.convert("RGB"), dtype=np.float64), expected["both"]) <= 1
            assert_one_line_error(*run_cli([*remote, "--lora-mode", "unfused"], capfd)[::2], "--lora-mode")
    finally:
        scheduler.close()


CHOICES = [
    (("style", 0.5), ("detail", 1.2)),
    (("style", 1.0),),
    (("style", 0.5), ("detail", 1.2)),
    (),
    (("detail", 1.2), ("style", 0.5)),
    (("style", 1.0),),
]


def choice_images(adapters, cache: int, parallel: ParallelConfig | None) -> list[np.ndarray]:
    """The images of ``CHOICES`` served in turn by one engine serving the two FLUX.2 adapters, ``cache`` choices
    merged into its weights (0: run as side paths)."""
    first, second = adapters["flux2"]
    refs = (LoraRef(str(first), name="style"), LoraRef(str(second), name="detail"))
    lora = LoraSet(refs, (), "unfused", switchable=True, cache=cache)
    with Engine(
        str(folder_of("flux2")), device="cpu", dtype="fp32", parallel=parallel, options=ExecutionOptions(lora=lora)
    ) as engine:
        return [engine.generate(GenerationRequest(**REQUEST, lora=choice)).pixels.numpy() * 255 for choice in CHOICES]


@pytest.fixture(scope="module")
def side_path_images(adapters) -> list[np.ndarray]:
    """``CHOICES`` run as side paths in one process: the reference of every plan's cache of fused choices."""
    return choice_images(adapters, 0, None)


@pytest.mark.parametrize("parallel", [None, ParallelConfig(tensor=2)], ids=["one process", "tensor 2"])
def test_a_cache_of_fused_choices_gives_each_choice_the_image_of_its_side_paths(adapters, side_path_images, parallel):
    """``--lora-cache 1``: each choice merged into the weights (a miss merges and evicts the older choice, a repeat
    copies it back, none restores the base) gives the image of the same choice run as side paths, whatever ran
    before; under tensor parallelism each rank merges the factors it cut into the weight slice it holds."""
    side_paths = side_path_images
    assert levels(side_paths[3], side_paths[0]) > 3 and levels(side_paths[1], side_paths[0]) > 3
    for choice, ours, expected in zip(CHOICES, choice_images(adapters, 1, parallel), side_paths, strict=True):
        assert levels(ours, expected) <= 1, choice


def test_choices_that_graphs_or_sharding_could_not_replay_are_refused(adapters):
    """Side paths a CUDA graph would replay as captured, and merges into weights that sharding splits or a swap
    moves: refused, with the option that runs instead."""
    from paradit.settings import settle

    served = LoraSet((LoraRef(str(adapters["flux2"][0]), name="style"),), (), "unfused", switchable=True)
    cached = dataclasses.replace(served, cache=2)
    cuda = torch.device("cuda")  # validate only reads the device's type: no GPU needed to be refused
    with pytest.raises(InvalidRequest, match="give --lora-cache 1 or more"):
        check_conflicts(ParallelConfig(), ExecutionOptions(cuda_graphs=True, lora=served), cuda.type)
    check_conflicts(ParallelConfig(), ExecutionOptions(cuda_graphs=True, lora=cached), cuda.type)
    with pytest.raises(InvalidRequest, match="--lora-cache does not combine with swapped experts"):
        check_conflicts(ParallelConfig(), ExecutionOptions(swap_experts=True, lora=cached), cuda.type)
    asked = Asked(
        model=str(folder_of("flux2")),
        device="cpu",
        dtype="fp32",
        gpus=2,
        options=ExecutionOptions(lora=cached),
        parallel=ParallelConfig(ulysses=2, shard_weights=2),
    )
    with pytest.raises(InvalidRequest, match="--lora-cache does not combine with --shard-weights"):
        settle(asked)


def test_the_memory_plan_counts_side_paths_and_not_fused_adapters(adapters):
    from paradit.settings import settle

    first, second = adapters["flux2"]
    factors = sum(t.numel() for path in (first, second) for t in load_file(path).values()) * 4  # fp32 run

    def transformer_bytes(lora: LoraSet | None) -> int:
        asked = Asked(
            model=str(folder_of("flux2")),
            device="cpu",
            dtype="fp32",
            max_gpu_memory="64GiB",
            options=ExecutionOptions(lora=lora or LoraSet()),
        )
        return settle(asked).memory_plan.transformer

    refs = (LoraRef(str(first)), LoraRef(str(second)))
    plain = transformer_bytes(None)
    assert transformer_bytes(LoraSet(refs)) == plain
    assert transformer_bytes(LoraSet(refs, (), "unfused")) - plain == factors > 0
    # a cache of 2 fused choices: the base copy and two more of every weight the adapters change, beside the factors
    targets = {
        key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for path in (first, second) for key in load_file(path)
    }
    with torch.device("meta"):
        model = FAMILIES["flux2"].build_transformer(spec_from_folder(folder_of("flux2")))
    weights = sum(model.get_submodule(name).weight.numel() for name in targets) * 4
    assert transformer_bytes(LoraSet(refs, (), "unfused", True, cache=2)) - plain == factors + 3 * weights


def test_a_lokr_adapter_fuses_as_diffusers_applies_it_and_is_refused_as_side_paths(tmp_path, capfd):
    """ai-toolkit's Z-Image LoKr (diffusers-named modules under ``diffusion_model.``): a whole left factor and a
    factored right one with alpha 1 over rank 2, which diffusers' converter bakes into the left factor."""
    reference = PIPELINES["zimage"].from_pretrained(folder_of("zimage"), dtype=torch.float32)
    generator, state = torch.Generator().manual_seed(7), {}
    for name, module in reference.transformer.named_modules():
        if isinstance(module, nn.Linear) and ".attention.to_" in name:
            key = f"diffusion_model.{name}"
            out_features, in_features = module.out_features // 4, module.in_features // 4
            state[f"{key}.lokr_w1"] = torch.randn(4, 4, generator=generator)
            state[f"{key}.lokr_w2_a"] = torch.randn(out_features, 2, generator=generator) * 0.5
            state[f"{key}.lokr_w2_b"] = torch.randn(2, in_features, generator=generator) * 0.5
            state[f"{key}.alpha"] = torch.tensor(1.0)
    path = tmp_path / "lokr.safetensors"
    save_file(state, str(path))
    expected = reference_images("zimage", [(path, 0.9, "transformer")])
    ours = paradit_images("zimage", LoraSet((LoraRef(str(path), 0.9),)))
    assert levels(paradit_images("zimage", None), expected) > 3
    assert levels(ours, expected) <= 1, levels(ours, expected)
    argv = generate_args(folder_of("zimage"), tmp_path / "x.png", "--lora", str(path), "--lora-mode", "unfused")
    assert_one_line_error(*run_cli(argv, capfd)[::2], "LoKr adapters fuse into the weights only")


def test_an_fp8_checkpoint_takes_a_fused_adapter_dequantized_merged_and_quantized_again(adapters, tmp_path):
    from paradit.fp8_checkpoint import write_fp8_checkpoint
    from paradit.layers.fp8 import Fp8Linear
    from paradit.runtime import load_transformer

    source = spec_from_folder(folder_of("flux2"))
    write_fp8_checkpoint(source, tmp_path / "fp8", torch.float32)
    fp8 = spec_from_folder(tmp_path / "fp8")
    family, cpu = FAMILIES["flux2"], torch.device("cpu")
    lora = LoraSet((LoraRef(str(adapters["flux2"][0]), 1.5),))
    plain = load_transformer(family, fp8, cpu, torch.float32, None, ExecutionOptions(quantize="fp8")).model
    fused = load_transformer(family, fp8, cpu, torch.float32, None, ExecutionOptions(quantize="fp8", lora=lora)).model
    update = load_file(adapters["flux2"][0])
    name = "transformer_blocks.0.attn.to_q"
    delta = 1.5 * 2.0 * update[f"transformer.{name}.lora_B.weight"] @ update[f"transformer.{name}.lora_A.weight"]

    def dequantized(model: nn.Module) -> torch.Tensor:
        linear = model.get_submodule(name)
        assert isinstance(linear, Fp8Linear)
        return linear.weight.float() * linear.weight_scale

    wanted = dequantized(plain) + delta
    error = (dequantized(fused) - wanted).norm() / wanted.norm()
    assert error < 0.05 < (dequantized(plain) - wanted).norm() / wanted.norm(), error  # one FP8 rounding, not none
