"""Bad input is refused before anything loads or any worker starts, with one line and exit 2; damaged or unsafe
checkpoints are refused naming the file; the smaller promises of the command line (usage, version, metadata, seeds,
JSON, light imports) hold."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import paradit.loader
from benchmarks.common import default_plan_for
from paradit.cli import main, serial_comparison
from paradit.errors import CheckpointError
from paradit.families import PRESETS
from paradit.request import GenerationRequest, GenerationResult, Timings
from paradit.settings import resolve_model
from paradit.text_encoder import DecoderPromptEncoder
from tests.test_cli import assert_one_line_error, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--steps", "1", "--height", "32", "--width", "32", "--no-progress"]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if a pipeline starts loading: every refusal below must come first."""

    def refuse(*args, **kwargs):
        pytest.fail("a pipeline was loaded for a request that should have been refused up front")

    monkeypatch.setattr(paradit.loader, "load_pipeline", refuse)


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (["--gpus", "0"], ["--gpus", "0 is not allowed; give 1 or more"]),
        (["--gpus", "-2"], ["--gpus", "-2 is not allowed; give 1 or more"]),
        (["--ulysses", "0"], ["--ulysses", "0 is not allowed"]),
        (["--pipefusion", "64", "--gpus", "64"], ["pipefusion 64 exceeds the model's 4 blocks"]),
        (["--height", "100000"], ["height 100000 is not allowed", "to 8192"]),
        (["--steps", "1000000000"], ["steps 1000000000 is not allowed", "at most 10000"]),
        (["--seed", "99999999999999999999"], ["--seed", "give 0 to 18446744073709551615 or 'random'"]),
        (["--guidance", "nan"], ["--guidance", "'nan' is not a finite number"]),
        (["--guidance", "inf"], ["--guidance", "'inf' is not a finite number"]),
        (["--max-gpu-memory", "32"], ["'32' has no unit", "32GiB"]),
        (["--out", "/proc/x.png"], ["/proc is not a folder paradit can write to"]),
        (["--out", "o/"], ["o/ is a folder"]),
        (["--out", "o/noext"], ["no image extension", ".png, .jpg, .jpeg, .webp"]),
        (["--out", "a.txt"], ["no image extension"]),
    ],
)
def test_bad_input_is_refused_before_anything_loads(flags, fragments, tmp_path, capsys, nothing_loads):
    argv = ["generate", "--prompt", "a cat", *TINY]
    if "--out" not in flags:
        argv += ["--out", str(tmp_path / "x.png")]
    code, _, err = run_cli(argv + flags, capsys)
    assert_one_line_error(code, err, *fragments)


