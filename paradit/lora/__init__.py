"""LoRA adapters: as asked for (``refs``), read as published (``adapters``), applied as weights load (``apply``)."""

from paradit.lora.refs import MODES, LoraRef, LoraSet, parse_adapter

__all__ = ["MODES", "LoraRef", "LoraSet", "parse_adapter"]
