"""LoRA adapters as published (kohya, ComfyUI, musubi, ai-toolkit layouts), read by the family's diffusers loader."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paradit.errors import InvalidRequest
from paradit.hub import hub_offline, offline_reason, quiet_retries
from paradit.lora.refs import LoraRef, locate

# diffusers' ``save_lora_weights`` writes the LoraConfig under METADATA_KEY and prefixes its keys and the transformer's
# tensors' with COMPONENT_PREFIX (``transformer.r``, ...); PEFT's own state dict has no prefix.
METADATA_KEY = "lora_adapter_metadata"
COMPONENT_PREFIX = "transformer."
# LoRA's (PEFT's, with kohya's per-module alpha, which diffusers' FLUX.1 loader keeps) and LoKr's factors.
FACTOR_KEYS = r"lora_A\.weight|lora_B\.weight|lora_B\.bias|alpha|lokr_w[12](?:_[ab])?"


@dataclass(frozen=True)
class LowRank:
    """``scale * up @ down`` (+ ``up_bias``): ``down`` is PEFT's ``lora_A`` (rank x in), ``up`` its ``lora_B``."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float
    up_bias: torch.Tensor | None = None

    def delta(self, device: torch.device) -> torch.Tensor:
        return (self.up.to(device, torch.float32) @ self.down.to(device, torch.float32)) * self.scale

    def reach(self) -> float:
        """A cheap bound on the largest number the update puts in a weight or a side path holds."""
        up, down = self.up.abs().double(), self.down.abs().double()
        update = (up.amax(0) * down.amax(1)).sum().item()
        bias = 0.0 if self.up_bias is None else self.up_bias.abs().max().item()
        return max(abs(self.scale) * max(update, up.max().item(), bias), down.max().item())


def adapter_file(ref: LoraRef) -> Path:
    """The adapter's safetensors file (where it is: ``refs.locate``); a pickle is refused (loading one can run code)."""
    location = locate(ref.source)
    path = location.path
    if location.repo is not None:
        filename = location.filename or ref.weight_name or "pytorch_lora_weights.safetensors"
        path = _from_hub(location.repo, filename)
    elif path.is_dir():
        candidates = [path / ref.weight_name] if ref.weight_name else sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "no .safetensors file"
            raise InvalidRequest(f"--lora {ref.source}: name the adapter file with --lora-weight-name (found {found})")
        path = candidates[0]
    if path.suffix != ".safetensors":
        raise InvalidRequest(f"--lora {path}: only .safetensors adapters load (a pickle {path.suffix} can run code)")
    if not path.is_file():
        raise InvalidRequest(f"--lora {path}: no such file")
    return path


def _from_hub(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache_only = hub_offline()
    try:
        with quiet_retries():
            return Path(hf_hub_download(repo, filename, local_files_only=cache_only))
    except HFValidationError as exc:  # a name the hub cannot have, said in the hub's words
        raise InvalidRequest(f"--lora {repo}: neither a local path nor a hub id (OWNER/NAME): {exc}") from None
    except LocalEntryNotFoundError:
        reason = offline_reason() if cache_only else "the hub could not be reached"
        raise InvalidRequest(
            f"--lora {repo}: not on disk, {filename} of it is not in the hub cache, and {reason}"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise InvalidRequest(f"--lora {repo}: {filename} not found on the hub ({str(exc).splitlines()[0]})") from None


def read_adapter(ref: LoraRef, loader: type, linears: dict[str, tuple[int, int]], component: str) -> dict[str, LowRank]:
    """Each linear's update, keys converted by ``loader``; what diffusers would not apply is refused, naming keys."""
    path = adapter_file(ref)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = handle.metadata() or {}
            state = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise InvalidRequest(f"--lora {path} is not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    if not state:
        raise InvalidRequest(f"--lora {path} holds no tensors")
    config = _config(path, header.get(METADATA_KEY))
    try:
        converted = loader.lora_state_dict(state)
    except (KeyError, ValueError, RuntimeError, IndexError) as exc:
        raise InvalidRequest(f"--lora {path}: its keys are not a LoRA of this model ({exc})") from None
    return _factors(path, ref.scale, converted, config, linears, component)


def _config(path: Path, raw: str | None) -> dict:
    """The header's LoraConfig, unprefixed as diffusers reads it, its numbers checked (empty: alpha equals rank)."""
    if not raw:
        return {}
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"--lora {path}: its {METADATA_KEY} metadata is not JSON ({exc})") from None
    if not isinstance(metadata, dict):
        raise InvalidRequest(
            f"--lora {path}: its {METADATA_KEY} metadata is a JSON {type(metadata).__name__}, not an object of "
            "LoraConfig fields"
        )
    prefix = COMPONENT_PREFIX if any(key.startswith(COMPONENT_PREFIX) for key in metadata) else ""
    config = {key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}

    def refuse(key: str, value, allowed: str) -> InvalidRequest:
        return InvalidRequest(f"--lora {path}: its metadata's {prefix}{key} is {json.dumps(value)}; give {allowed}")

    numbers = [(key, config[key]) for key in ("r", "lora_alpha", "alpha") if key in config]
    for key in ("rank_pattern", "alpha_pattern"):  # each pattern's number keyed ``pattern[module]``
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise refuse(key, patterns, "an object of module patterns and numbers")
        numbers += [(f"{key}[{pattern}]", value) for pattern, value in patterns.items()]
    for key, value in numbers:
        if key == "r" or key.startswith("rank_pattern"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise refuse(key, value, "a positive integer (the rank)")
        elif not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise refuse(key, value, "a finite number (alpha: the update is scaled by alpha / rank)")
    if not isinstance(config.get("use_rslora", False), bool):
        raise refuse("use_rslora", config["use_rslora"], "true or false")
    if config.get("use_dora"):
        raise refuse("use_dora", config["use_dora"], "an adapter without DoRA (paradit does not apply DoRA)")
    return config


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
    # Keys all under ``transformer.`` (diffusers' files) or none (PEFT's state dict saved as it is).
    prefix = re.escape(COMPONENT_PREFIX) if any(key.startswith(COMPONENT_PREFIX) for key in state) else ""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    stray = []
    for key, tensor in state.items():
        if match := re.fullmatch(rf"{prefix}(.+)\.({FACTOR_KEYS})", key):
            modules.setdefault(match[1], {})[match[2]] = tensor
        else:
            stray.append(key)
    if stray:
        raise refuse(
            f"keys that are not LoRA factors of the {component} (MODULE.lora_A.weight, MODULE.lora_B.weight and "
            f"optionally MODULE.alpha, all under {COMPONENT_PREFIX} or none)",
            stray,
        )
    if unknown := [name for name in modules if name not in linears]:
        raise refuse(f"keys for modules the {component} does not have (an adapter for another model?)", unknown)
    factors = {}
    for name, parts in modules.items():
        alpha = parts.pop("alpha", None)
        if any(part.startswith("lokr_") for part in parts):
            if alpha is not None:  # diffusers' LoKr converters bake alpha into the factors; none is left to read
                raise refuse("a per-module alpha beside LoKr factors already converted", [f"{name}.alpha"])
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
        _check_values(name, [t for t in (down, up, bias) if t is not None], refuse)
        rank = down.shape[0]
        if config and (stated := _by_pattern(name, config.get("rank_pattern") or {}, config.get("r", rank))) != rank:
            raise refuse(f"a rank of {rank} where the metadata's r says {stated}", [name])
        if alpha is not None and (alpha.numel() != 1 or not torch.isfinite(alpha).all()):
            shown = alpha.item() if alpha.numel() == 1 else f"a tensor of shape {tuple(alpha.shape)}"
            raise refuse(f"an alpha of {shown}; give one finite number", [f"{name}.alpha"])
        # PEFT's alpha / r (over sqrt(r) with rsLoRA); without alpha or a config, scale 1, as diffusers loads it.
        if alpha is not None:
            alpha = alpha.item()
        elif config:
            alpha = _by_pattern(name, config.get("alpha_pattern") or {}, config.get("lora_alpha", rank))
        scale = 1.0 if alpha is None else alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        factors[name] = LowRank(down, up, user_scale * scale, bias)
    return factors


def _check_values(name: str, tensors: list[torch.Tensor], refuse) -> None:
    """Factors are floating point and finite: integer ones are no LoRA's (and say so, not "NaN")."""
    if integral := [t for t in tensors if not t.is_floating_point()]:
        raise refuse(f"factors stored as {str(integral[0].dtype).removeprefix('torch.')}, not floating point", [name])
    if not all(torch.isfinite(t).all() for t in tensors):
        raise refuse("factors with NaN or infinite values", [name])


@dataclass(frozen=True)
class Kronecker:
    """A LoKr update ``scale * kron(left, right)`` of one linear (fused only: it has no low-rank side path)."""

    left: torch.Tensor
    right: torch.Tensor
    scale: float
    up_bias: None = None

    def delta(self, device: torch.device) -> torch.Tensor:
        return torch.kron(self.left.to(device, torch.float32), self.right.to(device, torch.float32)) * self.scale

    def reach(self) -> float:
        """The largest number the update puts in a weight: a Kronecker product's is its factors' largest, multiplied."""
        return abs(self.scale) * self.left.abs().double().max().item() * self.right.abs().double().max().item()


def _kronecker(name: str, parts: dict, user_scale: float, config: dict, shape: tuple[int, int], refuse) -> Kronecker:
    """PEFT's LoKr as diffusers loads it: alpha baked into the left factor, scaled by a config's alpha / r if any."""

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
    _check_values(name, [left, right], refuse)
    scale = 1.0
    if config:
        rank = _by_pattern(name, config.get("rank_pattern") or {}, config.get("r", 1))
        scale = _by_pattern(name, config.get("alpha_pattern") or {}, config.get("alpha", rank)) / rank
    return Kronecker(left, right, user_scale * scale)


def _by_pattern(module: str, patterns: dict, default: float) -> float:
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default
