"""The one attention entry point every model calls.

Models own an ``Attention``-style module that calls ``self.attend(q, k, v)``; the parallel runtime swaps that
module's ``attend`` for a distributed implementation (Ulysses, Ring, ...) from outside. Tensors are laid out
(batch, sequence, heads, head_dim), the layout the projections produce, so no transpose is spent before the
dispatch decides what it needs.

Must not import torch.distributed.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionFn(Protocol):
    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def sdpa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Full attention through PyTorch SDPA, which picks the fastest kernel the device has (flash, cuDNN, efficient).

    ``mask`` is boolean, broadcastable to (batch, heads, q_len, k_len), True where a key may be attended.
    """
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)


class AttentionDispatch(torch.nn.Module):
    """Mixin-free holder of the swappable attention implementation.

    Attention modules inherit from this and call ``self.attend``; ``set_attention_fn`` is how the runtime replaces it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.attention_fn: AttentionFn = sdpa_attention

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.attention_fn(query, key, value, mask)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        self.attention_fn = fn
