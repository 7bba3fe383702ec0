"""LoRA adapters as published: read from a file, a folder or the hub, converted to diffusers' keys by diffusers' own
loader for the family (kohya, ComfyUI, musubi, ai-toolkit layouts), checked against the model, and reduced to each
linear's low-rank factors with the scale the file states."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paradit.errors import InvalidRequest
from paradit.lora.refs import LoraRef

# The metadata diffusers' ``save_lora_weights`` writes into the safetensors header: the LoraConfig, keys prefixed by
# the component (``transformer.r``, ``transformer.lora_alpha``, ...).
METADATA_KEY = "lora_adapter_metadata"
# A converted state dict's keys after the module's name: LoRA's (PEFT's) and LoKr's (whole or factored).
FACTOR_KEYS = r"lora_A\.weight|lora_B\.weight|lora_B\.bias|lokr_w[12](?:_[ab])?"


@dataclass(frozen=True)
class LowRank:
    """One linear's update ``scale * up @ down`` (``up_bias`` added to its bias): ``down`` is PEFT's ``lora_A``
    (rank x in), ``up`` its ``lora_B`` (out x rank); ``scale`` folds the file's alpha over rank with the asked one."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float
    up_bias: torch.Tensor | None = None

    def delta(self, device: torch.device) -> torch.Tensor:
        """The weight's update in float32, computed on ``device``."""
        return (self.up.to(device, torch.float32) @ self.down.to(device, torch.float32)) * self.scale


def adapter_file(ref: LoraRef) -> Path:
    """The adapter's safetensors file; a pickle is refused (loading one can run code)."""
    path = Path(ref.source).expanduser()
    if path.is_dir():
        candidates = [path / ref.weight_name] if ref.weight_name else sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "no .safetensors file"
            raise InvalidRequest(f"--lora {ref.source}: name the adapter file with --lora-weight-name (found {found})")
        path = candidates[0]
    elif not path.exists():  # a hub id, ``owner/name``, or ``owner/name/path/in/it.safetensors``
        parts = ref.source.split("/")
        if path.is_absolute() or len(parts) < 2 or (len(parts) > 2 and path.suffix != ".safetensors"):
            raise InvalidRequest(f"--lora {ref.source}: no such file, folder or hub repository")
        repo, inside = "/".join(parts[:2]), "/".join(parts[2:])
        path = _from_hub(repo, inside or ref.weight_name or "pytorch_lora_weights.safetensors")
    if path.suffix != ".safetensors":
        raise InvalidRequest(f"--lora {path}: only .safetensors adapters load (a pickle {path.suffix} can run code)")
    if not path.is_file():
        raise InvalidRequest(f"--lora {path}: no such file")
    return path


def _from_hub(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, filename))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise InvalidRequest(f"--lora {repo}/{filename}: not found on the hub ({str(exc).splitlines()[0]})") from None


