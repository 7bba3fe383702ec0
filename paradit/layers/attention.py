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


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one K/V block, with the log-sum-exp of each query's scores, (batch, heads, q_len) in float32.

    Ring attention merges blocks by their log-sum-exp. SDPA hides it, so this calls the kernels that expose it
    (flash on CUDA/ROCm half precision, memory-efficient attention for fp32 on CUDA, flash on the CPU), with an
    exact matmul fallback elsewhere.
    """
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and _cudnn_attention_usable():
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
        lse = lse.reshape(q.shape[:3])
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    elif q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = scores.logsumexp(dim=-1)
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    return out.transpose(1, 2), lse.float()


def _cudnn_attention_usable() -> bool:
    """cuDNN's attention is the fastest on recent NVIDIA GPUs and SDPA picks it there; ROCm builds have none."""
    return (
        torch.version.hip is None
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )
