"""paradit.weights: strict safetensors loading, shard discovery, hub resolution and dummy initialisation."""

from __future__ import annotations

import json

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import errors as hf_errors
from safetensors.torch import save_file
from torch import nn

from benchmarks.common import init_dummy_weights
from paradit import Engine, GenerationRequest
from paradit.checkpoint import INDEX_FILE, SINGLE_FILE, resolve_checkpoint, safetensors_files
from paradit.errors import CheckpointError
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.families.flux2.presets import FLUX2_TINY_TRANSFORMER
from paradit.weights import CheckpointTensors, ModelNames, materialize
from tests.checkpoints import load_module_weights

CPU = torch.device("cpu")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))


def meta_tiny() -> Tiny:
    with torch.device("meta"):
        return Tiny()


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "proj.weight": torch.randn(3, 4, generator=gen),
        "proj.bias": torch.randn(3, generator=gen),
        "norm.weight": 1 + torch.randn(3, generator=gen),
        "norm.bias": torch.randn(3, generator=gen),
        "scale": torch.rand(3, generator=gen),
        "step": torch.tensor(41, dtype=torch.long),
    }


def write(path, tensors: dict[str, torch.Tensor]):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_load_fills_every_tensor_in_requested_dtype(tmp_path, dtype):
    state = tiny_state()
    # Two shards, as a sharded checkpoint would be.
    first = write(tmp_path / "a.safetensors", {k: state[k] for k in ("proj.weight", "proj.bias", "step")})
    second = write(tmp_path / "b.safetensors", {k: state[k] for k in ("norm.weight", "norm.bias", "scale")})
    module = meta_tiny()
    load_module_weights(module, [first, second], CPU, dtype)
    loaded = dict(module.state_dict())
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert tensor.device == CPU, name
        if name == "step":
            assert tensor.dtype == torch.long  # integers are not cast to the float dtype
            assert tensor.item() == 41
        else:
            assert tensor.dtype == dtype, name
            assert torch.equal(tensor, state[name].to(dtype)), name
    assert not any(p.requires_grad for p in module.parameters())
    out = module.norm(module.proj(torch.ones(2, 4, dtype=dtype)))
    assert out.shape == (2, 3) and torch.isfinite(out).all()


def test_missing_key_is_named(tmp_path):
    state = tiny_state()
    del state["norm.bias"]
    file = write(tmp_path / "m.safetensors", state)
    with pytest.raises(CheckpointError, match=r"missing keys norm\.bias") as info:
        load_module_weights(meta_tiny(), [file], CPU, torch.float32)
    assert "unexpected" not in str(info.value)


def test_unexpected_key_is_named(tmp_path):
    state = tiny_state()
    state["head.weight"] = torch.zeros(2, 2)
    file = write(tmp_path / "m.safetensors", state)
    with pytest.raises(CheckpointError, match=r"unexpected keys head\.weight") as info:
        load_module_weights(meta_tiny(), [file], CPU, torch.float32)
    assert "missing" not in str(info.value)


def test_missing_and_unexpected_keys_are_both_named(tmp_path):
    state = tiny_state()
    state["proj.weight_renamed"] = state.pop("proj.weight")
    file = write(tmp_path / "m.safetensors", state)
    with pytest.raises(CheckpointError) as info:
        load_module_weights(meta_tiny(), [file], CPU, torch.float32)
    message = str(info.value)
    assert "missing keys proj.weight" in message
    assert "unexpected keys proj.weight_renamed" in message


def test_shape_mismatch_is_named(tmp_path):
    state = tiny_state()
    state["proj.weight"] = torch.zeros(3, 5)
    file = write(tmp_path / "m.safetensors", state)
    with pytest.raises(CheckpointError, match=r"proj\.weight") as info:
        load_module_weights(meta_tiny(), [file], CPU, torch.float32)
    message = str(info.value)
    assert "(3, 5)" in message and "(3, 4)" in message


def test_tensors_the_parallel_runtime_dropped_are_neither_read_nor_missing(tmp_path):
    state = tiny_state()
    for saved in (state, {k: v for k, v in state.items() if not k.startswith("norm.")}):
        module = meta_tiny()
        names = ModelNames(module)  # taken before the runtime prunes the model, as the loader does
        module.norm = nn.Identity()  # what PipeFusion does to another stage's blocks
        source = CheckpointTensors([write(tmp_path / "m.safetensors", saved)], CPU, torch.float32)
        materialize(module, names, source)  # norm.* neither missing when absent nor unexpected when present
        source.close()
        assert torch.equal(module.proj.weight, state["proj.weight"])


