"""Qwen-Image 2.1 against diffusers on tiny random weights (fp32, CPU): the transformer module, its prefix (text and
condition images) run once and its keys and values reused at every step, equal to diffusers' full block-causal
forward and to its cached mode."""

from __future__ import annotations

import pytest
import torch

from paradit.families.qwen_image21.model import QwenImage21Config, QwenImage21Transformer
from tests.checkpoints import relative_l2
from tests.qwen_image21_checkpoints import TEXT_HIDDEN, tiny_transformer

# [3 text | image 1 (4x6 tokens: 6 slots) | image 2 (4x4: 4 slots), adjacent | 4 text]: adjacent images stay apart.
SLOTS = [False] * 3 + [True] * 6 + [True] * 4 + [False] * 4
GRIDS = ((4, 6), (4, 4))
ROWS, COLS = 4, 6


@pytest.fixture(scope="module")
def modules():
    reference = tiny_transformer()
    ours = QwenImage21Transformer(QwenImage21Config.from_dict(dict(reference.config)))
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.eval()


def inputs(images: bool, padded: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor(SLOTS if images else [False] * 9)
    mask = torch.ones(2, slots.shape[0], dtype=torch.bool)
    if padded:
        mask[1, -2:] = False  # the second prompt is two tokens shorter
    grids = GRIDS if images else ()
    condition_tokens = sum(rows * cols for rows, cols in grids)
    return {
        "embeds": torch.randn(2, slots.shape[0], TEXT_HIDDEN, generator=gen),
        "slots": slots,
        "mask": mask if padded else None,
        "condition": torch.randn(1, condition_tokens, 64, generator=gen) if images else None,
        "grids": grids,
        "target": torch.randn(2, ROWS * COLS, 64, generator=gen),
        "timesteps": [torch.tensor([0.7, 0.7]), torch.tensor([0.35, 0.35])],
    }


def reference_forward(reference, given: dict, timestep, kv_cache=None, mode=None) -> torch.Tensor:
    batch = given["target"].shape[0]
    hidden = given["target"]
    if given["condition"] is not None:
        hidden = torch.cat([given["condition"].expand(batch, -1, -1), hidden], dim=1)
    target_slots = torch.ones(ROWS * COLS // 4, dtype=torch.bool)
    img_mask = torch.cat([given["slots"], target_slots])[None].expand(batch, -1)
    shapes = [[*((1, rows, cols) for rows, cols in given["grids"]), (1, ROWS, COLS)]] * batch
    out = reference(
        hidden_states=hidden,
        encoder_hidden_states=given["embeds"],
        timestep=timestep,
        img_shapes=shapes,
        img_mask=img_mask,
        encoder_hidden_states_mask=given["mask"],
        kv_cache=kv_cache,
        kv_cache_mode=mode,
        return_dict=False,
    )[0]
    return out[:, -ROWS * COLS :]


@pytest.mark.parametrize(("images", "padded"), [(False, False), (False, True), (True, False), (True, True)])
@torch.no_grad()
def test_transformer_equals_diffusers(modules, images, padded):
    """One prefix for the request, two steps from it: each equals diffusers' whole block-causal forward."""
    reference, ours = modules
    given = inputs(images, padded)
    prefix = ours.encode_prefix(given["embeds"], given["slots"], given["mask"], given["condition"], given["grids"])
    for timestep in given["timesteps"]:
        expected = reference_forward(reference, given, timestep)
        assert relative_l2(ours(given["target"], timestep, ROWS, COLS, prefix), expected) < 1e-5


@torch.no_grad()
def test_prefix_cache_equals_diffusers_cached_mode(modules):
    """diffusers' own cache (extract at the first step, cached after) gives the same steps as ours."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    reference, ours = modules
    given = inputs(images=True, padded=True)
    prefix = ours.encode_prefix(given["embeds"], given["slots"], given["mask"], given["condition"], given["grids"])
    cache = QwenImage21KVCache(len(reference.transformer_blocks))
    for step, timestep in enumerate(given["timesteps"]):
        expected = reference_forward(reference, given, timestep, cache, "extract" if step == 0 else "cached")
        assert relative_l2(ours(given["target"], timestep, ROWS, COLS, prefix), expected) < 1e-5
