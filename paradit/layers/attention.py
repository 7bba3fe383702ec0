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
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def _sdpa_mask(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_mask is None else key_mask[:, None, None, :]


def sdpa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Full attention through PyTorch SDPA, which picks the fastest kernel the device has (flash, cuDNN, efficient).

    ``key_mask`` is boolean (batch, k_len), True for keys that may be attended (padding is False). A key mask is
    the only kind of mask the entry point takes: it is what text padding needs, and unlike a full (q, k) mask it
    can be split and gathered along with the keys by the sequence-parallel runtime.
    """
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=_sdpa_mask(key_mask)
    )
    return out.transpose(1, 2)


class AttentionDispatch(torch.nn.Module):
    """Mixin-free holder of the swappable attention implementation.

    Attention modules inherit from this and call ``self.attend``; ``set_attention_fn`` is how the runtime replaces it.
    ``sequence_streams`` names the token streams (fields of the model's token state) this module attends over, in
    the order it concatenates them; None means all of them, in an order left unsaid. A module that attends over the
    image tokens alone, say, sets ``("img",)`` so that the sequence-parallel runtime knows how many tokens each rank
    holds in that call; PipeFusion needs the order too, to place each stream's keys in its K/V buffer.
    """

    def __init__(self, sequence_streams: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.attention_fn: AttentionFn = sdpa_attention
        self.sequence_streams = sequence_streams

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.attention_fn(query, key, value, key_mask)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        self.attention_fn = fn


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one K/V block, with the log-sum-exp of each query's scores, (batch, heads, q_len) in float32.

    Ring attention merges blocks by their log-sum-exp. SDPA hides it, so this calls the kernels that expose it
    (cuDNN or flash on CUDA/ROCm half precision, memory-efficient attention for fp32 or masked blocks on CUDA, flash
    on the CPU), with an exact matmul fallback elsewhere. A query whose keys in this block are all masked gets
    output 0 and log-sum-exp -inf, so it adds nothing when merged.
    """
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    half = q.dtype in (torch.float16, torch.bfloat16)
    if key_mask is not None:
        out, lse = _masked_attention_with_lse(q, k, v, key_mask)
    elif q.device.type == "cuda" and half and _cudnn_attention_usable():
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    elif q.device.type == "cuda" and half:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    elif q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
    else:
        out, lse = _masked_attention_with_lse(q, k, v, None)
    # Kernels pad or reshape the lse differently ((B, H, L, 1), or L rounded up to 32); keep (B, H, L).
    lse = lse.reshape(*q.shape[:2], -1)[..., : q.shape[2]]
    return out.transpose(1, 2), lse.float()


def _masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, L, D) layout. On CUDA the memory-efficient kernel takes the mask as an additive bias; elsewhere the
    scores are formed explicitly (exact, for the CPU and for devices without a kernel that reports the lse)."""
    if q.device.type == "cuda" and key_mask is not None:
        bias = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~key_mask, float("-inf"))
        bias = bias[:, None, None, :].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
        lse = lse[..., : q.shape[2]]  # the kernel rounds the query length up to 32
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        lse = scores.logsumexp(dim=-1)
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    empty = torch.isinf(lse) & (lse < 0)
    return out.masked_fill(empty[..., None], 0.0), lse


def _cudnn_attention_usable() -> bool:
    """cuDNN's attention is the fastest on recent NVIDIA GPUs and SDPA picks it there; ROCm builds have none."""
    return (
        torch.version.hip is None
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )


def joint_qkv(
    module: torch.nn.Module, img: torch.Tensor, txt: torch.Tensor, text_first: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V (batch, text + image, heads, head_dim) of the MMDiT layout FLUX.2, Qwen-Image and SD3 share: each
    stream projected by its own weights (``to_q``/``add_q_proj``, ...), Q and K normalised per head by its own norms
    (``norm_q``/``norm_added_q``, ...), then the two streams concatenated, text first or image first."""
    heads = (-1, module.head_dim)
    q_img = module.norm_q(module.to_q(img).unflatten(-1, heads))
    k_img = module.norm_k(module.to_k(img).unflatten(-1, heads))
    v_img = module.to_v(img).unflatten(-1, heads)
    q_txt = module.norm_added_q(module.add_q_proj(txt).unflatten(-1, heads))
    k_txt = module.norm_added_k(module.add_k_proj(txt).unflatten(-1, heads))
    v_txt = module.add_v_proj(txt).unflatten(-1, heads)
    pairs = ((q_txt, q_img), (k_txt, k_img), (v_txt, v_img))
    return tuple(torch.cat(pair if text_first else pair[::-1], dim=1) for pair in pairs)
