"""Step caching against diffusers' own hooks: on tiny ``save_pretrained`` folders (fp32, CPU), ``--cache first-block``,
``mag`` and ``taylorseer`` skip the steps diffusers' ``FirstBlockCacheConfig``, ``MagCacheConfig`` and
``TaylorSeerCacheConfig`` (lite: the output projection predicted, the blocks skipped) skip, branch by branch, and give
its image to one 8-bit level; every parallel plan gives the one-process pattern and image; a request decides alone,
whatever ran before it or is batched with it; plans that cannot cache, and bad parameters, are refused.

diffusers' hooks run only where their block metadata fits the model: its first-block hook raises on FLUX.2 (the
single-stream tail returns one tensor) and SD3.5 (the last block returns no text stream), its MagCache on Z-Image (the
block's argument is ``x``), its lite TaylorSeer on SD3.5; those cases are covered by the plans' tests alone."""

from __future__ import annotations

import base64
import functools
import io
import json

import httpx
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.hooks import (
    FirstBlockCacheConfig,
    MagCacheConfig,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
    apply_mag_cache,
    apply_taylorseer_cache,
    first_block_cache,
    mag_cache,
    taylorseer_cache,
)
from diffusers.hooks.hooks import CacheContext, _set_cache_context
from PIL import Image

from paradit.cache_options import curve_path
from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.loader import load_pipeline
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest, StepCacheConfig
from paradit.serving.launch import ServeSettings, build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.server import create_app
from paradit.settings import Asked
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.distributed import run_on_processes
from tests.test_checkpoint_options import assert_one_line_error, build_checkpoint, generate, run_cli, table_row
from tests.test_serving_scheduler import app_in_thread
from tests.test_wan import wan_checkpoint

STEPS, SEED, GUIDANCE = 10, 7, 4.0
RATIOS = (1.0, 1.1, 1.05, 0.98, 1.0, 1.02, 0.97, 1.0, 0.99, 0.95)
CONFIGS = {
    "first-block": StepCacheConfig("first-block", threshold=1.212),  # Qwen-Image's branches part at step 3
    "mag": StepCacheConfig("mag", threshold=0.2, mag_ratios=RATIOS),
    "taylorseer": StepCacheConfig("taylorseer", cache_interval=2, disable_cache_before_step=2),
}
# diffusers calls each guidance branch of these pipelines in a cache context of its own; the others batch both
# branches in one call, which one context (set here) serves.
OWN_CONTEXTS = {"qwen_image", "flux2", "wan"}
FOLDERS = {"wan": lambda: wan_checkpoint("t2v")}


def folder(family: str):
    return FOLDERS.get(family, lambda: cached(build_checkpoint, family))()


def request(family: str, cache: StepCacheConfig | None, **changes) -> GenerationRequest:
    size = {"frames": 5, "guidance_2": 2.5} if family == "wan" else {}
    negative = {"negative_prompt": " "} if family == "qwen_image" else {}  # Qwen-Image guides only with one
    fields = {"prompt": "a cat", "steps": STEPS, "seed": SEED, "guidance": GUIDANCE, "height": 32, "width": 48}
    return GenerationRequest(cache=cache, **{**fields, **size, **negative, **changes})


def diffusers_config(family: str, method: str):
    if method == "first-block":
        return FirstBlockCacheConfig(threshold=CONFIGS[method].threshold)
    if method == "mag":
        return MagCacheConfig(threshold=0.2, num_inference_steps=STEPS, mag_ratios=list(RATIOS))
    # Z-Image's final layer and blocks go by other names than the lite mode's patterns.
    names = (
        {
            "cache_identifiers": [r"all_final_layer\.2-1"],
            "skip_predict_identifiers": [r"(noise_refiner|context_refiner|layers)\.\d+"],
        }
        if family == "zimage"
        else {"use_lite_mode": True}
    )
    return TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32, **names
    )


