"""What every family's transformer is built on: its config, its stages, the joint models' token state, unpatchify."""

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
        """JSON lists as tuples; keys the model does not read skipped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names})


class HeadsConfig(CheckpointConfig):
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
    """``embed`` (inputs -> token state), ``run_blocks`` and ``head`` (-> prediction), which the runtime calls one by
    one. The token state's ``SEQUENCE_FIELDS`` map each field the runtime may split to (stream, sequence dimension).
    ``stack_runner``, set from outside (a step cache), runs in place of ``run_stack``'s blocks and head."""

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
        return self.proj_out(self.norm_out(tokens.img, tokens.temb))


@dataclasses.dataclass
class JointTokens:
    """The token state of the models that attend over image and text together, with their rotary tables."""

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
    """(B, prod(grid), prod(patch) * C) -> (B, C, grid[0] * patch[0], ...); each token's row holds its patch as
    (*patch, C), as the references' ``proj_out`` lays it out."""
    axes = len(grid)
    x = tokens.reshape(tokens.shape[0], *grid, *patch, -1)
    x = x.permute(0, 2 * axes + 1, *(i for axis in range(1, axes + 1) for i in (axis, axis + axes)))
    return x.reshape(tokens.shape[0], -1, *(n * p for n, p in zip(grid, patch)))
