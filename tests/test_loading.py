"""Loading only what a rank keeps: tensor-parallel slices read straight from the checkpoint (or drawn) equal slicing
after a full load; FP8 conversion while loading equals converting afterwards, one high-precision weight at a time;
FP8 checkpoints (``paradit quantize``) round-trip every tensor and load as FP8 directly."""

from __future__ import annotations

import dataclasses
import json
import weakref

import pytest
import torch
from torch import nn

from paradit import Engine, InvalidRequest
from paradit.checkpoint import INDEX_FILE
from paradit.cli import main
from paradit.errors import CheckpointError
from paradit.families import FAMILIES, PRESETS
from paradit.layers.fp8 import Fp8Linear
from paradit.options import ExecutionOptions
from paradit.parallel import ParallelConfig
from paradit.parallel.comm import CommStats
from paradit.parallel.tensor import RowParallelLinear, parallelize_tensor, tensor_slices
from paradit.quantize import convert_fp8, fp8_checkpoint_layers
from paradit.runtime import load_transformer
from paradit.settings import resolve_model
from paradit.spec import CheckpointFolder, RandomWeights
from paradit.weights import CheckpointTensors, save_component

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass
class OneRankOfTensorGroup:
    """What ``parallelize_tensor`` asks of a ParallelContext, for one rank, without a process group: the slicing is
    all these tests run (the sharded forward is tests/test_tensor_parallel.py's)."""

    rank: int
    degree: int = 2
    stats: CommStats = dataclasses.field(default_factory=CommStats)

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(tensor=self.degree)

    def local_rank(self, dim: str) -> int:
        return self.rank

    def group(self, dim: str) -> None:
        return None


FLUX2 = FAMILIES["flux2"]


def load(spec, context=None, quantize="none", dummy=False, dtype=torch.bfloat16) -> nn.Module:
    """The loader under test: the transformer built, sharded and pruned on meta, then only what is kept read."""
    spec = dataclasses.replace(spec, weights=RandomWeights()) if dummy else spec
    return load_transformer(FLUX2, spec, CPU, dtype, context, ExecutionOptions(quantize=quantize)).model


def load_then_shard(spec, context, quantize="none", dummy=False) -> nn.Module:
    """What paradit did before: the whole model loaded, sliced afterwards, converted to FP8 last."""
    model = load(spec, dummy=dummy)
    if context:
        parallelize_tensor(model, FLUX2.tensor_plan, context)
    if quantize == "fp8":
        convert_fp8(model, E4M3, FLUX2.keep_high_precision)
    return model