def diffusers_run(family: str, method: str, monkeypatch) -> tuple[np.ndarray, list[tuple[bool, ...]]]:
    """diffusers' image with its hook, and per step whether each branch skipped (the order paradit records)."""
    decisions: dict[str, list[bool]] = {}

    def note(hook, skipped: bool) -> None:
        decisions.setdefault(hook.state_manager._context.name, []).append(skipped)

    def first_block(original):
        return lambda hook, residual: (lambda go: note(hook, not go) or go)(original(hook, residual))

    def mag(original):
        def forward(hook, module, *args, **kwargs):
            out = original(hook, module, *args, **kwargs)
            note(hook, not hook.state_manager.get_state().should_compute)
            return out

        return forward

    def taylor(original):
        def measure(hook):
            computes, state = original(hook)
            if not state.is_inactive:
                note(hook, not computes)
            return computes, state

        return measure

    monkeypatch.setattr(
        first_block_cache.FBCHeadBlockHook,
        "_should_compute_remaining_blocks",
        first_block(first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks),
    )
    monkeypatch.setattr(mag_cache.MagCacheHeadHook, "new_forward", mag(mag_cache.MagCacheHeadHook.new_forward))
    monkeypatch.setattr(
        taylorseer_cache.TaylorSeerCacheHook,
        "_measure_should_compute",
        taylor(taylorseer_cache.TaylorSeerCacheHook._measure_should_compute),
    )
    pipeline = DiffusionPipeline.from_pretrained(folder(family), dtype=torch.float32)
    apply = {"first-block": apply_first_block_cache, "mag": apply_mag_cache, "taylorseer": apply_taylorseer_cache}
    for name in ("transformer", "transformer_2"):  # Wan's experts: a cache each
        if getattr(pipeline, name, None) is not None:
            apply[method](getattr(pipeline, name), diffusers_config(family, method))
            if family not in OWN_CONTEXTS:
                _set_cache_context(getattr(pipeline, name), CacheContext("cond"))
    guidance = (
        {"true_cfg_scale": GUIDANCE, "negative_prompt": " "} if family == "qwen_image" else {"guidance_scale": GUIDANCE}
    )
    if family == "wan":
        guidance.update(guidance_scale_2=2.5, num_frames=5)
    output = pipeline(
        prompt="a cat",
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        height=32,
        width=48,
        output_type="np",
        **guidance,
    )
    pixels = (output.frames[0] if family == "wan" else output.images[0]) * 255
    branches = [decisions[name] for name in ("cond", "uncond") if name in decisions]
    if family not in OWN_CONTEXTS:  # one decision for the batched branches
        branches = branches * 2
    return pixels, list(zip(*branches))


@pytest.mark.parametrize(
    "family,method",
    [
        ("qwen_image", "first-block"),
        ("qwen_image", "mag"),
        ("qwen_image", "taylorseer"),
        ("flux2", "mag"),
        ("flux2", "taylorseer"),
        ("sd3", "mag"),
        ("zimage", "taylorseer"),
        ("wan", "first-block"),
        ("wan", "mag"),
    ],
)
def test_skip_pattern_and_image_equal_diffusers_hooks(family, method, monkeypatch):
    expected, pattern = diffusers_run(family, method, monkeypatch)
    with Engine(str(folder(family)), device="cpu", dtype="fp32") as engine:
        result = engine.generate(request(family, CONFIGS[method]))
    record = result.timings.features["step_cache"]
    assert record.skipped == pattern
    assert 0 < record.skipped_steps < STEPS and record.blocks_skipped > 0
    ours = result.pixels[0].permute(*((0, 2, 3, 1) if family == "wan" else (1, 2, 0))).numpy() * 255
    assert np.abs(ours.round() - expected.round()).max() <= 1
    if (family, method) == ("qwen_image", "first-block"):  # the branches part: one skips while the other runs
        assert any(len(set(call)) == 2 for call in pattern)


PLANS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=3),
    ParallelConfig(cfg=2),
    ParallelConfig(tensor=2),
    ParallelConfig(cfg=2, ulysses=2),
    ParallelConfig(ring=2, tensor=2),
]


def skipped(result) -> list[tuple[bool, ...]]:
    """Per model call of ``result``'s request, whether each guidance branch of each request skipped its blocks."""
    return result.timings.features["step_cache"].skipped


def _run(family: str, method: str, plan: ParallelConfig | None):
    device = torch.device("cpu")
    spec = spec_from_folder(folder(family))
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, torch.float32, context)
    results = pipeline.generate([FAMILIES[family].resolve_request(spec, request(family, CONFIGS[method]))])
    return None if results is None else (results[0].pixels, skipped(results[0]))


@functools.cache
def one_process(family: str, method: str):
    return _run(family, method, None)


