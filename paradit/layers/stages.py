"""What every family's transformer is built on: its config (``transformer/config.json``), the three stages the parallel
runtime acts between, the joint models' token state, the inverse patch embedding."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Self

import torch
from torch import nn


class CheckpointConfig:
    """Base of the families' frozen configs, whose fields are the diffusers class's keyword arguments."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        """The fields ``config`` sets (JSON lists as tuples), skipping keys the model does not read."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names})


class HeadsConfig(CheckpointConfig):
    """diffusers' width fields: ``num_attention_heads`` x ``attention_head_dim``, ``in_channels``, ``out_channels``."""

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
    """``embed`` (inputs -> token state), ``run_blocks`` (token state -> token state, through whichever blocks the
    ``BLOCK_LISTS`` stacks hold, in order: PipeFusion leaves each stage only its own) and ``head`` (token state ->
    prediction), which the runtime calls one by one; ``forward`` runs them in a row. The token state is a dataclass
    whose ``SEQUENCE_FIELDS`` map each field the runtime may split along the sequence to (its token stream, its sequence
    dimension), the other fields staying whole on every rank; the prediction comes from its ``OUTPUT_STREAM``.

    ``run_stack`` (the blocks, then the head) is the one seam a request's feature takes inside the forward:
    ``stack_runner``, when set from outside (as an attention module's kernel is), runs them in its place on the token
    state this rank holds (a step cache, which skips blocks and calls ``run_blocks`` and ``head`` itself)."""

    BLOCK_LISTS: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.stack_runner: Callable[[Any], torch.Tensor] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.run_stack(self.embed(*args, **kwargs))

    def run_stack(self, tokens: Any) -> torch.Tensor:
        if self.stack_runner is not None:
            return self.stack_runner(tokens)
        return self.head(self.run_blocks(tokens))

    def head(self, tokens: Any) -> torch.Tensor:
        """The AdaLN-modulated output projection of the image tokens, where the model has no head of its own."""
        return self.proj_out(self.norm_out(tokens.img, tokens.temb))


@dataclasses.dataclass
class JointTokens:
    """The token state of the models that attend over image and text together: the ``img`` and ``txt`` streams
    (batch, tokens, dim) and their rotary (cos, sin) tables, split along with them, a row per token."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "img": ("img", 1),
        "txt": ("txt", 1),
        "img_rope": ("img", 0),
        "txt_rope": ("txt", 0),
    }
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
