"""The one attention entry point every model calls, ``self.attend(q, k, v)``, which the parallel runtime swaps from
outside. Tensors are (batch, sequence, heads, head_dim), as the projections produce them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paradit.layers.rotary import rotate_qk
from paradit.request_hooks import RequestHook


def accumulation_precision(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or kept in float64: softmax sums and Ring's merges in a half dtype lose the digits
    that make a split equal one process, and casting float64 down would lose them for a float64 run."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class AttentionFn(Protocol):
    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def sdpa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``key_mask`` (batch, k_len), False for padding, is the only mask taken: unlike a (q, k) mask, the
    sequence-parallel runtime can split it with the keys."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask)
    return out.transpose(1, 2)


def joint_key_mask(txt_mask: torch.Tensor | None, img: torch.Tensor, text_first: bool) -> torch.Tensor | None:
    # Built once per forward: the parallel runtime gathers it once per tensor it sees.
    if txt_mask is None:
        return None
    image_keys = txt_mask.new_ones(img.shape[:2])
    return torch.cat([txt_mask, image_keys] if text_first else [image_keys, txt_mask], dim=1)


class AttentionDispatch(torch.nn.Module):
    """``sequence_streams``: the token streams attended over, in concatenation order (None: all, order unsaid;
    empty: keys whole on every rank), for each rank's tokens and PipeFusion's K/V buffer."""

    def __init__(self, sequence_streams: tuple[str, ...] | None = None) -> None:
        super().__init__()
        # ``kernel`` attends whole keys on this device; ``attention_fn`` is what the parallel runtime wraps it in.
        self.kernel: AttentionFn = sdpa_attention
        self.attention_fn: AttentionFn = sdpa_attention
        self.sequence_streams = sequence_streams

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.attention_fn(query, key, value, key_mask)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        self.attention_fn = fn


# Keys below which FP8 attention does not pay. On the H200 (docs/benchmarks.md, issue 28) the kernel runs at 0.61-0.82x
# cuDNN's bf16 speed at 4,352-4,608 keys (1024²), 0.70x at 8,192, 1.11x at 16,384 and 1.32x at 27,280 (TI2V-5B).
FP8_MIN_KEYS = 16384


class FP8Attention(RequestHook):
    """``--attention fp8``, except the first and last ``exact_steps`` of a request and calls over fewer than
    ``FP8_MIN_KEYS`` keys. Compiled blocks keep a graph for each value of ``fp8_now``, which they guard on."""

    def __init__(self, exact_steps: int = 0) -> None:
        from paradit.layers.fp8_attention import fp8_attention_with_lse  # imports Triton: only runs that use it

        self.fp8_kernel = fp8_attention_with_lse
        self.exact_steps, self.fp8_now = exact_steps, True

    def at_step(self, done: int, steps: int) -> None:
        self.fp8_now = self.exact_steps <= done < steps - self.exact_steps

    def uses_fp8(self, key: torch.Tensor) -> bool:
        # The crossover is a GPU's; Triton's interpreter on the CPU (the tests) runs every call through the kernel.
        return self.fp8_now and (key.shape[1] >= FP8_MIN_KEYS or not key.is_cuda)

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.uses_fp8(key):
            return self.fp8_kernel(query, key, value, key_mask)[0]
        return sdpa_attention(query, key, value, key_mask)

    def with_lse(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uses_fp8(key):
            return self.fp8_kernel(query, key, value, key_mask)
        return attention_with_lse(query, key, value, key_mask)


def apply_fp8_attention(model: nn.Module, exact_steps: int) -> FP8Attention:
    """Before parallelism wraps it; cross-attention to the text (a few hundred keys) stays on SDPA."""
    kernel = FP8Attention(exact_steps)
    for module in model.modules():
        if isinstance(module, AttentionDispatch) and module.sequence_streams != ():
            module.kernel = module.attention_fn = kernel
    return kernel


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """With each query's log-sum-exp (batch, heads, q_len) in float32, by which Ring merges blocks. A query whose
    keys here are all masked gets output 0 and lse -inf: nothing when merged. ``key_mask``: (batch, k_len), or a
    (batch or 1, 1, q_len, k_len) mask per query (a tile of a cached prefix's block-causal mask)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cuda, half = q.device.type == "cuda", q.dtype in (torch.float16, torch.bfloat16)
    # cuDNN's attention is the fastest on recent NVIDIA GPUs and SDPA picks it there; ROCm builds have none.
    cudnn = cuda and half and torch.version.hip is None and torch.backends.cudnn.is_available()
    if key_mask is not None:
        out, lse = _masked_attention_with_lse(q, k, v, key_mask)
    elif cudnn and torch.cuda.get_device_capability() >= (9, 0):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    elif cuda and half:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    elif cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    elif q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
    else:
        out, lse = _masked_attention_with_lse(q, k, v, None)
    # Kernels pad or reshape the lse differently ((B, H, L, 1), or L rounded up to 32); keep (B, H, L).
    lse = lse.reshape(*q.shape[:2], -1)[..., : q.shape[2]]
    return out.transpose(1, 2), accumulation_precision(lse)


def _masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, L, D) layout. On CUDA the memory-efficient kernel takes the mask as a bias; elsewhere, exact scores."""
    if key_mask is not None and key_mask.ndim == 2:
        key_mask = key_mask[:, None, None, :]
    if q.device.type == "cuda" and key_mask is not None:
        # The kernel wants the bias's row stride a multiple of 8: its rows are allocated padded, the keys a view.
        keys = key_mask.shape[-1]
        padded = torch.zeros(*key_mask.shape[:-1], -(-keys // 8) * 8, dtype=q.dtype, device=q.device)
        bias = padded[..., :keys].masked_fill_(~key_mask, float("-inf")).expand(*q.shape[:3], keys)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
        lse = lse[..., : q.shape[2]]  # the kernel rounds the query length up to 32
    else:
        scores = (accumulation_precision(q) @ accumulation_precision(k).transpose(-1, -2)) * q.shape[-1] ** -0.5
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask, float("-inf"))
        lse = scores.logsumexp(dim=-1)
        out = (torch.softmax(scores, dim=-1) @ accumulation_precision(v)).to(q.dtype)
    empty = torch.isinf(lse) & (lse < 0)
    return out.masked_fill(empty[..., None], 0.0), lse


class QKVAttention(AttentionDispatch):
    """``norm_q``/``norm_k`` act per head, or over all heads with ``across_heads`` (Wan). Called: self-attention."""

    def __init__(
        self,
        dim: int,
        head_dim: int,
        qk_norm: Callable[[int], nn.Module],
        bias: bool = True,
        across_heads: bool = False,
        sequence_streams: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(sequence_streams)
        self.head_dim, self.across_heads = head_dim, across_heads
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.norm_q = qk_norm(dim if across_heads else head_dim)
        self.norm_k = qk_norm(dim if across_heads else head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=bias)])

    def project(self, x: torch.Tensor, linear: nn.Module, norm: nn.Module | None = None) -> torch.Tensor:
        """Heads are counted from the width, so a tensor-parallel shard that holds some needs no change here."""
        if norm is not None and self.across_heads:
            return norm(linear(x)).unflatten(-1, (-1, self.head_dim))
        x = linear(x).unflatten(-1, (-1, self.head_dim))
        return x if norm is None else norm(x)

    def qkv(self, x: torch.Tensor, context: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        context = x if context is None else context
        q = self.project(x, self.to_q, self.norm_q)
        return q, self.project(context, self.to_k, self.norm_k), self.project(context, self.to_v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x)
        if rope is not None:
            q, k = rotate_qk(q, k, rope)
        return self.to_out[0](self.attend(q, k, v).flatten(2).to(q.dtype))


class JointAttention(QKVAttention):
    """MMDiT joint text-image attention; ``context_pre_only`` (SD3's last block): no text output, no ``to_add_out``."""

    def __init__(
        self,
        dim: int,
        head_dim: int,
        qk_norm: Callable[[int], nn.Module],
        bias: bool = True,
        text_first: bool = True,
        context_pre_only: bool = False,
    ) -> None:
        streams = ("txt", "img") if text_first else ("img", "txt")
        super().__init__(dim, head_dim, qk_norm, bias, sequence_streams=streams)
        # The tensor plans of FLUX.2 and Qwen-Image divide ``heads`` by the degree (their local_attributes).
        self.heads, self.text_first = dim // head_dim, text_first
        self.add_q_proj = nn.Linear(dim, dim, bias=bias)
        self.add_k_proj = nn.Linear(dim, dim, bias=bias)
        self.add_v_proj = nn.Linear(dim, dim, bias=bias)
        self.norm_added_q = qk_norm(head_dim)
        self.norm_added_k = qk_norm(head_dim)
        self.to_add_out = None if context_pre_only else nn.Linear(dim, dim, bias=bias)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``rope`` and ``key_mask`` follow the joint order."""
        q_img, k_img, v_img = self.qkv(img)
        q_txt = self.project(txt, self.add_q_proj, self.norm_added_q)
        k_txt = self.project(txt, self.add_k_proj, self.norm_added_k)
        v_txt = self.project(txt, self.add_v_proj)
        pairs = ((q_txt, q_img), (k_txt, k_img), (v_txt, v_img))
        q, k, v = (torch.cat(pair if self.text_first else pair[::-1], dim=1) for pair in pairs)
        if rope is not None:
            q, k = rotate_qk(q, k, rope)
        out = self.attend(q, k, v, key_mask).flatten(2).to(q.dtype)
        sizes = [txt.shape[1], img.shape[1]]
        txt_out, img_out = out.split(sizes, dim=1) if self.text_first else out.split(sizes[::-1], dim=1)[::-1]
        return self.to_out[0](img_out), None if self.to_add_out is None else self.to_add_out(txt_out)