@functools.cache
def engine_result():
    """Qwen-Image's first-block run through an Engine, as the command line and the server run it."""
    with Engine(str(folder("qwen_image")), device="cpu", dtype="fp32") as engine:
        return engine.generate(request("qwen_image", CONFIGS["first-block"]))


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.describe())
def test_every_plan_decides_as_one_process(plan):
    """The head block's statistic is summed over the group's shards (and the CFG halves' branches apart): every rank
    makes one process's decisions, branch by branch, and the image is one process's."""
    expected_pixels, expected_pattern = one_process("qwen_image", "first-block")
    pixels, pattern = run_on_processes(plan.world_size, _run, "qwen_image", "first-block", plan)
    assert pattern == expected_pattern
    assert relative_l2(pixels, expected_pixels) <= 1e-5


@pytest.mark.parametrize(
    "family,method,plan",
    [
        ("zimage", "first-block", ParallelConfig(ulysses=2)),
        ("wan", "mag", ParallelConfig(ring=2)),
        ("flux2", "first-block", ParallelConfig(cfg=2, ring=2)),
        ("sd3", "first-block", ParallelConfig(ulysses=2)),
    ],
)
def test_other_families_split_as_one_process(family, method, plan):
    """Z-Image's joint stack, Wan across its expert switch (each expert its own cache, counting its own steps),
    FLUX.2's two block lists and SD3.5's last block (no text stream out) decide on a split as on one process."""
    expected_pixels, expected_pattern = one_process(family, method)  # builds the folder here, before the processes
    pixels, pattern = run_on_processes(plan.world_size, _run, family, method, plan)
    assert pattern == expected_pattern and any(all(call) for call in pattern)
    assert relative_l2(pixels, expected_pixels) <= 1e-5


def test_a_request_decides_alone_after_another_and_in_a_batch():
    """No state carries from one request to the next, and a batch's requests each keep the decisions they make
    alone (first-block decides on each request's own rows)."""
    cache = CONFIGS["first-block"]
    with Engine(str(folder("qwen_image")), device="cpu", dtype="fp32") as engine:
        alone = [engine.generate(request("qwen_image", cache, seed=seed)) for seed in (SEED, 3)]
        again = engine.generate(request("qwen_image", cache, seed=SEED))
        batched = engine.generate([request("qwen_image", cache, seed=seed) for seed in (SEED, 3)])
    assert skipped(again) == skipped(alone[0])
    assert torch.equal(again.pixels, alone[0].pixels)
    assert skipped(alone[0]) != skipped(alone[1])  # the two decide differently
    # Batched, the groups are [request 1, request 2] per branch: each request's pair of branches is its own.
    both = skipped(batched[0])
    assert [(call[0], call[2]) for call in both] == skipped(alone[0])
    assert [(call[1], call[3]) for call in both] == skipped(alone[1])
    for each, single in zip(batched, alone):
        assert relative_l2(each.pixels, single.pixels) <= 1e-5


def test_mag_calibration_records_the_curve_without_skipping():
    with Engine(str(folder("qwen_image")), device="cpu", dtype="fp32") as engine:
        result = engine.generate(request("qwen_image", StepCacheConfig("mag", calibrate=True)))
        # A cache that never skips (its threshold 0), for the same one batch a step: an uncached request runs its
        # branches apart where their texts differ in length, which rounds differently.
        plain = engine.generate(request("qwen_image", StepCacheConfig("first-block", threshold=0.0)))
    record = result.timings.features["step_cache"]
    assert record.skipped_steps == 0 and len(record.mag_ratios) == STEPS
    assert record.mag_ratios[0] == 1.0 and all(r > 0 for r in record.mag_ratios)
    assert plain.timings.features["step_cache"].skipped_steps == 0
    assert torch.equal(result.pixels, plain.pixels)


@pytest.mark.parametrize(
    "cache,fragment",
    [
        (StepCacheConfig("teacache"), "choose one of first-block, mag, taylorseer"),
        (StepCacheConfig("first-block", threshold=-1), "threshold -1 is not allowed"),
        (StepCacheConfig("taylorseer", cache_interval=0), "cache_interval 0 is not allowed; give 1 or more"),
        (StepCacheConfig("mag"), "needs its model's magnitude ratios"),
    ],
)
def test_bad_cache_parameters_are_refused(cache, fragment):
    spec = spec_from_folder(folder("sd3"))
    with pytest.raises(InvalidRequest, match=fragment):
        FAMILIES["sd3"].resolve_request(spec, request("sd3", cache))