def test_prompts_that_are_not_utf8_are_refused_the_same_way_with_or_without_workers(tmp_path):
    """Undecodable argv bytes reach Python as lone surrogates; tokenizers then raised a TypeError traceback."""
    for gpus in ([], ["--gpus", "2"]):
        argv = [sys.executable, "-m", "paradit", "generate", "--prompt", os.fsdecode(b"a \xff\xfe cat"), *TINY, *gpus]
        proc = subprocess.run(
            [*argv, "--out", str(tmp_path / "x.png")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "prompt is not valid UTF-8" in proc.stderr and "Traceback" not in proc.stderr


def test_a_prompt_past_the_encoder_window_is_cut_with_a_warning(caplog):
    spec = PRESETS["flux2-tiny"].text_encoder
    encoder = DecoderPromptEncoder.dummy(spec, torch.device("cpu"), torch.float32)
    with caplog.at_level(logging.WARNING, logger="paradit.text_encoder"):
        ids, _ = encoder.tokenize(["short"])
        assert not caplog.records
        ids, _ = encoder.tokenize(["word " * 2000])
    assert ids.shape[1] == spec.max_length
    (record,) = caplog.records  # ours alone: transformers' own length warning is not repeated
    assert f"reads {spec.max_length}" in record.getMessage() and "tokens are dropped" in record.getMessage()


def test_usage_version_and_help_with_defaults(capsys):
    assert main([]) == 2
    assert "usage: paradit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("paradit ")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: flux2-tiny)" in help_text and "(default: out/paradit.png, out/paradit.mp4 for video" in help_text


def test_help_and_refusals_do_not_import_torch():
    """``paradit --help`` took 4.5 s because importing paradit imported torch and diffusers."""
    code = "import sys, paradit.cli; print('torch' in sys.modules, 'diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_cfg_parallel_is_the_default_plan_only_when_the_request_guides():
    """Qwen-Image without a negative prompt runs one branch: CFG parallel would leave half the group idle."""
    qwen, turbo = PRESETS["qwen-image-tiny"], PRESETS["z-image-turbo"]
    assert default_plan_for(qwen, 2, GenerationRequest(prompt="a fox")).cfg == 1
    assert default_plan_for(qwen, 2, GenerationRequest(prompt="a fox", negative_prompt="blur")).cfg == 2
    assert default_plan_for(turbo, 2, GenerationRequest(prompt="a fox")).cfg == 1  # guidance 0 by default
    assert default_plan_for(turbo, 2, GenerationRequest(prompt="a fox", guidance=3.0)).cfg == 2


def _result(pixels: torch.Tensor, plan: str = "ulysses 2") -> GenerationResult:
    return GenerationResult(pixels=pixels, seed=0, timings=Timings(plan=plan))


def test_verify_serial_fails_when_the_images_differ_beyond_the_plans_tolerance():
    serial = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    same, off = serial + 0.5 / 255, (serial + 3 / 255).clamp(0, 1)
    assert serial_comparison(_result(same), _result(serial), exact=True)[0] == 0
    code, line = serial_comparison(_result(off), _result(serial), exact=True)
    assert code == 3 and "DIFFERS FROM" in line
    # A lossy plan is held to its PSNR floor instead: 3 levels off is ~39 dB, within it; noise of 0.2 is not.
    assert serial_comparison(_result(off), _result(serial), exact=False)[0] == 0
    noisy = (serial + 0.2 * torch.randn(serial.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert serial_comparison(_result(noisy), _result(serial), exact=False)[0] == 3


def test_seed_metadata_json_formats_and_the_cpu_table(tmp_path, capsys):
    out, record = tmp_path / "img.png", tmp_path / "run.json"
    argv = ["generate", "--prompt", "a lighthouse", *TINY, "--seed", "random", "--out", str(out), "--json", str(record)]
    code, stdout, _ = run_cli(argv, capsys)
    assert code == 0
    data = json.loads(record.read_text())
    seed = data["seed"]
    assert stdout.splitlines()[0].split() == ["seed", str(seed)]  # the seed drawn is printed first
    assert "1 process" in stdout and "1 GPU" not in stdout and data["plan"] == "1 process"
    assert data["timings"]["text_encoders"] == "resident"  # not "gpu", on the CPU
    assert data["timings"]["step_ms"] and data["files"] == [str(out)]
    text = Image.open(out).text
    assert (text["prompt"], int(text["seed"]), text["model"]) == ("a lighthouse", seed, "flux2-tiny")
    assert (text["steps"], text["plan"]) == ("1", "1 process")
    # The seed printed reproduces the image; JPEG and WebP are written in their own formats.
    again = tmp_path / "again.png"
    argv = ["generate", "--prompt", "a lighthouse", *TINY, "--seed", str(seed), "--out", str(again)]
    assert run_cli(argv, capsys)[0] == 0
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(again)))
    for name, kind in (("x.jpg", "JPEG"), ("x.webp", "WEBP")):
        assert run_cli(["generate", "--prompt", "a lighthouse", *TINY, "--out", str(tmp_path / name)], capsys)[0] == 0
        assert Image.open(tmp_path / name).format == kind


def test_each_file_of_a_batch_records_its_own_prompt_seed_and_place_in_the_batch(tmp_path, capsys):
    out, record = tmp_path / "img.png", tmp_path / "run.json"
    prompts = ["--prompt", "a lighthouse", "--prompt", "a fox", "--images-per-prompt", "2", "--seed", "7"]
    argv = ["generate", *prompts, *TINY, "--out", str(out), "--json", str(record)]
    assert run_cli(argv, capsys)[0] == 0
    outputs = json.loads(record.read_text())["outputs"]
    expected = [("a lighthouse", 0), ("a lighthouse", 1), ("a fox", 2), ("a fox", 3)]
    assert [(each["prompt"], each["batch_index"]) for each in outputs] == expected
    for each, (prompt, index) in zip(outputs, expected):
        text = Image.open(each["file"]).text
        assert (text["prompt"], text["seed"], text["batch_index"], text["batch_size"]) == (prompt, "7", str(index), "4")


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory):
    from tests.checkpoint_cache import cached
    from tests.checkpoints import build_klein_checkpoint

    return cached(build_klein_checkpoint)  # read only: each damage is done to a copy


def _damaged_copy(source: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(source, folder)
    return folder


def _shard(folder: Path) -> Path:
    return sorted((folder / "transformer").glob("*.safetensors"))[0]


@pytest.mark.parametrize(
    "damage,fragments",
    [
        (lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:-100]), ["is not a readable safetensors file"]),
        (lambda f: _shard(f).write_bytes(b"\xff" * 64 + _shard(f).read_bytes()[64:]), ["not a readable safetensors"]),
        (lambda f: _shard(f).write_bytes(b""), ["is not a readable safetensors file"]),
        (lambda f: (f / "model_index.json").write_text("{not json"), ["model_index.json is not valid JSON"]),
        (lambda f: shutil.rmtree(f / "text_encoder"), ["has no text_encoder/ component"]),
        (lambda f: shutil.rmtree(f / "tokenizer"), ["has no tokenizer/ component"]),
        (lambda f: (f / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"x"), None),  # beside safetensors
    ],
    ids=[
        "truncated shard",
        "corrupted header",
        "empty shard",
        "bad model_index",
        "no text_encoder",
        "no tokenizer",
        "pickle beside safetensors",
    ],
)
def test_damaged_checkpoints_are_one_line_naming_the_file(klein_folder, tmp_path, capsys, damage, fragments):
    folder = _damaged_copy(klein_folder, tmp_path)
    damage(folder)
    code, _, err = run_cli(
        ["generate", "--model", str(folder), "--prompt", "a cat", *TINY, "--out", str(tmp_path / "x.png")], capsys
    )
    if fragments is None:  # safetensors present: diffusers reads those, so does paradit
        assert code == 0, err
        return
    line = assert_one_line_error(code, err, *fragments)
    assert str(folder) in line


