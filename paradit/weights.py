"""Weights: diffusers-layout checkpoint folders, hub ids, and random ("dummy") initialisation on the device.

The transformer is built on the meta device and every tensor is read from the memory-mapped safetensors shards
straight into its final device and dtype, one tensor at a time, so the weights never exist twice. Keys must match
the model exactly: a missing or unexpected key is an error that names it.

Must not import torch.distributed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from paradit.errors import CheckpointError

INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
SINGLE_FILE = "diffusion_pytorch_model.safetensors"


def resolve_checkpoint(model: str) -> Path:
    """A local folder as it is; otherwise a Hugging Face hub id, fetched (or found in the cache) by huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise CheckpointError(f"{path} has no model_index.json; expected a diffusers-layout checkpoint folder")
        return path
    if model.count("/") != 1 or path.exists() or model.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint folder {model!r} does not exist")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
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
    return json.loads(path.read_text())


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


def iter_checkpoint_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        # safe_open memory-maps the file; on CUDA it copies each tensor straight from the map to the device.
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def load_module_weights(
    module: nn.Module,
    files: list[Path],
    device: torch.device,
    dtype: torch.dtype,
    keep: Callable[[str], bool] = lambda name: True,
) -> None:
    """Fill a meta-device ``module`` from safetensors ``files``; ``keep`` selects the names this process holds."""
    targets = {name: t for name, t in [*module.named_parameters(), *module.named_buffers()] if keep(name)}
    expected = set(targets)
    seen: set[str] = set()
    unexpected: list[str] = []
    for key, tensor in iter_checkpoint_tensors(files, device):
        if key not in expected:
            if keep(key):
                unexpected.append(key)
            continue
        target = targets[key]
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        _set_tensor(module, key, tensor.to(dtype) if tensor.is_floating_point() else tensor)
        seen.add(key)
    missing = sorted(expected - seen)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_few(sorted(unexpected))}")
        raise CheckpointError(f"checkpoint {files[0].parent} does not match the model: " + "; ".join(parts))


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@torch.no_grad()
def init_dummy_weights(module: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Random weights on ``device`` for a meta-device ``module``, for speed measurements (vLLM's ``dummy`` format).

    Scales keep activations bounded through deep stacks (std 1/sqrt(fan_in) for matrices, 1 for norm weights), so
    timings are not distorted by inf/NaN arithmetic.
    """
    module.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in module.named_parameters():
        param.requires_grad_(False)
        if param.ndim >= 2:
            fan_in = param[0].numel()
            param.normal_(0.0, fan_in**-0.5, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
    for buffer in module.buffers():
        buffer.zero_()