def test_safetensors_files_reads_shards_from_index(klein_checkpoint):
    component = klein_checkpoint / "transformer"
    index = json.loads((component / INDEX_FILE).read_text())
    files = safetensors_files(component)
    assert len(files) > 1
    assert files == sorted(component / name for name in set(index["weight_map"].values()))
    assert all(f.is_file() for f in files)
    # Every shard on disk is listed, and the single-file name is not.
    assert set(files) == set(component.glob("diffusion_pytorch_model-*.safetensors"))
    assert component / SINGLE_FILE not in files


def test_safetensors_files_falls_back_to_single_file(tmp_path):
    component = tmp_path / "vae"
    component.mkdir()
    single = write(component / SINGLE_FILE, tiny_state())
    assert safetensors_files(component) == [single]
    module = meta_tiny()
    load_module_weights(module, safetensors_files(component), CPU, torch.float32)
    assert torch.equal(module.scale, tiny_state()["scale"])


def test_safetensors_files_without_weights_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=SINGLE_FILE):
        safetensors_files(tmp_path)


def offline_hub(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # huggingface_hub reads both variables once, at import (already done by diffusers), so set what it read too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))


def test_resolve_hub_id_offline_names_hf_hub_offline(monkeypatch, tmp_path):
    offline_hub(monkeypatch, tmp_path)
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint("org/name")
    message = str(info.value)
    assert "HF_HUB_OFFLINE" in message
    assert "org/name" in message


@pytest.mark.parametrize("error_cls", [hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError])
def test_resolve_unknown_or_gated_hub_id_is_checkpoint_error(monkeypatch, error_cls):
    # What the hub's downloads raise online for a misspelt repo, or a gated one (FLUX.2-dev) without a token.
    def refuse(repo_id, *args, **kwargs):
        error = error_cls.__new__(error_cls)  # skip __init__, which wants a live HTTP response
        Exception.__init__(error, f"401 Client Error: repository {repo_id} is gated or does not exist")
        raise error

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(CheckpointError, match="org/name"):
        resolve_checkpoint("org/name")


def test_resolve_checkpoint_local_folder(klein_checkpoint, tmp_path):
    assert resolve_checkpoint(str(klein_checkpoint)) == klein_checkpoint
    with pytest.raises(CheckpointError, match="model_index.json"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint("./no/such")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_dummy_weights_finite_in_dtype_with_unit_norms(dtype):
    with torch.device("meta"):
        model = Flux2Transformer(Flux2Config.from_dict(FLUX2_TINY_TRANSFORMER))
    init_dummy_weights(model, CPU, dtype, seed=3)
    norm_weights = {
        f"{name}.weight"
        for name, sub in model.named_modules()
        if isinstance(sub, (nn.LayerNorm, nn.RMSNorm)) and sub.weight is not None
    }
    assert len(norm_weights) == 12  # q/k RMSNorms; the LayerNorms of the tiny preset are not affine
    for name, param in model.named_parameters():
        assert param.device == CPU and not param.is_meta, name
        assert param.dtype == dtype, name
        assert torch.isfinite(param).all(), name
        assert not param.requires_grad, name
        if name in norm_weights:
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif param.ndim >= 2:
            assert param.float().std() > 0, name
            # std 1/sqrt(fan_in), so deep stacks stay bounded.
            assert param.float().std().item() == pytest.approx(param[0].numel() ** -0.5, rel=0.25), name

    with torch.device("meta"):
        again = Flux2Transformer(Flux2Config.from_dict(FLUX2_TINY_TRANSFORMER))
    init_dummy_weights(again, CPU, dtype, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_init_dummy_weights_on_plain_module():
    module = meta_tiny()
    init_dummy_weights(module, CPU, torch.float16)
    assert module.proj.weight.dtype == torch.float16 and torch.isfinite(module.proj.weight).all()
    assert torch.equal(module.norm.weight, torch.ones(3, dtype=torch.float16))
    assert torch.equal(module.norm.bias, torch.zeros(3, dtype=torch.float16))
    assert torch.equal(module.proj.bias, torch.zeros(3, dtype=torch.float16))


def test_tiny_engine_with_dummy_weights_gives_real_pixels():
    engine = Engine("flux2-tiny", device="cpu")
    assert engine.dtype == torch.float32
    result = engine.generate(GenerationRequest(prompt="a lighthouse", height=32, width=32, steps=2, seed=0))
    pixels = result.pixels
    assert pixels.shape == (1, 3, 32, 32)
    assert pixels.dtype == torch.float32
    assert torch.isfinite(pixels).all()
    assert pixels.min() >= 0 and pixels.max() <= 1
    assert pixels.std() > 0.01
    assert pixels.unique().numel() > 10
    assert result.seed == 0
    assert result.images[0].size == (32, 32)
