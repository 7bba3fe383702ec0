"""Attention whose queries see a cached prefix before their own keys: keys and values made once per request (a prompt
and condition images modulated at t = 0) and reused at every step. A model marks such an attention with
``PrefixCaching``; which share of the prefix a rank keeps, and how its queries attend it, the parallel runtime sets
from outside (``paradit/parallel/sequence.py``). Plain single-device code: no ``torch.distributed`` here.

A prefix-caching model runs its prefix by ``encode_prefix``: ``embed_prefix`` (a token state whose ``hidden`` field is
what passes from block to block), ``run_prefix_blocks`` (each block's ``run_prefix``, every attention layer's keys and
values handed to that layer's ``keep_prefix``) and ``cached_prefix`` (what its forward takes). The parallel wrappers
forward ``encode_prefix``, gather sharded weights around ``run_prefix``, and run PipeFusion's stages one after
another on the ``hidden`` states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CachedPrefix:
    """One attention layer's prefix as this rank keeps it: ``key`` and ``value`` (batch, kept tokens, kept heads,
    head_dim); ``key_mask`` (batch, every prefix token) False at padding, None where nothing is padded; ``lengths``:
    the tokens each rank of a ring keeps, in ring order (one entry: kept whole)."""

    key: torch.Tensor
    value: torch.Tensor
    key_mask: torch.Tensor | None
    lengths: tuple[int, ...]


def keep_whole(key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None) -> CachedPrefix:
    return CachedPrefix(key, value, key_mask, (key.shape[1],))


def with_prefix_mask(prefix_mask: torch.Tensor | None, keys: int) -> torch.Tensor | None:
    """The (batch, prefix + ``keys``) key mask of a prefix's padding followed by ``keys`` unpadded keys."""
    if prefix_mask is None:
        return None
    return torch.cat([prefix_mask, prefix_mask.new_ones(prefix_mask.shape[0], keys)], dim=1)


def masked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask)
    return out.transpose(1, 2)


class PrefixAttentionFn(Protocol):
    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: CachedPrefix
    ) -> torch.Tensor: ...


class PrefixCaching:
    """Mixed into an ``AttentionDispatch`` whose queries attend a ``CachedPrefix`` and then their own call's keys,
    which are never padded (the target's tokens)."""

    # What a rank keeps of each layer's prefix, and what attends it (None: the prefix concatenated before the keys,
    # through ``attend``): set per module by the parallel runtime.
    keep_prefix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], CachedPrefix] = staticmethod(keep_whole)
    prefix_attention_fn: PrefixAttentionFn | None = None
    # The prefix's own attention under its (batch or 1, 1, queries, keys) mask, once per request: one masked SDPA
    # call here, the ring's tiles under Ring.
    masked_attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
        staticmethod(masked_sdpa)
    )

    def attend_after(
        self, prefix: CachedPrefix, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        if self.prefix_attention_fn is not None:
            return self.prefix_attention_fn(query, key, value, prefix=prefix)
        key_mask = with_prefix_mask(prefix.key_mask, key.shape[1])
        key, value = torch.cat([prefix.key, key], dim=1), torch.cat([prefix.value, value], dim=1)
        return self.attend(query, key, value, key_mask)