def assert_same_tensors(a: nn.Module, b: nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert tensor.dtype == state_b[name].dtype, name
        assert tensor.shape == state_b[name].shape, name
        assert torch.equal(tensor.view(torch.uint8), state_b[name].view(torch.uint8)), name  # bit for bit


@pytest.fixture(scope="module")
def checkpoint_spec(tmp_path_factory):
    """A FLUX.2 transformer with 4 heads (T = 2 divides them) in a sharded diffusers-layout component."""
    from paradit.families.flux2.model import Flux2Config, Flux2Transformer
    from tests.checkpoints import randomize, tiny_transformer_config

    folder = tmp_path_factory.mktemp("tp")
    config = tiny_transformer_config(guidance_embeds=False, heads=4)
    torch.manual_seed(0)
    model = Flux2Transformer(Flux2Config.from_dict(config))
    randomize(model)
    save_component(model.state_dict(), config, folder / "transformer", max_shard_bytes=40_000)
    assert (folder / "transformer" / INDEX_FILE).is_file()
    spec = PRESETS["flux2-tiny"]
    return dataclasses.replace(spec, transformer=config, weights=CheckpointFolder(folder))


@pytest.mark.parametrize("quantize", ["none", "fp8"])
@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
@pytest.mark.parametrize("rank", [None, 0, 1], ids=["whole", "rank 0 of 2", "rank 1 of 2"])
def test_loading_only_the_kept_share_equals_slicing_and_converting_after_a_full_load(
    checkpoint_spec, rank, dummy, quantize
):
    context = None if rank is None else OneRankOfTensorGroup(rank)
    loaded = load(checkpoint_spec, context, quantize, dummy)
    assert_same_tensors(loaded, load_then_shard(checkpoint_spec, context, quantize, dummy))
    fp8 = [m for m in loaded.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == (28 if quantize == "fp8" else 0)  # every block projection, nothing else
    assert not any(t.is_meta for t in loaded.state_dict().values())


def test_a_tensor_parallel_rank_reads_only_its_slices(checkpoint_spec, monkeypatch):
    """Every read of a sharded tensor comes back at the sharded size: the full tensor never leaves the file."""
    reads = {}
    original = CheckpointTensors.read

    def record(self, name, full_shape, cut, dtype):
        tensor = original(self, name, full_shape, cut, dtype)
        reads[name] = (tuple(full_shape), tuple(tensor.shape))
        return tensor

    monkeypatch.setattr(CheckpointTensors, "read", record)
    load(checkpoint_spec, OneRankOfTensorGroup(1))
    q = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"  # packed [q, k, v, gate, up], 4 heads x 16
    assert reads[q] == ((64 * 3 + 2 * 192, 64), (32 * 3 + 2 * 96, 64))
    assert reads["transformer_blocks.0.attn.to_out.0.weight"] == ((64, 64), (64, 32))  # row-parallel: columns
    assert reads["x_embedder.weight"][0] == reads["x_embedder.weight"][1]  # replicated: whole
    with torch.device("meta"):
        sharded = set(tensor_slices(FLUX2.tensor_plan, FLUX2.build_transformer(checkpoint_spec), 2, 1))
    assert {name for name, (full, kept) in reads.items() if full != kept} == sharded & set(reads)


def test_fp8_while_loading_holds_one_high_precision_weight_at_a_time(checkpoint_spec, monkeypatch):
    """Each FP8 layer's bf16 weight is freed before the next tensor is read, so the bf16 model never exists whole:
    at every read, no earlier one is still alive anywhere."""
    reference = load_then_shard(checkpoint_spec, None, "fp8")
    fp8_weights = {f"{name}.weight" for name, m in reference.named_modules() if isinstance(m, Fp8Linear)}
    read: list[weakref.ref] = []
    most_alive = 0
    original = CheckpointTensors.read

    def watch(self, name, full_shape, cut, dtype):
        nonlocal most_alive
        most_alive = max(most_alive, sum(ref() is not None for ref in read))
        tensor = original(self, name, full_shape, cut, dtype)
        if name in fp8_weights:
            assert tensor.dtype == torch.bfloat16
            read.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(CheckpointTensors, "read", watch)
    load(checkpoint_spec, quantize="fp8")
    assert len(read) == len(fp8_weights) == 28
    assert most_alive == 0


@pytest.fixture(scope="module")
def fp8_folder(klein_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "klein-fp8"
    assert main(["quantize", "--model", str(klein_checkpoint), "--out", str(out)]) == 0
    return out


def test_fp8_checkpoint_round_trips_every_tensor(klein_checkpoint, fp8_folder):
    source = resolve_model(str(klein_checkpoint))
    quantized = load(source, quantize="fp8")
    spec = resolve_model(str(fp8_folder))
    layers = fp8_checkpoint_layers(spec.transformer)
    assert layers == [name for name, m in quantized.named_modules() if isinstance(m, Fp8Linear)] and len(layers) == 28
    # quantize "none": an FP8 checkpoint's layers load as FP8 regardless, straight from its bytes.
    loaded = load(spec)
    assert_same_tensors(loaded, quantized)
    # The FP8 weights stand for the source's within e4m3's rounding: 3 mantissa bits (half a step: 2^-4 relative),
    # and half the subnormal step (2^-9 of the scale) near zero.
    reference = load(source, dtype=torch.float32)
    for name in layers:
        fp8, exact = loaded.get_submodule(name), reference.get_submodule(name).weight
        bound = exact.abs() * (2**-4 + 2**-8) + fp8.weight_scale * 2**-10  # 2^-8: the bf16 the FP8 was made from
        assert ((fp8.weight.float() * fp8.weight_scale - exact).abs() <= bound).all(), name
    # The other components are the source's files, linked.
    for component in ("vae", "text_encoder", "tokenizer", "scheduler"):
        assert sorted(p.name for p in (fp8_folder / component).iterdir()) == sorted(
            p.name for p in (klein_checkpoint / component).iterdir()
        )
    assert json.loads((fp8_folder / "model_index.json").read_text()) == json.loads(
        (klein_checkpoint / "model_index.json").read_text()
    )


def test_fp8_checkpoint_shards_for_tensor_parallel_from_its_fp8_bytes(fp8_folder):
    spec = resolve_model(str(fp8_folder))
    whole = load(spec)
    with torch.device("meta"):
        heads = FLUX2.build_transformer(spec).config.num_attention_heads
    assert heads == 3  # the klein fixture's: degree 3 shards it
    context = OneRankOfTensorGroup(rank=2, degree=3)
    sharded = load(spec, context)
    expected = tensor_slices(FLUX2.tensor_plan, whole, 3, 2)
    wrappers = [name for name, m in sharded.named_modules() if isinstance(m, RowParallelLinear)]
    assert len(wrappers) == 10  # to_out.0 and to_add_out, the MLPs' outputs of 2 double blocks; 2 single to_out
    for name, tensor in sharded.state_dict().items():
        key = name
        for wrapper in wrappers:  # a row-parallel linear sits inside its all-reduce wrapper
            key = key.replace(f"{wrapper}.linear.", f"{wrapper}.")
        full = whole.state_dict()[key]
        want = expected[key].take(full) if key in expected else full
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), name


def test_an_fp8_checkpoint_runs_only_as_fp8(fp8_folder):
    with pytest.raises(InvalidRequest, match="holds an FP8 transformer; run it with --quantize fp8"):
        Engine(str(fp8_folder), device="cpu")
    config = json.loads((fp8_folder / "transformer" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    with pytest.raises(CheckpointError, match="quantized with 'bitsandbytes'.*paradit-fp8"):
        fp8_checkpoint_layers(config)


def test_quantize_a_preset_with_random_weights_writes_a_loadable_transformer(tmp_path, capsys):
    out = tmp_path / "tiny-fp8"
    assert main(["quantize", "--model", "flux2-tiny", "--load-format", "dummy", "--out", str(out)]) == 0
    assert "28 FP8 linears" in capsys.readouterr().out
    spec = resolve_model(str(out))
    assert spec.family == "flux2" and spec.folder is None  # the prompt encoder and VAE stay random
    loaded = load(spec)
    assert_same_tensors(loaded, load_then_shard(PRESETS["flux2-tiny"], None, "fp8", dummy=True))
    assert main(["quantize", "--model", "flux2-tiny", "--load-format", "dummy", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
