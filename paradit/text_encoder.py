"""Prompt encoding with a transformers decoder, read at chosen hidden layers (FLUX.2's scheme).

Only the decoder layers up to the deepest one read are built and loaded: FLUX.2-dev reads layer 30 of Mistral
Small's 40, so a quarter of the encoder's weights and time are never spent. The final norm is replaced by identity so
that the last kept layer's output is the raw hidden state, exactly what the full model reports for that layer.

Must not import torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from torch import nn

from paradit.offline_tokenizer import build_offline_tokenizer


@dataclass(frozen=True)
class TextEncoderSpec:
    """A transformers decoder and how FLUX.2 reads it: hidden states of ``layers``, concatenated per token."""

    config: dict[str, Any]
    layers: tuple[int, ...]
    prompt_format: Literal["mistral", "qwen3"]
    max_length: int = 512


def _truncate_config(config: transformers.PretrainedConfig, num_layers: int) -> None:
    text_config = config.get_text_config()
    text_config.num_hidden_layers = num_layers
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = text_config.layer_types[:num_layers]


def _decoder_without_final_norm(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.norm = nn.Identity()
    return decoder.eval().requires_grad_(False)


class PromptEncoder:
    """Tokenizer + truncated decoder; ``encode`` returns (batch, max_length, len(layers) * hidden) embeddings."""

    def __init__(self, decoder: nn.Module, tokenizer, spec: TextEncoderSpec) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.spec = spec

    @classmethod
    def from_folder(
        cls, folder: Path, class_name: str, spec: TextEncoderSpec, device: torch.device, dtype: torch.dtype
    ) -> PromptEncoder:
        config = transformers.AutoConfig.from_pretrained(folder / "text_encoder")
        _truncate_config(config, max(spec.layers))
        model_cls = getattr(transformers, class_name)
        verbosity = transformers.logging.get_verbosity()
        # The dropped layers' weights are reported as unexpected keys; that is the point, so keep the log quiet.
        transformers.logging.set_verbosity_error()
        try:
            model = model_cls.from_pretrained(folder / "text_encoder", config=config, dtype=dtype, device_map=device)
        finally:
            transformers.logging.set_verbosity(verbosity)
        tokenizer = transformers.AutoProcessor.from_pretrained(folder / "tokenizer")
        return cls(_decoder_without_final_norm(model), tokenizer, spec)

    @classmethod
    def dummy(cls, spec: TextEncoderSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> PromptEncoder:
        config = transformers.AutoConfig.for_model(**spec.config)
        _truncate_config(config, max(spec.layers))
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = transformers.AutoModel.from_config(config, dtype=dtype)
        return cls(_decoder_without_final_norm(model), build_offline_tokenizer(spec.max_length), spec)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        padding = {"padding": "max_length", "truncation": True, "max_length": self.spec.max_length}
        if self.spec.prompt_format == "mistral":
            conversations = [
                [
                    {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                    {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
                ]
                for prompt in prompts
            ]
            inputs = self.tokenizer.apply_chat_template(
                conversations,
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **padding,
            )
            return inputs["input_ids"], inputs["attention_mask"]
        ids, masks = [], []
        for prompt in prompts:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            inputs = self.tokenizer(text, return_tensors="pt", **padding)
            ids.append(inputs["input_ids"])
            masks.append(inputs["attention_mask"])
        return torch.cat(ids), torch.cat(masks)

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> torch.Tensor:
        input_ids, attention_mask = self.tokenize(prompts)
        device = next(self.decoder.parameters()).device
        output = self.decoder(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            output_hidden_states=True,
            use_cache=False,
        )
        stacked = torch.stack([output.hidden_states[k] for k in self.spec.layers], dim=2)
        return stacked.flatten(2).to(dtype)
