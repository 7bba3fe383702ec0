"""Checkpoint folders in the diffusers layout; a hub id's is fetched with only the files the loader reads."""

from __future__ import annotations

import json
from pathlib import Path

from paradit.errors import CheckpointError

MODEL_INDEX = "model_index.json"
# A modular pipeline's index (FLUX.3's: diffusers has no other pipeline for it), read where no MODEL_INDEX is.
MODULAR_INDEX = "modular_model_index.json"
# What the loader opens in a component folder (the tokenizers' vocabularies, SentencePiece models and templates too).
READ_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")
# Not read even so: a component's sub-folders (onnx/), weight variants (``name.fp16.safetensors``), pickle indexes.
NOT_READ = ["*/*/*", "*.*.safetensors", "*.index.*.json", "*.bin.index.json"]


def index_file(folder: Path) -> Path:
    """The folder's pipeline index: MODEL_INDEX, else MODULAR_INDEX (whose components read the same way)."""
    modular = folder / MODULAR_INDEX
    return modular if modular.is_file() and not (folder / MODEL_INDEX).is_file() else folder / MODEL_INDEX


def listed_components(model_index: dict) -> list[str]:
    """Not the metadata (``_name``), the components the pipeline declares absent (``[null, null]``), nor a pipeline
    setting that is a list (Qwen-Image 2.1 Turbo's ``sample_sigmas``): a component is a (library, class) pair."""
    listed = [
        name
        for name, entry in model_index.items()
        if isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)
    ]
    return [name for name in listed if not name.startswith("_")]


def pipeline_patterns(model_index: dict) -> dict[str, list[str]]:
    allow = [MODEL_INDEX, *(f"{name}/*{suffix}" for name in listed_components(model_index) for suffix in READ_SUFFIXES)]
    return {"allow_patterns": allow, "ignore_patterns": NOT_READ}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
SINGLE_FILE = "diffusion_pytorch_model.safetensors"
# The weights diffusers' and transformers' loaders read, whole or sharded by ``<name>.index.json``; pickle last.
SAFETENSORS_WEIGHTS = (SINGLE_FILE, "model.safetensors")
PICKLE_WEIGHTS = ("diffusion_pytorch_model.bin", "pytorch_model.bin")


def resolve_checkpoint(model: str, allow_pickle: bool = False) -> Path:
    """A local folder, or a hub id's files the loader reads (``allow_pickle``: pickle weights where none are safe)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not index_file(path).is_file():
            raise CheckpointError(f"{path} has no {MODEL_INDEX}; expected a diffusers-layout checkpoint folder")
        return path
    if model.count("/") != 1 or path.exists() or model.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint folder {model!r} does not exist")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    from paradit.hub import hub_offline, offline_reason, quiet_retries

    cache_only = hub_offline()
    try:  # the files `paradit download` fetches, so that a downloaded checkpoint is complete offline too
        with quiet_retries():
            index = read_json(Path(hf_hub_download(model, MODEL_INDEX, local_files_only=cache_only)))
            folder = Path(snapshot_download(model, **pipeline_patterns(index), local_files_only=cache_only))
            unsafe = allow_pickle and [
                name for name in listed_components(index) if not any((folder / name).glob("*.safetensors"))
            ]
            if unsafe:  # not "*.*.bin": a weight variant (name.fp16.bin)
                wanted = [f"{name}/*{suffix}" for name in unsafe for suffix in (".bin", ".bin.index.json")]
                patterns = dict(allow_patterns=wanted, ignore_patterns=["*/*/*", "*.*.bin"])
                folder = Path(snapshot_download(model, **patterns, local_files_only=cache_only))
        return folder
    except LocalEntryNotFoundError as exc:
        reason = offline_reason() if cache_only else "the hub could not be reached"
        raise CheckpointError(f"{model!r} is not a local folder and is not in the hub cache, and {reason}") from exc
    except HFValidationError as exc:  # a name the hub cannot have, said in the hub's words
        raise CheckpointError(f"{model!r} is not a hub id (org/name): {exc}") from None
    except RepositoryNotFoundError as exc:  # GatedRepoError included
        raise CheckpointError(
            f"hub repository {model!r} does not exist or is gated; accept its licence on the hub "
            "and log in (`hf auth login`) or set HF_TOKEN"
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
    """Every component listed is a folder, and one holding any weights holds those its loader reads (``weights_file``):
    a stray ``*.safetensors`` beside pickle weights does not make them safe."""
    for name in listed_components(index):
        component = component_dir(folder, name)
        if any(path.suffix in (".safetensors", *PICKLE_SUFFIXES) for path in component.iterdir()):
            for file in safetensors_files(component, allow_pickle):
                if file.suffix == ".safetensors":
                    check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """A truncated download refused from its header alone, before anything loads (not after the denoise, for a VAE)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if 8 + length > size:
                raise ValueError("its header is cut short")
            header = json.loads(handle.read(length))
        end = 8 + length + max((e["data_offsets"][1] for n, e in header.items() if n != "__metadata__"), default=0)
        if end > size:
            raise ValueError(f"cut short: its header declares {end:,} bytes, the file has {size:,}")
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); download it again") from None


def component_dir(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {folder} has no {name}/ component")
    return path


def component_config(folder: Path, component: str) -> dict:
    name = "scheduler_config.json" if component == "scheduler" else "config.json"
    return read_json(component_dir(folder, component) / name)


def weights_file(component: Path, allow_pickle: bool = False) -> Path:
    """Where a component's loader reads its weights: the shards' index, else the whole file, of the first name held."""
    names = SAFETENSORS_WEIGHTS + (PICKLE_WEIGHTS if allow_pickle else ())
    held = [file for name in names for file in (component / f"{name}.index.json", component / name) if file.is_file()]
    if held:
        return held[0]
    pickles = sorted(path.name for path in component.glob("*") if path.suffix in PICKLE_SUFFIXES)
    if pickles and not allow_pickle:
        raise CheckpointError(
            f"{component} holds pickle weights ({', '.join(pickles)}), which can run code when "
            "loaded; convert them to safetensors (load and save_pretrained them once: safetensors "
            "is its default), or pass --allow-pickle if you trust their source"
        )
    raise CheckpointError(
        f"{component} holds no weights its loader reads: {' or '.join(names)}, whole or with the "
        ".index.json of its shards"
    )


def safetensors_files(component: Path, allow_pickle: bool = False) -> list[Path]:
    file = weights_file(component, allow_pickle)
    if not file.name.endswith(".index.json"):
        return [file]
    weight_map = read_json(file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{file} has no weight_map of tensor names to the files of its shards")
    return [component / shard for shard in sorted(set(weight_map.values()))]
