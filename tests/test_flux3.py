"""paradit's FLUX.3 against diffusers' reference (the transformer module, and the modular pipeline image for image) on
tiny random checkpoint folders (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux3Transformer2DModel

from paradit.checkpoint import safetensors_files
from paradit.families.flux3.model import Flux3Config, Flux3Transformer
from tests.checkpoint_cache import cached
from tests.checkpoints import load_module_weights, relative_l2
from tests.flux3_checkpoints import build_flux3_checkpoint


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
