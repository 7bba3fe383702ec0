"""What every family's transformer is built on: its config (from the checkpoint's ``transformer/config.json``), the
three stages the parallel runtime can act between, the token state of the joint text-image models, and the inverse
of the patch embedding.

Must not import torch.distributed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

import torch
from torch import nn


class CheckpointConfig:
    """Base of the families' frozen config dataclasses, whose fields are the keyword arguments of the diffusers
    class they mirror."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        """The fields ``config`` sets, JSON lists as tuples; keys the model does not read (``_class_name``, the
        diffusers version, options the math here does not need) are passed over."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names})


class HeadsConfig(CheckpointConfig):
    """A config with diffusers' usual width fields: ``num_attention_heads`` of ``attention_head_dim`` channels,
    ``in_channels`` and ``out_channels`` (None: as many as in)."""

    num_attention_heads: int
    attention_head_dim: int
    in_channels: int
    out_channels: int | None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels


class StagedTransformer(nn.Module):
    """``embed`` (the model's inputs -> its token state), ``run_blocks`` (token state -> token state, through
    whichever blocks the ``BLOCK_LISTS`` stacks hold, in that order: PipeFusion leaves each stage only its own) and
    ``head`` (token state -> prediction). The runtime calls the stages one by one; ``forward`` runs them in a row
    and takes ``embed``'s arguments.

    The token state is a dataclass whose ``SEQUENCE_FIELDS`` map each field the runtime may split along the
    sequence to (the token stream it belongs to, its sequence dimension); the prediction comes from its
    ``OUTPUT_STREAM``. The other fields stay whole on every rank."""

    BLOCK_LISTS: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(*args, **kwargs)))

    def head(self, tokens: Any) -> torch.Tensor:
        """The AdaLN-modulated output projection of the image tokens, where the model has no head of its own."""
        return self.proj_out(self.norm_out(tokens.img, tokens.temb))


@dataclasses.dataclass
class JointTokens:
    """The token state of the models that attend over image and text together: the ``img`` and ``txt`` streams
    (batch, tokens, dim) and their rotary (cos, sin) tables, split along with them, a row per token."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "img": ("img", 1), "txt": ("txt", 1), "img_rope": ("img", 0), "txt_rope": ("txt", 0),
    }  # fmt: skip
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor
    txt: torch.Tensor
    img_rope: tuple[torch.Tensor, torch.Tensor]
    txt_rope: tuple[torch.Tensor, torch.Tensor]


def unpatchify(tokens: torch.Tensor, grid: tuple[int, ...], patch: tuple[int, ...]) -> torch.Tensor:
    """(B, prod(grid), prod(patch) * C) -> (B, C, grid[0] * patch[0], grid[1] * patch[1], ...). Each token's row
    holds its patch as (*patch, C), channels last, as the references' ``proj_out`` lays it out."""
    axes = len(grid)
    x = tokens.reshape(tokens.shape[0], *grid, *patch, -1)
    x = x.permute(0, 2 * axes + 1, *(i for axis in range(1, axes + 1) for i in (axis, axis + axes)))
    return x.reshape(tokens.shape[0], -1, *(n * p for n, p in zip(grid, patch)))
