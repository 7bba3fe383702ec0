"""Building blocks shared by the model families: the attention entry point and the attention modules on it, rotary
tables, embeddings, feed-forwards, modulation and its norms, the staged-transformer base and config base.

Plain single-device math; must not import torch.distributed.
"""
