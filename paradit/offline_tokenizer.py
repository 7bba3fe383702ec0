"""Tokenizers built in memory, so that random weights take a prompt offline: byte-level BPE and chat tokens."""

from __future__ import annotations

import string

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5-VL's image markers, after the bytes (ids 261-264: the tiny Qwen-Image encoders' image_token_id and kin).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def build_offline_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    tokens = [*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet()), *VISION_TOKENS]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([*SPECIAL_TOKENS, *VISION_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def offline_t5_tokenizer() -> transformers.T5Tokenizer:
    """A T5 (unigram) tokenizer of printable ASCII; pad, end and unknown take ids 0, 1 and 2, as in T5's vocabulary."""
    characters = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in characters] + [(c, -4.0) for c in characters]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)
