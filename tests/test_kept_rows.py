"""The last joint block computing only the rows a step keeps (FLUX.2, FLUX.3) gives the image the whole block gives:
on tiny ``save_pretrained`` folders (fp32, CPU) with 0, 1 and 3 references, klein KV's cached references, FP8
linears (their K/V weight rows multiplied alone) and a masked batch; a linear's output features from its weight rows
equal the whole output's; the plans that split the sequence or the stack, and step caching, compute every row."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paradit.layers.attention import sdpa_attention
from paradit.layers.fp8 import Fp8Linear
from paradit.layers.kept_rows import output_features
from paradit.lora.apply import LoraSidePath
from paradit.parallel import ParallelConfig
from paradit.pipelines.base import DiffusionPipeline
from paradit.quantize import convert_fp8
from paradit.request import StepCacheConfig
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.flux3_checkpoints import build_flux3_checkpoint
from tests.test_flux2_reference import load_ours as load_flux2
from tests.test_flux2_reference import transformer_inputs as flux2_inputs
from tests.test_flux3 import load_ours as load_flux3
from tests.test_flux3 import transformer_inputs as flux3_inputs

# Reference grids (rows, cols) by count: FLUX.2 follows the target with them in the image stream, FLUX.3 in its own.
REFERENCES = {0: [], 1: [(4, 4)], 3: [(4, 4), (2, 3), (3, 5)]}
GRID, TEXT_TOKENS = (3, 4), 7


@pytest.fixture(scope="module")
def flux2_models(klein_checkpoint, dev_checkpoint):
    return {"klein": load_flux2(klein_checkpoint), "dev": load_flux2(dev_checkpoint)}


def flux2_reference_ids(grids: list[tuple[int, int]]) -> torch.Tensor:
    """At time coordinates 10, 20, ..., as the pipeline lays them."""
    return torch.cat(
        [
            torch.cartesian_prod(torch.tensor([10 * (n + 1)]), torch.arange(rows), torch.arange(cols), torch.arange(1))
            for n, (rows, cols) in enumerate(grids)
        ]
    )


def with_flux2_references(inputs: dict, grids: list[tuple[int, int]], channels: int, seed: int) -> dict:
    """The references' tokens after the target's (the pipeline's layout)."""
    if not grids:
        return inputs
    gen = torch.Generator().manual_seed(seed)
    batch = inputs["hidden_states"].shape[0]
    tokens = torch.randn(batch, sum(rows * cols for rows, cols in grids), channels, generator=gen)
    hidden = torch.cat([inputs["hidden_states"], tokens], dim=1)
    return {**inputs, "hidden_states": hidden, "img_ids": torch.cat([inputs["img_ids"], flux2_reference_ids(grids)])}


def flux2_case(model, refs: int, batch: int = 2) -> tuple[dict, int]:
    config = model.config
    inputs = flux2_inputs(vars(config), batch, *GRID, TEXT_TOKENS, seed=refs)
    inputs = with_flux2_references(inputs, REFERENCES[refs], config.in_channels, seed=refs + 1)
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs, GRID[0] * GRID[1]


def assert_kept_rows_equal_whole(model, inputs: dict, target: int, **kept) -> None:
    """The prediction equals the whole block's, and the last block's attention had the target's queries alone."""
    attention = model.single_transformer_blocks[-1].attn
    queries = []

    def recording(query, key, value, key_mask=None):
        queries.append(query.shape[1])
        return sdpa_attention(query, key, value, key_mask)

    attention.set_attention_fn(recording)
    try:
        with torch.no_grad():
            whole = model(**inputs)[:, :target]
            got = model(**inputs, **kept)
    finally:
        attention.set_attention_fn(sdpa_attention)
    assert queries[1] == target < queries[0]
    assert got.shape == whole.shape
    assert relative_l2(got, whole) <= 1e-5


@pytest.mark.parametrize("refs", sorted(REFERENCES))
@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_flux2_last_block_of_the_kept_rows_gives_the_whole_blocks_image(flux2_models, variant, refs):
    model = flux2_models[variant]
    inputs, target = flux2_case(model, refs)
    assert_kept_rows_equal_whole(model, inputs, target, output_tokens=target)


def test_flux2_kept_rows_with_cached_reference_keys_and_values(flux2_models):
    """klein KV: the references' keys and values cached once, joined in every block, the last one's included."""
    model = flux2_models["klein"]
    inputs, target = flux2_case(model, 0)
    grids = REFERENCES[3]
    references = torch.randn(1, sum(rows * cols for rows, cols in grids), model.config.in_channels)
    with torch.no_grad():
        cached_kv = model.cache_references(references, flux2_reference_ids(grids))
    assert_kept_rows_equal_whole(model, {**inputs, "reference_kv": cached_kv}, target, output_tokens=target)


def test_flux2_kept_rows_with_fp8_linears(flux2_models):
    """The dropped rows' keys and values from the FP8 weight's K and V rows alone (and their scales)."""
    model = copy.deepcopy(flux2_models["klein"])
    assert "single_transformer_blocks.1.attn.to_qkv_mlp_proj" in convert_fp8(model, torch.float8_e4m3fn, ())
    inputs, target = flux2_case(model, 3)
    assert_kept_rows_equal_whole(model, inputs, target, output_tokens=target)


@pytest.fixture(scope="module")
def flux3_models():
    return {flow_map: load_flux3(cached(build_flux3_checkpoint, flow_map)) for flow_map in (False, True)}


@pytest.mark.parametrize("refs", sorted(REFERENCES))
@pytest.mark.parametrize("flow_map", [False, True])
def test_flux3_last_block_of_the_image_rows_gives_the_whole_blocks_image(flux3_models, flow_map, refs):
    model = flux3_models[flow_map]
    config = {**vars(model.config), "flow_map": flow_map}
    inputs = flux3_inputs(config, 2, GRID, TEXT_TOKENS, REFERENCES[refs], seed=refs)
    assert_kept_rows_equal_whole(model, inputs, GRID[0] * GRID[1], image_only=True)


def test_flux3_image_rows_with_a_masked_batch_and_a_cached_prefix(flux3_models):
    """The second prompt's padding masked out of every key, the text and references through their blocks once."""
    model = flux3_models[False]
    inputs = flux3_inputs({**vars(model.config), "flow_map": False}, 2, GRID, TEXT_TOKENS, REFERENCES[1], seed=5)
    mask = torch.ones(2, TEXT_TOKENS, dtype=torch.bool)
    mask[1, -3:] = False
    with torch.no_grad():
        txt, cond = model.encode_prefix(
            inputs["encoder_hidden_states"],
            inputs["txt_ids"],
            inputs["image_cond_hidden_states"][:1],
            inputs["image_cond_ids"],
            mask,
        )
    prefixed = {**inputs, "encoder_hidden_states": txt, "image_cond_hidden_states": cond, "prefixed": True}
    prefixed["encoder_attention_mask"] = mask
    assert_kept_rows_equal_whole(model, prefixed, GRID[0] * GRID[1], image_only=True)


def test_output_features_equal_the_whole_outputs_columns():
    """From a plain linear's weight rows, an FP8 linear's (with their scales), or cut from a LoRA side path's output."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 96)
    fp8 = Fp8Linear.from_linear(plain, torch.float8_e4m3fn)
    side_path = LoraSidePath(nn.Linear(32, 96), {})
    side_path.down, side_path.up = torch.randn(4, 32), torch.randn(96, 4)
    x = torch.randn(2, 5, 32)
    for linear in (plain, fp8, side_path):
        with torch.no_grad():
            got, whole = output_features(linear, x, 32, 80), linear(x)[..., 32:80]
        assert got.shape == (2, 5, 48)
        assert relative_l2(got, whole) <= 1e-6


@pytest.mark.parametrize(
    "plan,cache,kept",
    [
        (None, None, True),
        (ParallelConfig(tensor=2), None, True),
        (ParallelConfig(cfg=2), None, True),
        (ParallelConfig(ulysses=2), None, False),
        (ParallelConfig(ring=2), None, False),
        (ParallelConfig(pipefusion=2), None, False),
        (ParallelConfig(tensor=2, shard_weights=2), None, False),
        (None, StepCacheConfig(method="first-block", threshold=0.05), False),
    ],
)
def test_only_plans_holding_every_token_and_block_drop_rows_and_not_under_step_caching(plan, cache, kept):
    pipeline = SimpleNamespace(parallel=None if plan is None else SimpleNamespace(config=plan))
    assert DiffusionPipeline.keeps_only_output_rows(pipeline, SimpleNamespace(cache=cache)) is kept
