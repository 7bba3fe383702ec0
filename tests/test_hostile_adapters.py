"""Adapter references, metadata and hub lookups that cannot run are refused before anything loads: exit code 2, one
line naming the flag and the value, in well under the time bound, no trace file, and no hub request for a path
that looks local. On an offline machine a hub id (an adapter's or a model's) is one line at once, without
huggingface_hub's half-minute of retry warnings. Every row is refused at settle time on ``flux2-tiny``'s random
weights, so the table costs milliseconds a row; what paradit accepts beyond diffusers' own files (keys without the
``transformer.`` prefix, per-module alpha tensors) is read as the same factors and scale."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file
from torch import nn

from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.lora import LoraRef, LoraSet
from paradit.lora.apply import check_choice, read_updates
from tests.test_cli import assert_one_line_error, run_cli, tiny_args

TIME_BOUND_S = 5.0
OFFLINE_BOUND_S = 3.0
RANK = 4
ALPHA = 8.0


def tiny_transformer() -> nn.Module:
    with torch.device("meta"):
        return FAMILIES["flux2"].build_transformer(PRESETS["flux2-tiny"])


def factors(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """Random rank-4 factors for every linear, under diffusers' file keys (``transformer.``)."""
    generator, state = torch.Generator().manual_seed(0), {}
    for name, module in transformer.named_modules():
        if isinstance(module, nn.Linear):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=generator)
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=generator)
    return {key: tensor * 0.3 for key, tensor in state.items()}


def with_metadata(config) -> dict[str, str]:
    return {"lora_adapter_metadata": config if isinstance(config, str) else json.dumps(config)}


