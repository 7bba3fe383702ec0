"""Pipelines, one per model family: prompt encoding, latents, the denoise loop, decoding.

Must not import torch.distributed.
"""