def test_pipefusion_with_a_cache_is_refused_before_any_step():
    with Engine(str(folder("sd3")), device="cpu", dtype="fp32", parallel=ParallelConfig(pipefusion=2)) as engine:
        with pytest.raises(InvalidRequest, match="step caching does not combine with PipeFusion"):
            engine.check(request("sd3", CONFIGS["mag"]))
        assert engine.check(request("sd3", None)).cache is None


def test_command_line_caches_reports_and_keeps_the_calibrated_curve(tmp_path, monkeypatch, capfd):
    """``--cache`` runs as the engine does and says what it skipped in the table, the JSON and the PNG's metadata;
    ``--cache-calibrate`` keeps the curve where the next ``--cache mag`` of the model finds it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = str(folder("qwen_image"))
    args = [
        "--negative-prompt",
        " ",
        "--prompt",
        "a cat",
        "--steps",
        str(STEPS),
        "--seed",
        str(SEED),
        "--guidance",
        str(GUIDANCE),
        "--height",
        "32",
        "--width",
        "48",
        "--no-progress",
        "--model",
        model,
        "--device",
        "cpu",
    ]
    out = generate(
        [
            "generate",
            *args,
            "--out",
            str(tmp_path / "fbc.png"),
            "--json",
            str(tmp_path / "fbc.json"),
            "--cache",
            "first-block",
            "--cache-threshold",
            "1.212",
        ],
        capfd,
    )
    expected = engine_result().timings.features["step_cache"]
    assert (
        table_row(out, "step cache")
        == f"{expected.skipped_steps} of {STEPS} steps skipped, {expected.blocks_skipped} block evaluations skipped"
    )
    written = json.loads((tmp_path / "fbc.json").read_text())["timings"]["features"]["step_cache"]
    assert [tuple(call) for call in written["skipped"]] == expected.skipped
    assert json.loads(Image.open(tmp_path / "fbc.png").info["cache"]) == {"method": "first-block", "threshold": 1.212}

    out = generate(
        ["generate", *args, "--out", str(tmp_path / "calibrate.png"), "--cache", "mag", "--cache-calibrate"], capfd
    )
    kept = curve_path(model)
    assert str(kept) in out and len(json.loads(kept.read_text())["mag_ratios"]) == STEPS
    out = generate(["generate", *args, "--out", str(tmp_path / "mag.png"), "--cache", "mag"], capfd)
    assert int(table_row(out, "step cache").split()[0]) > 0


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--cache-threshold", "0.1"], "need a method"),
        (["--cache", "first-block", "--cache-calibrate"], "give it with --cache mag"),
        (["--cache", "mag", "--cache-mag-ratios", "1,x"], "is not a comma-separated list"),
        (["--cache", "mag"], "measure them once with --cache mag --cache-calibrate"),
        (["--cache", "first-block", "--cache-interval", "3"], "--cache-interval is not a parameter of --cache first"),
    ],
)
def test_command_line_refuses_cache_flags_it_cannot_use(extra, fragment, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, _, err = run_cli(
        [
            "generate",
            "--model",
            "sd3.5-tiny",
            "--prompt",
            "a cat",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "x.png"),
            *extra,
        ],
        capfd,
    )
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "x.png").exists()


def test_server_takes_a_cache_per_request_and_counts_what_it_skipped():
    metrics = Metrics()
    scheduler, config = build_scheduler(
        ServeSettings(Asked(model=str(folder("qwen_image")), device="cpu", dtype="fp32")), metrics
    )
    expected = engine_result()
    body = {
        "prompt": "a cat",
        "negative_prompt": " ",
        "size": "48x32",
        "steps": STEPS,
        "seed": SEED,
        "guidance": GUIDANCE,
        "cache": {"method": "first-block", "threshold": 1.212},
    }
    scheduler.start()
    try:
        with app_in_thread(create_app(scheduler, config, metrics)) as url:
            answer = httpx.post(url + "/v1/images/generations", json=body, timeout=60)
            bad = httpx.post(url + "/v1/images/generations", json={**body, "cache": {"method": "teacache"}}, timeout=60)
            exposition = httpx.get(url + "/metrics", timeout=60).text
    finally:
        scheduler.close()
    assert answer.status_code == 200, answer.text
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert np.array_equal(np.asarray(image), np.asarray(expected.images[0]))
    assert bad.status_code == 400 and "cache" in bad.text
    skipped_steps = expected.timings.features["step_cache"].skipped_steps
    assert f'paradit_cached_steps_total{{group="0"}} {float(skipped_steps)}' in exposition
