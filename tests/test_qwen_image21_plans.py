"""Qwen-Image 2.1 under every parallel plan equals one process (fp32, CPU, gloo): a guided edit of two prompts of
different lengths (so the prefix carries padding) from one condition image, each rank keeping only its share of the
cached prefix (Ulysses: its heads; Ring: its tokens, travelling round the ring). A 64x64 target is 16 tokens, 6/5/5
over three ring ranks; the two branches' prefixes (66 and 69 tokens, padded) split 33/33 and 35/34 over two."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paradit import Engine, GenerationRequest
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.layers.prefix_attention import CachedPrefix
from paradit.loader import load_pipeline
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.settings import Asked, settle
from paradit.spec import ModelSpec
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.distributed import run_on_processes
from tests.qwen_image21_checkpoints import build_qwen_image21_checkpoint
from tests.test_editing import picture

OUTPUT_RESOLUTION, STEPS, SEED = 64, 2, 11


def request(image_seed: int = 3) -> GenerationRequest:
    return GenerationRequest(
        prompt=["a red fox in the snow", "a fox"],
        negative_prompt=["blurry", "text, watermark, a frame"],
        guidance=3.0,
        image=[picture(60, 40, image_seed)],
        steps=STEPS,
        seed=SEED,
    )


@functools.cache
def small_spec() -> ModelSpec:
    """The tiny folder, its condition images read at 64 pixels (the only change: the tests run in seconds)."""
    spec = spec_from_folder(cached(build_qwen_image21_checkpoint))
    return dataclasses.replace(spec, details=dataclasses.replace(spec.details, output_resolution=OUTPUT_RESOLUTION))


def _pixels_and_prefix(
    plan: ParallelConfig | None, image_seeds: tuple[int, ...] = (3,)
) -> tuple[list[torch.Tensor] | None, list[tuple[int, ...]]]:
    """The images of one request per condition image seed, one after another, and the (whole, kept) shapes of every
    layer's prefix keys on this rank."""
    device, spec = torch.device("cpu"), small_spec()
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, torch.float32, context)
    kept: list[tuple[int, ...]] = []
    keep = [m for m in pipeline.runtime.model.modules() if hasattr(m, "keep_prefix")]
    for module in keep:
        module.keep_prefix = recording(module.keep_prefix, kept)
    resolve = FAMILIES["qwen_image21"].resolve_request
    results = [pipeline.generate([resolve(spec, request(seed))]) for seed in image_seeds]
    return None if results[0] is None else [result[0].pixels for result in results], kept


def recording(keep, kept: list):
    def keep_and_record(key, value, key_mask) -> CachedPrefix:
        prefix = keep(key, value, key_mask)
        kept.append((tuple(key.shape), tuple(prefix.key.shape)))
        return prefix

    return keep_and_record


@pytest.fixture(scope="module")
def one_process() -> list[torch.Tensor]:
    """The edit from one condition image, then from another, one process."""
    return _pixels_and_prefix(None, (3, 7))[0]


# Ulysses 2 alone runs through an Engine below.
PLANS = [
    pytest.param(plan, id=plan.describe())
    for plan in (
        ParallelConfig(cfg=2),
        ParallelConfig(tensor=2),
        ParallelConfig(ring=2),
        ParallelConfig(ring=3),
        ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(ulysses=2, shard_weights=2),
        ParallelConfig(cfg=2, pipefusion=2),  # a whole step a call: exact (patched steps attend stale K/V)
    )
]


PREFIX_TOKENS = (66, 69)  # the conditional and unconditional branches


@pytest.mark.parametrize("plan", PLANS)
def test_plan_equals_one_process(plan, one_process):
    """Rank 0 keeps its Ulysses rank's heads and its ring rank's first share of the prefix's tokens, for its
    PipeFusion stage's blocks (one of the two), for each guidance branch it computes; under Ring alone its layers
    made no more than that share (the prefix encode split), elsewhere the whole prefix."""
    small_spec()  # the folder built here, not by each process
    pixels, kept = run_on_processes(plan.world_size, _pixels_and_prefix, plan)
    assert relative_l2(pixels[0], one_process[0]) <= 1e-5
    branches = PREFIX_TOKENS[:1] if plan.cfg == 2 else PREFIX_TOKENS
    layers = 2 // plan.pipefusion
    assert [made[1] for made, _ in kept] == [
        -(-tokens // plan.ring) if plan.ring > 1 and plan.ulysses == 1 else tokens
        for tokens in branches
        for _ in range(layers)
    ]
    heads = 2 // plan.tensor // plan.ulysses
    assert [share[1:3] for _, share in kept] == [
        (-(-tokens // plan.ring), heads) for tokens in branches for _ in range(layers)
    ]


def test_consecutive_requests_through_one_engine_under_ulysses_each_use_their_own_prefix(one_process):
    """The second request's references make another image, equal to one process's: no prefix outlives its request."""
    with Engine(small_spec(), device="cpu", dtype="fp32", parallel=ParallelConfig(ulysses=2)) as engine:
        pixels = [engine.generate(request(seed)).pixels for seed in (3, 7)]
    assert relative_l2(one_process[1], one_process[0]) > 1e-3  # a hundred times the tolerance
    assert max(relative_l2(ours, serial) for ours, serial in zip(pixels, one_process)) <= 1e-5


@pytest.mark.parametrize(
    "plan,guidance,flag",
    [
        (ParallelConfig(pipefusion=2, ulysses=2), None, "--pipefusion with --ulysses or --ring"),
        (ParallelConfig(pipefusion=2), 3.0, "--pipefusion with guidance but without --cfg 2"),
    ],
)
def test_pipefusion_refuses_what_its_stages_cannot_take_in_one_line(plan, guidance, flag):
    settings = settle(Asked(str(cached(build_qwen_image21_checkpoint)), device="cpu", dtype="fp32", parallel=plan))
    with pytest.raises(InvalidRequest) as refused:
        settings.resolve(dataclasses.replace(request(), guidance=guidance))
    assert "\n" not in str(refused.value) and f"which {flag} cannot take yet; drop {flag} (" in str(refused.value)
    if guidance is not None:  # unguided, the stages take it
        assert settings.resolve(dataclasses.replace(request(), guidance=None)).images
