"""What the cost model knows of a model: FLOPs and attention shapes, exactly linear in image and text tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinearKind:
    """Inside the repeated blocks (PipeFusion's stages split them), sharded by the tensor plan, converted by FP8."""

    in_blocks: bool
    sharded: bool
    fp8: bool


@dataclass(frozen=True)
class TokenLinear:
    per_image: float
    per_text: float
    fixed: float

    def at(self, image_tokens: float, text_tokens: float) -> float:
        return self.per_image * image_tokens + self.per_text * text_tokens + self.fixed


@dataclass(frozen=True)
class LinearGroup:
    kind: LinearKind
    flops: TokenLinear


@dataclass(frozen=True)
class AttentionGroup:
    """``layers`` attention calls of one shape per forward of one sample."""

    exchanged: bool
    heads: int
    head_dim: int
    layers: int
    query_tokens: TokenLinear
    key_tokens: TokenLinear

    def flops(self, workload: Workload) -> float:
        """Of every call of the group for one sample: QK^T and PV, two multiply-adds a query-key pair a channel."""
        query = self.query_tokens.at(workload.image_tokens, workload.text_tokens)
        key = self.key_tokens.at(workload.image_tokens, workload.text_tokens)
        return 4.0 * self.layers * self.heads * self.head_dim * query * key


@dataclass(frozen=True)
class Workload:
    image_tokens: int
    text_tokens: int


@dataclass(frozen=True)
class ModelFacts:
    """One forward of one sample of ``preset``'s transformer. ``token_side``: pixels per image token side;
    ``frame_stride``: video frames per latent frame (None for images); ``width``: the blocks' activation width."""

    preset: str
    blocks: int
    width: int
    token_side: int
    frame_stride: int | None
    text_tokens: int
    experts: int
    linear: tuple[LinearGroup, ...]
    other_flops: TokenLinear
    prediction_elements: TokenLinear
    all_reduce_elements: TokenLinear
    all_reduce_calls: int
    attention: tuple[AttentionGroup, ...]

    def workload(self, height: int, width: int, frames: int | None) -> Workload:
        latent_frames = 1 if self.frame_stride is None else (frames - 1) // self.frame_stride + 1
        return Workload((height // self.token_side) * (width // self.token_side) * latent_frames, self.text_tokens)

    def step_flops(self, workload: Workload, batch: int) -> float:
        image, text = workload.image_tokens, workload.text_tokens
        flops = sum(group.flops.at(image, text) for group in self.linear) + self.other_flops.at(image, text)
        return (flops + sum(group.flops(workload) for group in self.attention)) * batch

    @classmethod
    def from_json(cls, preset: str, data: dict) -> ModelFacts:
        plain = ("blocks", "width", "token_side", "frame_stride", "text_tokens", "experts", "all_reduce_calls")
        counts = ("other_flops", "prediction_elements", "all_reduce_elements")
        return cls(
            preset=preset,
            **{k: data[k] for k in plain},
            **{k: TokenLinear(**data[k]) for k in counts},
            linear=tuple(LinearGroup(LinearKind(**g["kind"]), TokenLinear(**g["flops"])) for g in data["linear"]),
            attention=tuple(
                AttentionGroup(**{**g, **{k: TokenLinear(**g[k]) for k in ("query_tokens", "key_tokens")}})
                for g in data["attention"]
            ),
        )


def read_facts(path: Path) -> dict[str, ModelFacts]:
    return {name: ModelFacts.from_json(name, facts) for name, facts in json.loads(path.read_text())["models"].items()}
