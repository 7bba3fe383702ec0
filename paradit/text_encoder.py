"""Prompt encoding by a transformers decoder built up to the deepest layer read; its placements: gpu, fp8 or offload."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import transformers
from accelerate import cpu_offload, init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from paradit.layers.fp8 import Fp8Linear, fp8_dtype
from paradit.offline_tokenizer import build_offline_tokenizer
from paradit.quantize import converts_to_fp8
from paradit.spec import CheckpointFolder, TextEncoderSpec
from paradit.weights import DummyTensors

logger = logging.getLogger(__name__)
# Host copies are packed into buffers of at least this size: fewer, larger page-locked allocations.
_MIN_HOST_BUFFER = 2**28


def warn_if_truncated(tokenizer, texts: list[str], limit: int, reader: str = "the text encoder") -> None:
    """Warn, as diffusers does, when one of ``texts`` (templates applied) is longer than ``reader`` reads."""
    longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"])
    if longest > limit:
        message = "a prompt is %d tokens long and %s reads %d: its last %d tokens are dropped"
        logger.warning(message, longest, reader, limit, longest - limit)


def weights_device(placement: str, device: torch.device) -> torch.device:
    """Where a prompt encoder's weights load: host memory when streamed or converted on the way."""
    return device if placement == "gpu" else torch.device("cpu")