def alphas(state: dict[str, torch.Tensor], alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key.replace("lora_A.weight", "alpha"): alpha.clone() for key in state if key.endswith("lora_A.weight")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The adapter files of the table, beside each other."""
    folder = tmp_path_factory.mktemp("hostile")
    state = factors(tiny_transformer())
    files = {
        "good": (state, None),
        "nan_alpha": (state, with_metadata({"transformer.r": RANK, "transformer.lora_alpha": float("nan")})),
        "text_alpha": (state, with_metadata({"transformer.r": RANK, "transformer.lora_alpha": "abc"})),
        "not_json": (state, with_metadata("{r: 4")),
        "list_metadata": (state, with_metadata([RANK])),
        "wrong_rank": (state, with_metadata({"transformer.r": 16, "transformer.lora_alpha": ALPHA})),
        "integer": ({key: (tensor * 100).to(torch.int64) for key, tensor in state.items()}, None),
        "nan_alpha_tensor": ({**state, **alphas(state, torch.tensor(float("nan")))}, None),
        "bare": ({key.removeprefix("transformer."): tensor for key, tensor in state.items()}, None),
        "alpha_tensors": ({**state, **alphas(state, torch.tensor(ALPHA))}, None),
        "alpha_metadata": (state, with_metadata({"transformer.r": RANK, "transformer.lora_alpha": ALPHA})),
    }
    for name, (tensors, metadata) in files.items():
        save_file(tensors, str(folder / f"{name}.safetensors"), metadata=metadata)
    return folder


def closed_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on: the hub of a machine without a network
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def offline(folder, tmp_path, monkeypatch) -> list[str]:
    """The table's world: the adapters' folder as the working directory, an unreachable hub with an empty cache, trace
    files kept in ``tmp_path``; returns the hub requests made (huggingface_hub's downloads, by repository)."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    asked: list[str] = []
    download = huggingface_hub.hf_hub_download

    def recorded(repo_id, *args, **kwargs):
        asked.append(repo_id)
        return download(repo_id, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recorded)
    return asked


# name -> (the flags after generate's tiny ones, what the line says, whether the reference looks like the hub's).
CASES = {
    "missing ./file": (("--lora", "./nope.safetensors"), ("--lora ./nope.safetensors: no such file",), False),
    "missing folder/file": (
        ("--lora", "lora/nope.safetensors"),
        ("--lora lora/nope.safetensors: no such", "not looked up on the hub"),
        False,
    ),
    "missing plain name": (("--lora", "nope"), ("--lora nope: no such file or folder",), False),
    "scale not a number": (
        ("--lora", "good.safetensors:abc"),
        ("--lora good.safetensors:abc", "'abc' is not a finite number"),
        False,
    ),
    "scale empty": (("--lora", "good.safetensors:"), ("--lora good.safetensors:", "'' is not a finite number"), False),
    "two scales": (
        ("--lora", "good.safetensors:0.5:2"),
        ("--lora good.safetensors:0.5:2", "more than one ':SCALE'"),
        False,
    ),
    "scale inf": (("--lora", "good.safetensors:inf"), ("'inf' is not a finite number",), False),
    "scale past the dtype": (
        ("--lora", "good.safetensors:1e30"),
        ("at scale 1e+30", "past what float32 carries"),
        False,
    ),
    "second expert's scale": (("--lora-2", "good.safetensors:x"), ("--lora-2 good.safetensors:x", "'x' is not"), False),
    "metadata alpha NaN": (
        ("--lora", "nan_alpha.safetensors"),
        ("transformer.lora_alpha is NaN", "a finite number"),
        False,
    ),
    "metadata alpha text": (("--lora", "text_alpha.safetensors"), ('transformer.lora_alpha is "abc"',), False),
    "metadata not JSON": (("--lora", "not_json.safetensors"), ("lora_adapter_metadata metadata is not JSON",), False),
    "metadata not an object": (("--lora", "list_metadata.safetensors"), ("metadata is a JSON list",), False),
    "metadata rank wrong": (
        ("--lora", "wrong_rank.safetensors"),
        ("a rank of 4 where the metadata's r says 16",),
        False,
    ),
    "integer factors": (("--lora", "integer.safetensors"), ("factors stored as int64, not floating point",), False),
    "alpha tensor NaN": (
        ("--lora", "nan_alpha_tensor.safetensors"),
        ("an alpha of nan; give one finite number",),
        False,
    ),
    "adapter hub id offline": (("--lora", "owner/name"), ("--lora owner/name: not on disk", "is unreachable"), True),
    "adapter hub file offline": (
        ("--lora", "owner/name/sub/x.safetensors"),
        ("sub/x.safetensors of it is not in the hub cache",),
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_adapter_is_one_line_at_once(case, offline, tmp_path, capsys):
    flags, fragments, hub = CASES[case]
    out = tmp_path / "out.png"
    start = time.perf_counter()
    code, _, err = run_cli(tiny_args(out, *flags), capsys)
    elapsed = time.perf_counter() - start
    assert_one_line_error(code, err, *fragments)
    assert elapsed < (OFFLINE_BOUND_S if hub else TIME_BOUND_S), elapsed
    assert not list(tmp_path.glob("paradit-error-*")) and not out.exists()
    assert offline == (["owner/name"] if hub else []), offline


def test_a_model_hub_id_offline_is_one_line_at_once(offline, tmp_path, capsys):
    start = time.perf_counter()
    code, _, err = run_cli(
        ["generate", "--model", "owner/name", "--prompt", "a", "--out", str(tmp_path / "x.png")], capsys
    )
    assert_one_line_error(code, err, "'owner/name' is not a local folder and is not in the hub cache", "unreachable")
    assert time.perf_counter() - start < OFFLINE_BOUND_S
    assert not list(tmp_path.glob("paradit-error-*"))


def updates(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    keyed = read_updates(FAMILIES["flux2"].lora_loader, (LoraRef(str(path)),), tiny_transformer(), "transformer")
    return {name: (update.down, update.up, update.scale) for name, ((_, update),) in keyed.items()}


def test_what_diffusers_files_leave_out_reads_as_the_same_factors_and_scale(folder):
    """Keys without ``transformer.`` (PEFT's state dict as it is) are the transformer's; a per-module ``alpha`` tensor
    (kohya's, which diffusers' FLUX.1 loader reads) scales by alpha over rank as the metadata's lora_alpha does."""
    good, bare = updates(folder / "good.safetensors"), updates(folder / "bare.safetensors")
    assert good.keys() == bare.keys() and all(torch.equal(good[n][1], bare[n][1]) for n in good)
    by_tensor, by_metadata = (
        updates(folder / "alpha_tensors.safetensors"),
        updates(folder / "alpha_metadata.safetensors"),
    )
    assert {update[2] for update in by_tensor.values()} == {update[2] for update in by_metadata.values()} == {2.0}


def test_a_served_adapters_scale_past_what_float32_carries_through_a_layer_is_the_clients_400():
    served = LoraSet(transformer=(LoraRef("a.safetensors", name="style"),), mode="unfused", switchable=True)
    assert check_choice(served, (("style", -1e19),)) == (("style", -1e19),)
    for scale in (1e30, -1e30, float("nan")):
        with pytest.raises(
            InvalidRequest, match=r"LoRA adapter 'style': scale .* is not allowed; give a finite number"
        ):
            check_choice(served, (("style", scale),))
