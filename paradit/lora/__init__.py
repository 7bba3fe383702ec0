"""LoRA adapters: read as published (``adapters``), applied to a transformer as it loads (``apply``)."""

from paradit.lora.adapters import MODES, LoraRef, LoraSet, parse_lora

__all__ = ["MODES", "LoraRef", "LoraSet", "parse_lora"]
