"""Published prompt-encoder configs that more than one family reads (for ``--load-format dummy`` and the memory
estimate, which build the encoder without its weights)."""

from __future__ import annotations

QWEN3_COMMON = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}
QWEN3_4B = {**QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36}
QWEN3_8B = {**QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36}
# The text tower of Mistral Small 3.1 24B (Mistral3ForConditionalGeneration); FLUX.2 never shows it an image.
MISTRAL_SMALL_31 = {
    "model_type": "mistral",
    "vocab_size": 131072,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}