def read_adapter(ref: LoraRef, loader: type, linears: dict[str, tuple[int, int]], component: str) -> dict[str, LowRank]:
    """The adapter's update of each linear (diffusers' module names) of a model whose linears' (out, in) shapes are
    ``linears``; keys are converted by ``loader`` (the family's diffusers LoRA loader mixin). Anything that would not
    apply as diffusers applies it is refused with the keys at fault."""
    path = adapter_file(ref)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = handle.metadata() or {}
            state = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise InvalidRequest(f"--lora {path} is not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    if not state:
        raise InvalidRequest(f"--lora {path} holds no tensors")
    try:
        converted = loader.lora_state_dict(state)
    except (KeyError, ValueError, RuntimeError, IndexError) as exc:
        raise InvalidRequest(f"--lora {path}: its keys are not a LoRA of this model ({exc})") from None
    config = _config(header.get(METADATA_KEY))
    return _factors(path, ref.scale, converted, config, linears, component)


def _config(raw: str | None) -> dict:
    """The transformer's LoraConfig from the header, unprefixed (empty: alpha equals rank, diffusers' default)."""
    if not raw:
        return {}
    prefix = "transformer."
    return {key.removeprefix(prefix): value for key, value in json.loads(raw).items() if key.startswith(prefix)}


def _factors(
    path: Path, user_scale: float, state: dict, config: dict, linears: dict[str, tuple[int, int]], component: str
) -> dict[str, LowRank | Kronecker]:
    def refuse(why: str, keys: list[str]) -> InvalidRequest:
        shown = ", ".join(sorted(keys)[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        return InvalidRequest(f"--lora {path}: {why}: {shown}")

    if dora := [key for key in state if "lora_magnitude_vector" in key]:
        raise refuse("DoRA adapters are not applied by paradit", dora)
    if encoder := [key for key in state if key.startswith(("text_encoder", "te_", "lora_te"))]:
        raise refuse("text-encoder LoRA keys are not applied by paradit (only the transformer's)", encoder)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    stray = []
    for key, tensor in state.items():
        match = re.fullmatch(rf"transformer\.(.+)\.({FACTOR_KEYS})", key)
        if match is None:
            stray.append(key)
            continue
        modules.setdefault(match[1], {})[match[2]] = tensor
    if stray:
        raise refuse("keys that are not LoRA factors of the transformer", stray)
    if unknown := [name for name in modules if name not in linears]:
        raise refuse(f"keys for modules the {component} does not have (an adapter for another model?)", unknown)
    factors = {}
    for name, parts in modules.items():
        if any(part.startswith("lokr_") for part in parts):
            factors[name] = _kronecker(name, parts, user_scale, config, linears[name], refuse)
            continue
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            raise refuse("a module needs both lora_A and lora_B", [name])
        down, up, bias = parts["lora_A.weight"], parts["lora_B.weight"], parts.get("lora_B.bias")
        out_features, in_features = linears[name]
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
            raise refuse(f"ranks that do not match (lora_A {tuple(down.shape)}, lora_B {tuple(up.shape)})", [name])
        if down.shape[1] != in_features or up.shape[0] != out_features:
            raise refuse(
                f"factors of {tuple(up.shape)} x {tuple(down.shape)} for a {out_features} x {in_features} linear",
                [name],
            )
        tensors = [t for t in (down, up, bias) if t is not None]
        if not all(t.is_floating_point() and torch.isfinite(t).all() for t in tensors):
            raise refuse("factors with NaN or infinite values", [name])
        factors[name] = LowRank(down, up, user_scale * _alpha_over_rank(name, down.shape[0], config), bias)
    return factors


@dataclass(frozen=True)
class Kronecker:
    """A LoKr update ``scale * kron(left, right)`` of one linear (fused only: it has no low-rank side path)."""

    left: torch.Tensor
    right: torch.Tensor
    scale: float
    up_bias: None = None

    def delta(self, device: torch.device) -> torch.Tensor:
        return torch.kron(self.left.to(device, torch.float32), self.right.to(device, torch.float32)) * self.scale


def _kronecker(name: str, parts: dict, user_scale: float, config: dict, shape: tuple[int, int], refuse) -> Kronecker:
    """PEFT's LoKr, as diffusers loads it: each Kronecker factor whole (``lokr_w1``) or as a product (``_a @ _b``),
    alpha already baked into the left factor by diffusers' converter, so scale 1 unless the file's config says
    ``alpha / r``."""

    def factor(which: str) -> torch.Tensor:
        whole, a, b = (parts.get(f"lokr_{which}{suffix}") for suffix in ("", "_a", "_b"))
        if whole is not None:
            return whole
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise refuse(f"a LoKr factor {which} needs lokr_{which} or matching lokr_{which}_a and _b", [name])
        return a @ b

    left, right = factor("w1"), factor("w2")
    if (left.shape[0] * right.shape[0], left.shape[1] * right.shape[1]) != tuple(shape):
        raise refuse(
            f"Kronecker factors {tuple(left.shape)} and {tuple(right.shape)} for a {shape[0]} x {shape[1]} linear",
            [name],
        )
    if not all(t.is_floating_point() and torch.isfinite(t).all() for t in (left, right)):
        raise refuse("factors with NaN or infinite values", [name])
    scale = 1.0
    if config:
        rank = _by_pattern(name, config.get("rank_pattern") or {}, config.get("r", 1))
        scale = _by_pattern(name, config.get("alpha_pattern") or {}, config.get("alpha", rank)) / rank
    return Kronecker(left, right, user_scale * scale)


def _alpha_over_rank(module: str, rank: int, config: dict) -> float:
    """PEFT's scaling: ``lora_alpha / r`` (over ``sqrt(r)`` with rsLoRA), a pattern's value where one matches the
    module's name; without a config the rank itself is alpha (scale 1), as diffusers loads such files."""
    if not config:
        return 1.0
    rank = _by_pattern(module, config.get("rank_pattern") or {}, config.get("r", rank))
    alpha = _by_pattern(module, config.get("alpha_pattern") or {}, config.get("lora_alpha", rank))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _by_pattern(module: str, patterns: dict, default: float) -> float:
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default
