"""Wan 2.1 / 2.2 video transformers (T2V-A14B, I2V-A14B, TI2V-5B)."""
