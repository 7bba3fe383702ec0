"""Wan 2.2 text-to-video: paradit's frames equal diffusers' ``WanPipeline`` on tiny checkpoints written by diffusers'
own ``save_pretrained`` (two experts with a boundary, and the TI2V-5B layout). The Wan transformer under every
sequence and tensor plan is test_parallel_matrix.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from tests.checkpoint_cache import cached
from tests.checkpoints import randomize
from tests.test_wan_model import tiny_config

# --- whole requests against diffusers' WanPipeline, on tiny checkpoints written by diffusers' save_pretrained ---

TEXT_WIDTH = 32


def tiny_wan_transformer(seed: int, channels: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    config = tiny_config(channels, channels, heads=2, head_dim=12)
    transformer = WanTransformer3DModel(**{**config, "text_dim": TEXT_WIDTH})
    randomize(transformer, std=0.1)
    return transformer.eval()


def tiny_umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    from paradit.offline_tokenizer import offline_t5_tokenizer

    torch.manual_seed(7)
    config = UMT5Config(
        vocab_size=len(offline_t5_tokenizer()),
        d_model=TEXT_WIDTH,
        d_ff=48,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    return UMT5EncoderModel(config).eval()


def tiny_wan_vae(layout: str):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(11)
    if layout == "wan21":
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, num_res_blocks=1)
    else:
        vae = AutoencoderKLWan(
            base_dim=8,
            decoder_base_dim=12,
            z_dim=48,
            num_res_blocks=1,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            latents_mean=[0.1 * (i % 5) for i in range(48)],
            latents_std=[1 + 0.1 * (i % 3) for i in range(48)],
        )
    randomize(vae, std=0.15)
    return vae.eval()


def wan_checkpoint(layout: str) -> Path:
    """``t2v``: two experts with boundary 0.875 (A14B layout); ``ti2v``: one transformer, per-token timesteps, the
    2.2 VAE (TI2V-5B layout); built once (checkpoint_cache)."""
    return cached(write_wan_checkpoint, layout)


def write_wan_checkpoint(folder: Path, layout: str) -> None:
    from diffusers import UniPCMultistepScheduler
    from diffusers import WanPipeline as DiffusersWan

    from paradit.families.wan.presets import UNIPC_FLOW
    from paradit.offline_tokenizer import offline_t5_tokenizer

    scheduler = UniPCMultistepScheduler.from_config({**UNIPC_FLOW, "flow_shift": 3.0})
    if layout == "t2v":
        experts = {
            "transformer": tiny_wan_transformer(1, 16),
            "transformer_2": tiny_wan_transformer(2, 16),
            "boundary_ratio": 0.875,
        }
    else:
        experts = {"transformer": tiny_wan_transformer(3, 48), "expand_timesteps": True}
    pipe = DiffusersWan(
        tokenizer=offline_t5_tokenizer(),
        text_encoder=tiny_umt5(),
        vae=tiny_wan_vae("wan21" if layout == "t2v" else "wan22"),
        scheduler=scheduler,
        **experts,
    )
    pipe.save_pretrained(folder)


@pytest.mark.parametrize("layout,size,frames", [("t2v", (32, 48), 5), ("ti2v", (64, 32), 5)])
def test_frames_equal_diffusers(layout, size, frames):
    from diffusers import WanPipeline as DiffusersWan

    from paradit.families import spec_from_folder
    from paradit.families.wan.family import resolve_request
    from paradit.loader import load_pipeline
    from paradit.request import GenerationRequest

    folder = wan_checkpoint(layout)
    reference = DiffusersWan.from_pretrained(folder)
    height, width = size
    prompts, steps, seed = ["a red fox &amp; a  crow", "snow"], 6, 3
    guidance = {"guidance_scale": 4.0, "guidance_scale_2": 2.5} if layout == "t2v" else {"guidance_scale": 5.0}
    expected = reference(
        prompt=prompts,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        max_sequence_length=512,
        **guidance,
    ).frames

    spec = spec_from_folder(folder)
    assert spec.experts.keys() == ({"transformer_2"} if layout == "t2v" else set())
    pipeline = load_pipeline(spec, torch.device("cpu"), torch.float32)
    (result,) = pipeline.generate(
        [
            resolve_request(
                spec,
                GenerationRequest(
                    prompt=prompts,
                    height=height,
                    width=width,
                    frames=frames,
                    steps=steps,
                    seed=seed,
                    guidance=guidance["guidance_scale"],
                    guidance_2=guidance.get("guidance_scale_2"),
                ),
            )
        ]
    )
    assert result.pixels.shape == (2, frames, 3, height, width) and len(result.frames[0]) == frames
    ours = (result.pixels.permute(0, 1, 3, 4, 2).numpy() * 255).round()
    assert expected.std() > 0.05  # the frames are not flat: a wrong step or expert would show
    levels = abs(ours - (expected * 255).round())
    assert levels.max() <= 1, levels.max()


def test_frames_and_guidance_2_are_checked():
    from paradit.errors import InvalidRequest
    from paradit.families import PRESETS
    from paradit.families.wan.family import resolve_request
    from paradit.request import GenerationRequest

    a14b, ti2v = PRESETS["wan2.2-t2v-a14b"], PRESETS["wan2.2-ti2v-5b"]
    resolved = resolve_request(a14b, GenerationRequest(prompt="x"))
    assert (resolved.frames, resolved.guidance, resolved.guidance_2) == (81, 4.0, 3.0)
    assert resolve_request(a14b, GenerationRequest(prompt="x", guidance=6.0)).guidance_2 == 6.0  # diffusers' rule
    with pytest.raises(InvalidRequest, match=r"4k\+1 frames \(1, 5, 9"):
        resolve_request(a14b, GenerationRequest(prompt="x", frames=80))
    with pytest.raises(InvalidRequest, match="multiples of 32"):
        resolve_request(ti2v, GenerationRequest(prompt="x", height=720))
    with pytest.raises(InvalidRequest, match="low-noise expert"):
        resolve_request(ti2v, GenerationRequest(prompt="x", guidance_2=3.0))


def test_cli_writes_each_videos_frames_and_refuses_what_wan_cannot_run(tmp_path, capsys):
    """A video model's frames go to a folder named after --out, one image per frame, the same as the Engine's; plans
    the two-expert model cannot run are refused before anything loads."""
    from PIL import Image

    from paradit.cli import main
    from paradit.engine import Engine
    from paradit.request import GenerationRequest
    from tests.test_cli import assert_one_line_error, run_cli

    args = [
        "generate",
        "--model",
        "wan-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a boat",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--no-progress",
    ]
    assert main([*args, "--out", str(tmp_path / "v.png")]) == 0
    frames = sorted((tmp_path / "v").iterdir())
    assert [f.name for f in frames] == [f"{i:04d}.png" for i in range(5)]
    request = GenerationRequest(prompt="a boat", steps=2, height=32, width=32, frames=5, seed=0)
    with Engine("wan-tiny", device="cpu") as engine:
        video = engine.generate(request).pixels[0]
    written = torch.stack([torch.from_numpy(np.asarray(Image.open(f))).permute(2, 0, 1) for f in frames])
    assert (written.float() - (video * 255).round()).abs().max() <= 1
    capsys.readouterr()
    for flags, fragment in ((["--gpus", "2", "--pipefusion", "2"], "second transformer"), (["--frames", "4"], "4k+1")):
        code, _, err = run_cli([*args, *flags, "--out", str(tmp_path / "x.png")], capsys)
        assert_one_line_error(code, err, fragment)
