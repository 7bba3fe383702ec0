"""Model families as plain single-device math, one file per family, with diffusers' parameter names.

Must not import torch.distributed.
"""
