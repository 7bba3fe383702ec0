"""Every ``paradit generate`` option on real diffusers checkpoint folders, for every family.

The presets are paradit's own specs; a folder written by diffusers' ``save_pretrained`` goes through another path
(configs read from disk, encoders loaded by class name, weights sliced from sharded safetensors), so each option is run
here on a tiny folder of each family through ``paradit.cli.main``, on the CPU. Outcomes are compared in pixels: an
exact plan's PNG must equal the one-process PNG within one 8-bit level, a lossy one must stay within the bound measured
below, and every refusal is one line with exit code 2. No case may print a traceback: stderr is captured at the file
descriptor level, so the worker processes' output is checked too.
"""

from __future__ import annotations

import json
import re
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from PIL import Image

from paradit.cli import main
from tests.checkpoint_cache import cached
from tests.checkpoints import build_klein_checkpoint, randomize
from tests.qwen_image_checkpoints import build_qwen_image_checkpoint
from tests.sd3_checkpoints import build_sd3_checkpoint
from tests.sd3_checkpoints import tiny_transformer as sd3_transformer
from tests.zimage_checkpoints import build_zimage_checkpoint
from tests.zimage_checkpoints import tiny_transformer_config as zimage_transformer_config

FAMILIES = ("flux2", "qwen_image", "sd3", "zimage")
PROMPT = "a lighthouse on a cliff"
# 32x48 pixels is a 2x3 token grid in every family: two token rows, so two PipeFusion patches have a row each.
SIZE_AND_STEPS = ("--height", "32", "--width", "48", "--steps", "2", "--seed", "3")
# How the closing table names encoders kept whole in the device's memory ("resident" where the device is the CPU).
RESIDENT = {"gpu", "resident"}
# 6 heads: --tensor 2 shards whole heads, which the builders' default of 3 would refuse.
HEADS = 6


def replace_transformer(folder: Path, transformer: torch.nn.Module) -> Path:
    """The folder with its transformer component rewritten by diffusers' ``save_pretrained`` (the SD3.5 and Z-Image
    builders take no head count)."""
    shutil.rmtree(folder / "transformer")
    transformer.save_pretrained(folder / "transformer", max_shard_size="100KB")
    return folder


def build_checkpoint(folder: Path, family: str) -> Path:
    """A tiny folder with classifier-free guidance (klein base, Z-Image base; Qwen-Image and SD3.5 always guide)."""
    if family == "flux2":
        return build_klein_checkpoint(folder, heads=HEADS)
    if family == "qwen_image":
        return build_qwen_image_checkpoint(folder, heads=HEADS)
    if family == "sd3":
        return replace_transformer(build_sd3_checkpoint(folder), sd3_transformer(0, heads=HEADS))
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(**zimage_transformer_config(heads=HEADS))
    randomize(transformer)
    return replace_transformer(build_zimage_checkpoint(folder), transformer)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    return {family: cached(build_checkpoint, family) for family in FAMILIES}


