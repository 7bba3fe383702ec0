"""paradit's Wan transformer against diffusers' ``WanTransformer3DModel`` on tiny random checkpoints (fp32, CPU), in
the layouts of the published Wan 2.2 checkpoints, and the video stream split in two as the sequence-parallel runtime
splits it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from paradit.checkpoint import safetensors_files
from paradit.families.wan.model import WanConfig, WanTokens, WanTransformer, unpatchify
from paradit.layers.attention import AttentionDispatch, sdpa_attention
from paradit.parallel.sequence import narrow_streams
from tests.checkpoints import load_module_weights, randomize, relative_l2

TEXT_DIM = 20
TEXT_TOKENS = 7
# The reference splits [image features, text] by assuming the text is exactly this long (Wan's T5 length).
REFERENCE_TEXT_TOKENS = 512


def tiny_config(in_channels: int, out_channels: int, heads: int, head_dim: int, **extra) -> dict:
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": heads,
        "attention_head_dim": head_dim,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "text_dim": TEXT_DIM,
        "freq_dim": 32,
        "ffn_dim": 40,
        "num_layers": 2,
        "cross_attn_norm": True,
        "eps": 1e-6,
        "rope_max_seq_len": 64,
        **extra,
    }


LAYOUTS = {
    "t2v": tiny_config(16, 16, heads=2, head_dim=24),  # T2V-A14B: 16 latent channels in and out
    "i2v": tiny_config(36, 16, heads=3, head_dim=16),  # I2V-A14B: noise, mask and image latents in
    "ti2v": tiny_config(48, 48, heads=2, head_dim=24),  # TI2V-5B: 48 channels, per-token timesteps
    # Wan 2.1 I2V's CLIP branch (no Wan 2.2 checkpoint has it); without the cross-attention norm to cover that too.
    "clip": tiny_config(36, 16, heads=2, head_dim=16, image_dim=12, added_kv_proj_dim=32, cross_attn_norm=False),
    "flf2v": tiny_config(36, 16, heads=2, head_dim=16, image_dim=12, added_kv_proj_dim=32, pos_embed_seq_len=10),
}


def build(folder: Path, config: dict, seed: int) -> tuple[WanTransformer3DModel, WanTransformer]:
    """The reference with every parameter randomised, saved as a checkpoint folder; ours loaded from that folder."""
    torch.manual_seed(seed)
    reference = WanTransformer3DModel(**config)
    randomize(reference)
    reference.save_pretrained(folder)
    ours_config = WanConfig.from_dict(WanTransformer3DModel.load_config(folder))
    with torch.device("meta"):
        ours = WanTransformer(ours_config)
    load_module_weights(ours, safetensors_files(folder), torch.device("cpu"), torch.float32)
    return reference.eval(), ours.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str) -> tuple[WanTransformer3DModel, WanTransformer]:
        if name not in cache:
            cache[name] = build(tmp_path_factory.mktemp(f"wan_{name}"), LAYOUTS[name], seed=len(cache))
        return cache[name]

    return get


def first_frame_timesteps(grid: tuple[int, int, int], timesteps: torch.Tensor) -> torch.Tensor:
    """(B, tokens) as diffusers' TI2V pipeline builds them for image conditioning: 0 on the first frame's tokens."""
    mask = torch.ones(grid)
    mask[0] = 0
    return mask.flatten()[None] * timesteps[:, None]


def inputs(in_channels: int, latent_size: tuple[int, int, int], seed: int, text_tokens: int = TEXT_TOKENS):
    """Batch 2 with different timesteps."""
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, in_channels, *latent_size, generator=gen)
    text = torch.randn(2, text_tokens, TEXT_DIM, generator=gen)
    return latents, torch.tensor([937.0, 281.5]), text


def compare(reference, ours, latents, timestep, text, image=None) -> None:
    with torch.no_grad():
        expected = reference(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
        grid = ours.config.token_grid(*latents.shape[2:])
        got = unpatchify(ours(latents, timestep, text, image), grid, ours.config.patch_size)
    assert got.shape == expected.shape == (2, ours.config.output_channels, *latents.shape[2:])
    assert relative_l2(got, expected) <= 1e-5


@pytest.mark.parametrize("name,latent_size", [("t2v", (3, 4, 6)), ("i2v", (2, 6, 4))])
def test_matches_diffusers(models, name, latent_size):
    reference, ours = models(name)
    compare(reference, ours, *inputs(ours.config.in_channels, latent_size, seed=1))


def test_ti2v_per_token_timesteps_match_diffusers(models):
    reference, ours = models("ti2v")
    latents, timesteps, text = inputs(ours.config.in_channels, (3, 4, 6), seed=2)
    per_token = first_frame_timesteps(ours.config.token_grid(3, 4, 6), timesteps)
    compare(reference, ours, latents, per_token, text)
    tokens = ours.embed(latents, per_token, text)
    assert tokens.temb is None and tokens.token_modulation.shape == (2, 18, 6, ours.config.inner_dim)


@pytest.mark.parametrize("name,image_tokens", [("clip", 5), ("flf2v", 5)])
def test_image_features_match_diffusers(models, name, image_tokens):
    reference, ours = models(name)
    latents, timesteps, text = inputs(ours.config.in_channels, (2, 4, 4), seed=3, text_tokens=REFERENCE_TEXT_TOKENS)
    # FLF2V: first- and last-frame features stacked along the batch, joined to one sequence by the embedder.
    rows = 4 if reference.config.pos_embed_seq_len else 2
    image = torch.randn(rows, image_tokens, reference.config.image_dim, generator=torch.Generator().manual_seed(4))
    compare(reference, ours, latents, timesteps, text, image)


def test_attention_modules_name_their_streams(models):
    _, ours = models("t2v")
    streams = [m.sequence_streams for m in ours.modules() if isinstance(m, AttentionDispatch)]
    assert streams == [("video",), ()] * ours.config.num_layers


def run_split(model: WanTransformer, tokens: WanTokens, cut: int) -> torch.Tensor:
    """The video stream in two contiguous chunks, each run by its own thread as a rank would: self-attention gathers
    both chunks' K/V, cross-attention stays local. Returns the two heads' outputs concatenated."""
    length = tokens.video.shape[1]
    chunks = [narrow_streams(tokens, {"video": (0, cut)}), narrow_streams(tokens, {"video": (cut, length)})]
    barrier, shared, local = threading.Barrier(2, timeout=60), {}, threading.local()

    def gathered(query, key, value, key_mask=None):
        shared[local.rank] = (key, value)
        barrier.wait()
        keys, values = (torch.cat([shared[0][i], shared[1][i]], dim=1) for i in range(2))
        barrier.wait()  # both have read before either writes the next layer's
        return sdpa_attention(query, keys, values, key_mask)

    outputs, errors = [None, None], []

    def rank(index: int) -> None:
        local.rank = index
        try:
            with torch.no_grad():
                outputs[index] = model.head(model.run_blocks(chunks[index]))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            barrier.abort()

    self_attention = [m for m in model.modules() if isinstance(m, AttentionDispatch) and m.sequence_streams]
    for module in self_attention:
        module.set_attention_fn(gathered)
    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for module in self_attention:
            module.set_attention_fn(sdpa_attention)
    if errors:
        raise errors[0]
    return torch.cat(outputs, dim=1)


def test_video_stream_splits_like_sequence_parallelism(models):
    """Per-token timesteps, so that the per-token modulation is split with the tokens too; an uneven cut."""
    _, ours = models("ti2v")
    latents, timesteps, text = inputs(ours.config.in_channels, (3, 4, 6), seed=5)
    per_token = first_frame_timesteps(ours.config.token_grid(3, 4, 6), timesteps)
    with torch.no_grad():
        tokens = ours.embed(latents, per_token, text)
        expected = ours.head(ours.run_blocks(tokens))
    for name, (_, dim) in WanTokens.SEQUENCE_FIELDS.items():
        value = getattr(tokens, name)
        for part in value if isinstance(value, tuple) else (value,):
            assert part.shape[dim] == tokens.video.shape[1], name
    got = run_split(ours, tokens, cut=7)
    assert relative_l2(got, expected) <= 1e-6
