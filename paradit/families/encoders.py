"""Published prompt-encoder configs several families read (random weights and memory estimates build from them)."""

from __future__ import annotations

from paradit.spec import read_configs

CONFIGS = read_configs(__file__, "encoders.json")
QWEN3_COMMON = CONFIGS["qwen3_common"]
QWEN3_4B = {**QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36}
QWEN3_8B = {**QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36}
# The text tower of Mistral Small 3.1 24B (Mistral3ForConditionalGeneration); FLUX.2 never shows it an image.
MISTRAL_SMALL_31 = CONFIGS["mistral_small_31"]
