"""No pickle by any path, and every damaged checkpoint one line: each component loads from safetensors alone unless
``--allow-pickle``, and then from pickle (``.bin``, whole or sharded) for every component, the transformer included,
through torch's restricted unpickler; a damaged weight index and a worker's checkpoint error are one line, the same
line one process prints."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from paradit.cli import main
from paradit.errors import CheckpointError
from paradit.families import FAMILIES
from paradit.pipelines.base import load_vae
from paradit.runtime import load_transformer
from paradit.settings import resolve_model
from paradit.spec import CheckpointFolder
from paradit.text_encoder import load_prompt_encoder
from paradit.worker import RequestFailed, reportable
from tests.checkpoint_cache import cached, copy_of
from tests.checkpoints import build_klein_checkpoint
from tests.qwen_image_checkpoints import build_qwen_image_checkpoint
from tests.sd3_checkpoints import build_sd3_checkpoint
from tests.test_cli import assert_one_line_error, run_cli
from tests.test_wan import write_wan_checkpoint
from tests.zimage_checkpoints import build_zimage_checkpoint

CPU = torch.device("cpu")
TINY = ["--device", "cpu", "--steps", "1", "--height", "32", "--width", "32", "--no-progress", "--seed", "1"]
BUILDERS = {
    "flux2": (build_klein_checkpoint,),
    "qwen_image": (build_qwen_image_checkpoint,),
    "sd3": (build_sd3_checkpoint,),
    "zimage": (build_zimage_checkpoint,),
    "wan": (write_wan_checkpoint, "t2v"),  # two transformers: the low-noise expert loads from pickle too
}


@pytest.fixture(scope="module")
def klein() -> Path:
    return cached(build_klein_checkpoint)  # read only: each test damages a copy


def pickle_name(name: str) -> str:
    """diffusers' and transformers' pickle name for a safetensors file: ``model*`` becomes ``pytorch_model*``."""
    stem = name.removesuffix(".safetensors")
    return ("pytorch_" if stem.startswith("model") else "") + stem + ".bin"


def to_pickle(component: Path) -> None:
    """A component's safetensors weights rewritten by ``torch.save`` under the names its library gives pickle
    weights, sharded as they were (the index renamed and pointing at the new shards)."""
    for index in component.glob("*.safetensors.index.json"):
        data = json.loads(index.read_text())
        data["weight_map"] = {name: pickle_name(shard) for name, shard in data["weight_map"].items()}
        (component / f"{pickle_name(index.name.removesuffix('.index.json'))}.index.json").write_text(json.dumps(data))
        index.unlink()
    for file in component.glob("*.safetensors"):
        torch.save(load_file(file), component / pickle_name(file.name))
        file.unlink()


def all_to_pickle(folder: Path) -> Path:
    for component in folder.iterdir():
        if component.is_dir():
            to_pickle(component)
    return folder


def generate(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(folder), "--prompt", "a cat", *TINY, "--out", str(out), *extra]


def test_pickle_beside_a_safetensors_file_that_is_not_the_weights_is_refused(klein, tmp_path, capsys):
    """Any ``*.safetensors`` in the folder let the check pass, and diffusers then fell back to the pickle."""
    folder = copy_of(klein, tmp_path / "copy")
    to_pickle(folder / "vae")
    (folder / "vae" / "junk.safetensors").write_bytes(b"")
    argv = generate(folder, tmp_path / "x.png")
    code, _, err = run_cli(argv, capsys)
    line = assert_one_line_error(code, err, "diffusion_pytorch_model.bin", "can run code", "--allow-pickle")
    assert str(folder / "vae") in line
    code, _, err = run_cli([*argv, "--allow-pickle"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_component_whose_safetensors_are_not_its_weights_is_refused_before_anything_loads(
    klein, tmp_path, allow_pickle
):
    folder = copy_of(klein, tmp_path / "copy")
    vae = folder / "vae"
    (vae / "diffusion_pytorch_model.safetensors").rename(vae / "diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(vae))} holds no weights .*model.safetensors"):
        resolve_model(str(folder), allow_pickle=allow_pickle)


@pytest.mark.parametrize("family", BUILDERS)
def test_every_loader_reads_pickle_only_when_allowed(family, tmp_path):
    """Past the folder check (a spec made by hand, an Engine given a ModelSpec), the loaders themselves refuse
    pickle; allowed, every component loads from it, the transformers equal to their safetensors."""
    original = cached(*BUILDERS[family])
    folder = all_to_pickle(copy_of(original, tmp_path / "copy"))
    with pytest.raises(CheckpointError, match="can run code"):
        resolve_model(str(folder))
    spec = resolve_model(str(folder), allow_pickle=True)
    assert spec.weights == CheckpointFolder(folder, allow_pickle=True)
    record = FAMILIES[spec.family]
    unchecked = dataclasses.replace(spec, weights=CheckpointFolder(folder))
    for load in (load_vae, load_prompt_encoder, lambda *args, dummy: load_transformer(*args)):
        with pytest.raises(CheckpointError, match="can run code"):
            load(record, unchecked, CPU, torch.float32, dummy=False)
    load_vae(record, spec, CPU, torch.float32, dummy=False)
    load_prompt_encoder(record, spec, CPU, torch.float32, dummy=False)
    reference = resolve_model(str(original))
    for component in ["transformer", *spec.experts]:
        specs = [dataclasses.replace(s, transformer=s.experts.get(component, s.transformer)) for s in (spec, reference)]
        ours, theirs = (load_transformer(record, s, CPU, torch.float32, component=component).model for s in specs)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        assert all(torch.equal(t, theirs.state_dict()[name]) for name, t in ours.state_dict().items()), component


@pytest.mark.parametrize("layout", ["sharded", "one file"])
def test_allow_pickle_generates_the_same_image_from_pickle_weights(klein, tmp_path, capsys, layout):
    folder = all_to_pickle(copy_of(klein, tmp_path / "copy"))
    transformer = folder / "transformer"
    if layout == "one file":
        shards = sorted(transformer.glob("diffusion_pytorch_model-*.bin"))
        whole = {name: t for shard in shards for name, t in torch.load(shard, weights_only=True).items()}
        torch.save(whole, transformer / "diffusion_pytorch_model.bin")
        for stale in [*shards, transformer / "diffusion_pytorch_model.bin.index.json"]:
            stale.unlink()
    code, _, err = run_cli(generate(folder, tmp_path / "pickle.png"), capsys)
    assert_one_line_error(code, err, "can run code", "--allow-pickle")
    assert run_cli(generate(folder, tmp_path / "pickle.png", "--allow-pickle"), capsys)[0] == 0
    assert run_cli(generate(klein, tmp_path / "safetensors.png"), capsys)[0] == 0
    pixels = [np.asarray(Image.open(tmp_path / name)) for name in ("pickle.png", "safetensors.png")]
    assert np.array_equal(*pixels)


class RunsCode:
    """A pickle that calls ``Path.touch`` when a full unpickler loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_allowed_pickle_goes_through_the_restricted_unpickler(klein, tmp_path, capsys):
    folder = all_to_pickle(copy_of(klein, tmp_path / "copy"))
    marker = tmp_path / "code-ran"
    shard = sorted((folder / "transformer").glob("*.bin"))[0]
    torch.save({"x": RunsCode(marker)}, shard)
    code, _, err = run_cli(generate(folder, tmp_path / "x.png", "--allow-pickle"), capsys)
    line = assert_one_line_error(code, err, str(shard), "not a readable")
    assert "\n" not in line and not marker.exists()


