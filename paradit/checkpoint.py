"""Checkpoint folders in the diffusers layout: finding one (a local folder, or a hub id fetched with only the files
the loader reads), reading its JSON, checking its components, listing a component's weight files.

Must not import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from paradit.errors import CheckpointError

MODEL_INDEX = "model_index.json"
# What the loader opens in a component folder: configs and weight indexes (.json), weights (.safetensors), and the
# tokenizers' vocabularies and merges (.txt), SentencePiece models (.model) and chat templates (.jinja).
READ_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")
# Not read even so: files in sub-folders of a component (onnx/, ...), weight variants (``name.fp16.safetensors``,
# ``name.fp16-00001-of-00002.safetensors``, ``name.safetensors.index.fp16.json``) and indexes of pickle weights.
NOT_READ = ["*/*/*", "*.*.safetensors", "*.index.*.json", "*.bin.index.json"]


def listed_components(model_index: dict) -> list[str]:
    """The components ``model_index.json`` lists: not its metadata, nor those the pipeline declares absent."""
    listed = [name for name, entry in model_index.items() if isinstance(entry, list) and None not in entry]
    return [name for name in listed if not name.startswith("_")]


def pipeline_patterns(model_index: dict) -> dict[str, list[str]]:
    """The ``allow_patterns`` and ``ignore_patterns`` (keyword arguments of huggingface_hub's downloads) that select
    the files the loader reads of a pipeline whose ``model_index.json`` is ``model_index``: every component it lists,
    as ``check_components`` expects them."""
    allow = [MODEL_INDEX, *(f"{name}/*{suffix}" for name in listed_components(model_index) for suffix in READ_SUFFIXES)]
    return {"allow_patterns": allow, "ignore_patterns": NOT_READ}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
SINGLE_FILE = "diffusion_pytorch_model.safetensors"


def resolve_checkpoint(model: str) -> Path:
    """A local folder as it is; otherwise a Hugging Face hub id, fetched (or found in the cache) by huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / MODEL_INDEX).is_file():
            raise CheckpointError(f"{path} has no {MODEL_INDEX}; expected a diffusers-layout checkpoint folder")
        return path
    if model.count("/") != 1 or path.exists() or model.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint folder {model!r} does not exist")
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # the files `paradit download` fetches, so that a downloaded checkpoint is complete offline too
        patterns = pipeline_patterns(read_json(Path(hf_hub_download(model, MODEL_INDEX))))
        return Path(snapshot_download(model, **patterns))
    except LocalEntryNotFoundError as exc:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise CheckpointError(f"{model!r} is not a local folder and is not in the hub cache, and {reason}") from exc
    except RepositoryNotFoundError as exc:  # GatedRepoError included
        raise CheckpointError(
            f"hub repository {model!r} does not exist or is gated; accept its licence on the hub and log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from exc


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def check_components(folder: Path, index: dict, allow_pickle: bool) -> None:
    """Every component ``model_index.json`` lists is a folder; none holds only pickle weights, which can run code
    as they load, unless ``allow_pickle``."""
    for name in listed_components(index):
        component = component_dir(folder, name)
        pickles = sorted(p.name for p in component.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles and not allow_pickle and not any(component.glob("*.safetensors")):
            raise CheckpointError(
                f"{component} holds pickle weights ({', '.join(pickles)}), which can run code when loaded; convert "
                "them to safetensors (load and save_pretrained them once: safetensors is its default), or pass "
                "--allow-pickle if you trust their source"
            )


def component_dir(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {folder} has no {name}/ component")
    return path


def safetensors_files(component: Path) -> list[Path]:
    """The shard list from the index when the weights are sharded, else the single file."""
    index = component / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [component / shard for shard in shards]
    single = component / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{component} has neither {INDEX_FILE} nor {SINGLE_FILE}")
