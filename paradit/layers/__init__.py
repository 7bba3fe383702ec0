"""Building blocks shared by the model families: attention entry point, rotary tables, embeddings, norms.

Plain single-device math; must not import torch.distributed.
"""