def generate_args(folder: Path, out: Path, *extra: str) -> list[str]:
    return [
        "generate",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--prompt",
        PROMPT,
        *SIZE_AND_STEPS,
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def run_cli(argv: list[str], capfd) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one in-process CLI call. An exception escaping ``main`` is what the
    command line would print as a traceback, so it is returned in stderr for the no-traceback check to catch."""
    capfd.readouterr()  # drop what came before (fixtures' save_pretrained progress bars)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception:
        code = 1
        traceback.print_exc()
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2, f"exit code {code}, stderr {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line: {err!r}"
    assert lines[0].startswith("paradit: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def generate(argv: list[str], capfd) -> str:
    """Run a generation that must succeed; its stdout."""
    code, out, err = run_cli(argv, capfd)
    assert code == 0, err
    return out


def table_row(out: str, name: str) -> str:
    return next(line[len(name) :].strip() for line in out.splitlines() if line.startswith(name))


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def level_diff(a: Path, b: Path) -> np.ndarray:
    one, other = pixels(a), pixels(b)
    assert one.shape == other.shape == (32, 48, 3)
    return np.abs(one - other)


@pytest.fixture(scope="module")
def serial_png(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each family's one-process PNG, the image every option is held to."""
    folder = tmp_path_factory.mktemp("serial")
    paths = {}
    for family, checkpoint in checkpoints.items():
        paths[family] = folder / f"{family}.png"
        assert main(generate_args(checkpoint, paths[family])) == 0
    return paths


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_cap_that_fits_gives_the_uncapped_image(family, checkpoints, serial_png, tmp_path, capfd):
    out = tmp_path / "capped.png"
    stdout = generate(generate_args(checkpoints[family], out, "--max-gpu-memory", "64GiB"), capfd)
    assert table_row(stdout, "text encoder placement") in RESIDENT  # auto keeps the encoders resident when they fit
    assert np.array_equal(pixels(out), pixels(serial_png[family]))


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_cap_that_does_not_fit_is_refused_with_the_numbers(family, checkpoints, tmp_path, capfd):
    out = tmp_path / "x.png"
    code, _, err = run_cli(generate_args(checkpoints[family], out, "--max-gpu-memory", "1MiB"), capfd)
    line = assert_one_line_error(code, err, "does not fit", "needs", "GiB")
    assert not out.exists()
    # The numbers must tell the user something: what the plan needs, printed above the cap it was refused under.
    cap = float(re.search(r"--max-gpu-memory ([0-9.]+) GiB", line).group(1))
    need = float(re.search(r"needs ([0-9.]+) GiB", line).group(1))
    assert need > cap, f"the refusal prints a need of {need} GiB that is not above the cap of {cap} GiB: {line}"


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_text_encoder_gives_the_resident_image(family, checkpoints, tmp_path, capfd):
    paths = {placement: tmp_path / f"{placement}.png" for placement in ("gpu", "offload")}
    for placement, out in paths.items():
        stdout = generate(generate_args(checkpoints[family], out, "--text-encoder-placement", placement), capfd)
        assert table_row(stdout, "text encoder placement") in (RESIDENT if placement == "gpu" else {placement})
    # Streaming the weights in while encoding changes where they live, not the arithmetic: bit-identical images.
    assert np.array_equal(pixels(paths["gpu"]), pixels(paths["offload"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_text_encoder_without_fp8_execution_is_refused(family, checkpoints, tmp_path, capfd):
    out = tmp_path / "x.png"
    code, _, err = run_cli(generate_args(checkpoints[family], out, "--text-encoder-placement", "fp8"), capfd)
    assert_one_line_error(code, err, "--quantize fp8")
    assert not out.exists()


# Plans whose image must equal the one-process image (within one 8-bit level of rounding): the flags, and the plan
# the closing table and --verify-serial name: CFG and Ring together in one group of 4; tensor parallelism alone, as
# the one exact plan that reads slices of the checkpoint's safetensors.
EXACT_PLANS = {
    "cfg-ring": (("--gpus", "4", "--cfg-parallel", "--ring", "2"), "cfg 2 x ring 2"),
    "tensor": (("--gpus", "2", "--tensor", "2"), "tensor 2"),
}

# The lossy options in one group of 4: PipeFusion's second (patched) step reads the other patch's K/V one step stale,
# and the Ulysses all-to-alls inside each stage travel as FP8. Bounds on the 8-bit level difference from the
# one-process image (largest, mean) per family, ~25% above what these folders measure (CPU, fp32, 2 steps, torch
# 2.13): flux2 34 / 4.6, qwen_image 4 / 0.34, sd3 17 / 1.6, zimage 54 / 9.6. The random tiny models amplify FP8's
# rounding (e4m3 keeps 3 mantissa bits) through every block, the stale K/V are from sigma 1.0 for a step to 0.5, and
# Z-Image's band 0 is one image row beside its padded text (docs/benchmarks.md). For scale: seed 4 instead of 3
# moves the one-process image by a mean of 24, 2.7, 11 and 43 levels.
LOSSY_FLAGS = (
    "--gpus",
    "4",
    "--pipefusion",
    "2",
    "--patches",
    "2",
    "--warmup-steps",
    "1",
    "--ulysses",
    "2",
    "--comm-dtype",
    "fp8",
)
LOSSY_PLAN = "pipefusion 2 x ulysses 2 (2 patches after 1 warm-up step) (fp8 transport)"
LOSSY_BOUNDS = {"flux2": (42, 5.8), "qwen_image": (5, 0.45), "sd3": (21, 2.0), "zimage": (68, 12.0)}

# The verdict's wording ("equals" for an exact match) is all the exact plans are held to here.
VERIFY_LINE = re.compile(
    r"^(.+?) (?:image|video) (.+?) the 1-process (?:image|video): max diff \S+ on \[0, 1\], (\d+) 8-bit level"
)


def verify_serial_line(stdout: str) -> tuple[str, str, int]:
    """The plan, the verdict and the 8-bit levels ``--verify-serial`` printed."""
    found = [match for match in map(VERIFY_LINE.match, stdout.splitlines()) if match]
    assert len(found) == 1, stdout
    plan, verdict, levels = found[0].groups()
    return plan, verdict, int(levels)


@pytest.mark.parametrize("plan", EXACT_PLANS)
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_plan_equals_the_one_process_image(family, plan, checkpoints, serial_png, tmp_path, capfd):
    flags, described = EXACT_PLANS[plan]
    out = tmp_path / "parallel.png"
    stdout = generate(generate_args(checkpoints[family], out, *flags, "--verify-serial"), capfd)
    assert table_row(stdout, "parallel plan") == described
    assert verify_serial_line(stdout)[:2] == (described, "equals")
    assert level_diff(out, serial_png[family]).max() <= 1


@pytest.mark.parametrize("family", FAMILIES)
def test_lossy_plan_stays_within_its_measured_bound(family, checkpoints, serial_png, tmp_path, capfd):
    max_levels, mean_levels = LOSSY_BOUNDS[family]
    out = tmp_path / "parallel.png"
    # The exit code is --verify-serial's verdict against the CLI's own tolerance for lossy plans; this test holds the
    # image to the bound measured above instead.
    _, stdout, _ = run_cli(generate_args(checkpoints[family], out, *LOSSY_FLAGS, "--verify-serial"), capfd)
    reported_plan, _, reported_levels = verify_serial_line(stdout)
    assert reported_plan == LOSSY_PLAN
    diff = level_diff(out, serial_png[family])
    print(f"{family}: max {diff.max()} / mean {diff.mean():.2f} 8-bit levels from one process")
    assert reported_levels == diff.max()  # the report is about the image written
    assert diff.max() <= max_levels and diff.mean() <= mean_levels


def test_cfg_parallel_on_a_distilled_model_is_refused(tmp_path, capfd):
    folder = cached(build_klein_checkpoint, 0, True, HEADS)  # distilled
    out = tmp_path / "x.png"
    code, _, err = run_cli(generate_args(folder, out, "--gpus", "2", "--cfg-parallel"), capfd)
    assert_one_line_error(code, err, "cfg parallel", "classifier-free guidance")
    assert not out.exists()


def quantize(folder: Path, fp8_folder: Path, capfd) -> Path:
    """``paradit quantize`` of ``folder``: the FP8 folder, checked to declare its FP8 linears."""
    code, _, err = run_cli(["quantize", "--model", str(folder), "--out", str(fp8_folder)], capfd)
    assert code == 0, err
    config = json.loads((fp8_folder / "transformer" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "paradit-fp8"
    assert len(config["quantization_config"]["modules"]) > 0
    return fp8_folder


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_folder_is_refused_on_the_cpu(family, checkpoints, tmp_path, capfd):
    out = tmp_path / "x.png"
    args = generate_args(quantize(checkpoints[family], tmp_path / "fp8", capfd), out)
    code, _, err = run_cli([*args, "--quantize", "fp8"], capfd)
    assert_one_line_error(code, err, "FP8", "GPU")
    code, _, err = run_cli(args, capfd)
    assert_one_line_error(code, err, "FP8 transformer", "--quantize fp8")
    assert not out.exists()


def test_fp8_checkpoint_refusal_on_the_cpu_does_not_advise_the_other_refusal(checkpoints, tmp_path, capfd):
    """An FP8 folder cannot run on the CPU at all: advice to drop --quantize fp8 leads to the refusal that asks for
    it, round in a circle."""
    args = generate_args(quantize(checkpoints["flux2"], tmp_path / "fp8", capfd), tmp_path / "x.png")
    code, _, err = run_cli([*args, "--quantize", "fp8"], capfd)
    line = assert_one_line_error(code, err, "FP8")
    assert "run without --quantize fp8" not in line, f"that advice is refused too: {line}"


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_zimage_turbo_folder_takes_guidance_as_diffusers_does(guidance, tmp_path, capfd):
    """diffusers' ZImagePipeline takes ``guidance_scale`` for any checkpoint (true CFG above 0), Turbo's included:
    paradit must not refuse a request that diffusers' pipeline accepts for the same checkpoint, and must give the
    same image."""
    folder = cached(build_zimage_checkpoint, 0, True)  # turbo
    reference = ZImagePipeline.from_pretrained(folder, dtype=torch.float32)
    expected = reference(
        prompt=PROMPT,
        height=32,
        width=48,
        num_inference_steps=2,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="pil",
    ).images[0]
    out = tmp_path / "guided.png"
    generate(generate_args(folder, out, "--guidance", str(guidance)), capfd)
    assert np.abs(pixels(out) - np.asarray(expected, dtype=np.int16)).max() <= 1