def random_encoder(build, placement: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """``build()`` with ``DummyTensors`` weights, each drawn on ``device`` and moved where ``placement`` loads weights:
    transformers' init draws ~40M values/s a thread on the host (minutes for FLUX.2-dev's 17B encoder)."""
    if device.type == "meta":  # the memory plan counts tensors: built on meta, transformers initialises nothing
        with init_empty_weights(), torch.device("meta"):
            return build().eval().requires_grad_(False)
    with init_empty_weights():  # parameters on the meta device, buffers real
        model = build()
    target = weights_device(placement, device)
    source = DummyTensors(device, dtype, buffers=set(), seed=seed)
    drawn: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in drawn:
            value = source.read(name, tuple(param.shape), None, dtype).to(target)
            drawn[id(param)] = nn.Parameter(value, requires_grad=False)
        owner_name, _, leaf = name.rpartition(".")
        model.get_submodule(owner_name)._parameters[leaf] = drawn[id(param)]
    return model.to(target).eval().requires_grad_(False)


def stream_weights(module: nn.Module, device: torch.device) -> nn.Module:
    """Weights in host memory, copied to ``device`` for each submodule's forward by ``cpu_offload``'s hooks."""
    # Moved one at a time (the peak stays near one encoder) into a few large buffers, page-locked on CUDA: PyTorch's
    # pinned allocator rounds each allocation up to a power of two, tensor by tensor up to twice the encoder's size.
    pin = device.type == "cuda"
    params = dict(module.named_parameters(remove_duplicate=False))
    size = max(_MIN_HOST_BUFFER, 1 << (max(p.nbytes for p in params.values()) - 1).bit_length())
    moved: dict[str, torch.Tensor] = {}
    by_storage: dict[int, torch.Tensor] = {}
    buffer, used = None, size
    for name in list(params):
        param = params.pop(name)
        if param.data_ptr() not in by_storage:
            if buffer is None or used + param.nbytes > size:
                buffer, used = torch.empty(size, dtype=torch.uint8, pin_memory=pin), 0
            copy = buffer[used : used + param.nbytes].view(param.dtype).view(param.shape)
            by_storage[param.data_ptr()] = copy.copy_(param.detach())
            used += -(-param.nbytes // 64) * 64  # each tensor starts 64-byte aligned, whatever its dtype
        moved[name] = by_storage[param.data_ptr()]
        set_module_tensor_to_device(module, name, "meta")
    return cpu_offload(module, execution_device=device, state_dict=moved)


@torch.no_grad()
def place(module: nn.Module, placement: str, device: torch.device) -> nn.Module:
    """Under ``fp8``, each linear is converted as it arrives on ``device``: never whole there in the run dtype."""
    if placement == "offload":
        return stream_weights(module, device)
    if placement == "fp8":
        dtype = fp8_dtype(device)
        for name, child in list(module.named_modules()):
            if converts_to_fp8(module, name, child):
                module.set_submodule(name, Fp8Linear.from_linear(child.to(device), dtype))
        return module.to(device)
    return module


def _truncated(config: transformers.PretrainedConfig, num_layers: int) -> transformers.PretrainedConfig:
    text_config = config.get_text_config()
    text_config.num_hidden_layers = num_layers
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = text_config.layer_types[:num_layers]
    return config


def _placed_decoder(model: nn.Module, placement: str, device: torch.device) -> nn.Module:
    """Without its final norm, so that the last kept layer gives the raw hidden state the full model reports there."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.norm = nn.Identity()
    return place(decoder.eval().requires_grad_(False), placement, device)


class PromptEncoder(Protocol):
    """``encode``: the family's prompt embeddings, in its own structure; ``modules``: what memory plans count."""

    def encode(self, prompts: list[str], dtype: torch.dtype) -> Any: ...

    def modules(self) -> list[nn.Module]: ...


def load_prompt_encoder(
    family, spec, device: torch.device, dtype: torch.dtype, dummy: bool, placement: str = "gpu"
) -> PromptEncoder:
    """Read from ``spec.weights``, or random (``dummy``; on the meta device for memory estimates)."""
    encoder = family.prompt_encoder(spec)
    if dummy:
        return encoder.dummy(spec.text_encoder, device, dtype, placement)
    return encoder.from_folder(spec.weights, spec.text_encoder, device, dtype, placement)


class DecoderPromptEncoder:
    """Tokenizer + truncated decoder on ``device``; ``encode`` gives (batch, max_length, len(layers) * hidden)."""

    thinking = False  # the chat template's enable_thinking (off: an empty think block follows the generation prompt)
    templated = True  # whether prompts go through the chat template (else they are read as they are)

    def __init__(self, decoder: nn.Module, tokenizer, spec: TextEncoderSpec, device: torch.device) -> None:
        self.decoder, self.tokenizer, self.spec, self.device = decoder, tokenizer, spec, device

    def modules(self) -> list[nn.Module]:
        return [self.decoder]

    @classmethod
    def from_folder(
        cls, weights: CheckpointFolder, spec: TextEncoderSpec, device: torch.device, dtype: torch.dtype, placement: str
    ) -> DecoderPromptEncoder:
        config = _truncated(transformers.AutoConfig.from_pretrained(weights.path / "text_encoder"), max(spec.layers))
        model_cls = getattr(transformers, spec.class_name)
        verbosity = transformers.logging.get_verbosity()
        # The dropped layers' weights are reported as unexpected keys; that is the point, so keep the log quiet.
        transformers.logging.set_verbosity_error()
        try:
            model = model_cls.from_pretrained(
                weights.path / "text_encoder",
                config=config,
                dtype=dtype,
                device_map=weights_device(placement, device),
                use_safetensors=weights.use_safetensors("text_encoder"),
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        tokenizer = transformers.AutoProcessor.from_pretrained(weights.path / "tokenizer")
        return cls(_placed_decoder(model, placement, device), tokenizer, spec, device)

    @classmethod
    def dummy(
        cls, spec: TextEncoderSpec, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> DecoderPromptEncoder:
        config = _truncated(transformers.AutoConfig.for_model(**spec.config), max(spec.layers))
        model = random_encoder(
            lambda: transformers.AutoModel.from_config(config, dtype=dtype), placement, device, dtype, seed
        )
        return cls(_placed_decoder(model, placement, device), build_offline_tokenizer(spec.max_length), spec, device)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prompt as one user turn of the chat template (if ``templated``), padded to ``max_length``."""
        template = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": self.thinking}
        texts = prompts
        if self.templated:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], **template) for p in prompts]
        warn_if_truncated(self.tokenizer, texts, self.spec.max_length)
        inputs = self.tokenizer(
            texts, padding="max_length", max_length=self.spec.max_length, truncation=True, return_tensors="pt"
        )
        return inputs["input_ids"], inputs["attention_mask"]

    def hidden_states(self, prompts: list[str]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        input_ids, mask = self.tokenize(prompts)
        mask = mask.to(self.device)
        output = self.decoder(
            input_ids=input_ids.to(self.device), attention_mask=mask, output_hidden_states=True, use_cache=False
        )
        return output.hidden_states, mask

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> torch.Tensor:
        hidden_states, _ = self.hidden_states(prompts)
        return torch.stack([hidden_states[k] for k in self.spec.layers], dim=2).flatten(2).to(dtype)