def test_a_truncated_component_is_refused_when_the_folder_is_read_before_anything_loads(klein_folder, tmp_path):
    """The VAE, read last (after the denoise), is checked with the others when the folder is resolved."""
    folder = _damaged_copy(klein_folder, tmp_path)
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=r"vae/diffusion_pytorch_model.safetensors is not a readable safetensors file \(cut short"
    ):
        resolve_model(str(folder))


def test_pickle_weights_are_refused_unless_allowed(klein_folder, tmp_path, capsys):
    folder = _damaged_copy(klein_folder, tmp_path)
    vae = folder / "vae"
    weights = load_file(vae / "diffusion_pytorch_model.safetensors")
    (vae / "diffusion_pytorch_model.safetensors").unlink()
    torch.save(weights, vae / "diffusion_pytorch_model.bin")
    argv = ["generate", "--model", str(folder), "--prompt", "a cat", *TINY, "--out", str(tmp_path / "x.png")]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "diffusion_pytorch_model.bin", "can run code", "safetensors", "--allow-pickle")
    assert resolve_model(str(folder), allow_pickle=True).folder == folder
    code, _, err = run_cli([*argv, "--allow-pickle"], capsys)
    assert code == 0, err


def test_progress_shows_under_workers_and_no_progress_hides_every_bar(klein_folder, tmp_path, capfd, monkeypatch):
    """With --gpus N rank 0 draws the denoise bar (there was none); --no-progress also silences transformers' and
    diffusers' loading bars. --devices names the GPUs for this run and its workers."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    tiny = [arg for arg in TINY if arg != "--no-progress"]
    argv = ["generate", "--prompt", "a cat", *tiny, "--steps", "2", "--gpus", "2", "--out", str(tmp_path / "a.png")]
    assert main(argv) == 0
    assert "denoise" in capfd.readouterr().err
    argv = ["generate", "--model", str(klein_folder), "--prompt", "a cat", *TINY, "--out", str(tmp_path / "b.png")]
    assert main([*argv, "--devices", "1,0"]) == 0
    err = capfd.readouterr().err
    assert "%|" not in err and "it/s" not in err, err
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HIP_VISIBLE_DEVICES"] == "1,0"