def _transformer_index(folder: Path) -> Path:
    return folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"


@pytest.mark.parametrize(
    "damage",
    [
        lambda index: index.write_text("{not json"),
        lambda index: index.write_text(json.dumps({"metadata": {}})),
        lambda index: index.write_text(json.dumps({"weight_map": ["a.safetensors"]})),
        lambda index: index.write_text(json.dumps({"weight_map": {"a": 3}})),
    ],
    ids=["not JSON", "no weight_map", "weight_map a list", "shard not a name"],
)
@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_a_damaged_weight_index_is_one_line_naming_it(klein, tmp_path, capsys, damage, component):
    folder = copy_of(klein, tmp_path / "copy")
    (index,) = (folder / component).glob("*.index.json")
    damage(index)
    code, _, err = run_cli(generate(folder, tmp_path / "x.png"), capsys)
    assert_one_line_error(code, err, str(index))


def test_a_workers_checkpoint_error_is_the_line_one_process_prints(klein, tmp_path, capfd):
    """The transformer's config says 3 double-stream layers, its weights hold 2: every rank meets it while loading.
    Under workers it was their 25-line traceback."""
    folder = copy_of(klein, tmp_path / "copy")
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 3}))
    lines = []
    for plan in ([], ["--gpus", "2", "--ulysses", "2"]):
        assert main(generate(folder, tmp_path / "x.png", *plan)) == 2
        err = capfd.readouterr().err
        assert_one_line_error(2, err, "does not match the model", "missing keys transformer_blocks.2.")
        lines.append(err)
    assert lines[0] == lines[1]


def test_a_workers_unexpected_error_is_one_line_naming_its_trace_file(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    try:
        raise RuntimeError("the prediction is NaN")
    except RuntimeError as exc:
        error = reportable(exc)
    assert isinstance(error, RequestFailed) and "\n" not in str(error)
    (trace,) = tmp_path.glob("paradit-error-*.log")
    assert str(error) == f"RuntimeError: the prediction is NaN; full trace in {trace}"
    assert "Traceback" in trace.read_text() and "the prediction is NaN" in trace.read_text()


@pytest.mark.parametrize("command", ["generate", "quantize"])
def test_a_model_that_is_no_hub_id_is_one_line(command, capsys, tmp_path):
    """``org/..`` reached huggingface_hub's id check and came back as an internal error with a trace file."""
    extra = ["--prompt", "a"] if command == "generate" else ["--out", str(tmp_path / "fp8")]
    assert main([command, "--model", "org/..", *extra]) == 2
    assert capsys.readouterr().err.startswith("paradit: error: 'org/..' is not a hub id (org/name): ")
