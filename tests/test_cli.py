"""The ``paradit`` command line, driven in-process through ``paradit.cli.main`` (plus one real subprocess)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from paradit.cli import main
from paradit.families import PRESETS
from tests.checkpoint_cache import cached
from tests.checkpoints import build_klein_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLE_ROWS = ("text encoding", "denoise step (median)", "VAE decode", "total", "peak memory")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one in-process CLI call; argparse errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def tiny_args(out: Path, *extra: str, prompt: str = "a lighthouse on a cliff") -> list[str]:
    return [
        "generate",
        "--model",
        "flux2-tiny",
        "--device",
        "cpu",
        "--prompt",
        prompt,
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line: {err!r}"
    line = lines[0]
    assert line.startswith("paradit: error:"), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_models_lists_every_preset(capsys):
    code, out, err = run_cli(["models"], capsys)
    assert code == 0
    assert err == ""
    lines = out.strip().splitlines()
    assert len(lines) == len(PRESETS)
    assert [line.split()[0] for line in lines] == list(PRESETS)
    for name in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "flux2-tiny"):
        line = next(line for line in lines if line.split()[0] == name)
        assert f"{PRESETS[name].steps} steps" in line
        assert f"{PRESETS[name].width}x{PRESETS[name].height}" in line


def test_generate_writes_png_of_requested_size_and_prints_timings(tmp_path, capsys):
    out = tmp_path / "x.png"
    argv = [
        "generate",
        "--model",
        "flux2-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a red fox in snow",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--out",
        str(out),
    ]
    code, stdout, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "paradit: error" not in err
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (48, 32)
        assert image.mode == "RGB"
    lines = stdout.strip().splitlines()
    for row in TABLE_ROWS:
        assert any(line.startswith(row) for line in lines), f"no {row!r} row in {stdout!r}"
    step_row = next(line for line in lines if line.startswith("denoise step (median)"))
    assert step_row.rstrip().endswith("ms x 1 more")  # the second step: the first is its own row
    assert next(line for line in lines if line.startswith("first denoise step")).rstrip().endswith(" ms")
    peak_row = next(line for line in lines if line.startswith("peak memory"))
    assert peak_row.rstrip().endswith("GiB")
    assert lines[-1] == f"wrote {out}"
    # The image is not blank: random weights still give structure, not one flat colour.
    assert pixels(out).std() > 0


def test_two_prompts_times_two_images_write_four_numbered_files(tmp_path, capsys):
    out = tmp_path / "x.png"
    argv = tiny_args(out, "--prompt", "a blue boat", "--images-per-prompt", "2")
    code, stdout, err = run_cli(argv, capsys)
    assert code == 0, err
    expected = [tmp_path / f"x_{i}.png" for i in range(4)]
    assert sorted(tmp_path.iterdir()) == expected
    assert not out.exists()
    arrays = [pixels(path) for path in expected]
    assert all(a.shape == (32, 32, 3) for a in arrays)
    # Four distinct images: two prompts, and two noise draws per prompt.
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.array_equal(arrays[i], arrays[j]), (i, j)
    assert stdout.strip().splitlines()[-1] == "wrote " + ", ".join(str(p) for p in expected)


def test_same_seed_same_png_and_other_seed_other_pixels(tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.png" for name in ("a", "b", "c")}
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        code, _, err = run_cli(tiny_args(paths[name], "--seed", seed), capsys)
        assert code == 0, err
    assert paths["a"].read_bytes() == paths["b"].read_bytes()
    assert np.array_equal(pixels(paths["a"]), pixels(paths["b"]))
    assert not np.array_equal(pixels(paths["a"]), pixels(paths["c"]))


def test_unknown_preset_is_one_line_error(tmp_path, capsys):
    code, out, err = run_cli(tiny_args(tmp_path / "x.png", "--model", "flux3-huge"), capsys)
    assert_one_line_error(code, err, "flux3-huge", "flux2-tiny")
    assert out == ""
    assert not (tmp_path / "x.png").exists()


def test_missing_folder_is_one_line_error(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "checkpoint"
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--model", str(missing)), capsys)
    assert_one_line_error(code, err, str(missing), "checkpoint folder")


def test_folder_without_model_index_is_one_line_error(tmp_path, capsys):
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "readme.txt").write_text("nothing here")
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--model", str(folder)), capsys)
    assert_one_line_error(code, err, str(folder), "model_index.json")


def test_checkpoint_missing_a_component_is_one_line_error(klein_checkpoint, tmp_path, capsys):
    folder = tmp_path / "klein-no-vae"
    shutil.copytree(klein_checkpoint, folder)
    shutil.rmtree(folder / "vae")
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--model", str(folder)), capsys)
    assert_one_line_error(code, err, str(folder), "vae/")


def test_height_not_multiple_of_16_is_one_line_error(tmp_path, capsys):
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--height", "30"), capsys)
    assert_one_line_error(code, err, "height 30", "multiples of 16")


def test_zero_steps_is_one_line_error(tmp_path, capsys):
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--steps", "0"), capsys)
    assert_one_line_error(code, err, "steps 0")


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_is_one_line_error(tmp_path, capsys, prompt):
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", prompt=prompt), capsys)
    assert_one_line_error(code, err, "prompt is empty")


def test_guidance_on_a_step_distilled_model_is_ignored_with_a_warning_as_diffusers_does(tmp_path, capsys, caplog):
    """diffusers' Flux2KleinPipeline takes guidance_scale for a distilled checkpoint and ignores it: paradit never
    refuses what diffusers accepts. The image is the unguided one."""
    folder = cached(build_klein_checkpoint, 0, True)  # distilled
    capsys.readouterr()
    plain, guided = tmp_path / "plain.png", tmp_path / "guided.png"
    assert run_cli(tiny_args(plain, "--model", str(folder)), capsys)[0] == 0
    assert "ignored" not in caplog.text
    assert run_cli(tiny_args(guided, "--model", str(folder), "--guidance", "3.5"), capsys)[0] == 0
    assert "guidance 3.5 is ignored" in caplog.text and "step-distilled" in caplog.text
    assert np.array_equal(pixels(plain), pixels(guided))


def test_negative_prompt_on_model_without_cfg_is_one_line_error(tmp_path, capsys):
    folder = cached(build_klein_checkpoint, 0, True)  # distilled
    capsys.readouterr()  # drop save_pretrained's progress bars; only the CLI's own output is under test
    argv = tiny_args(tmp_path / "x.png", "--model", str(folder), "--negative-prompt", "blurry")
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "negative prompt")
    assert not (tmp_path / "x.png").exists()


def test_invalid_dtype_choice_is_one_line_error(tmp_path, capsys):
    code, out, err = run_cli(tiny_args(tmp_path / "x.png", "--dtype", "fp8"), capsys)
    line = assert_one_line_error(code, err, "--dtype", "fp8")
    for allowed in ("bf16", "fp16", "fp32"):
        assert allowed in line
    assert "usage:" not in err
    assert out == ""


def test_module_entry_point_exits_2_with_one_line_and_no_traceback(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "paradit",
        "generate",
        "--model",
        "flux2-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a cat",
        "--steps",
        "1",
        "--height",
        "30",
        "--width",
        "32",
        "--out",
        str(tmp_path / "x.png"),
    ]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("paradit: error:")
    assert "multiples of 16" in lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "x.png").exists()


def test_serve_on_ray_without_ray_installed_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray gives `import ray`
    monkeypatch.delitem(sys.modules, "paradit.serving.ray_app", raising=False)
    assert main(["serve", "--ray", "--model", "flux2-tiny", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "paradit: error: --ray needs Ray Serve, which is not installed: pip install 'paradit[ray]'\n"
    )
