"""Step caching: skip the blocks of a denoise step whose result barely changes, as diffusers' FirstBlockCache, MagCache
and TaylorSeer (lite) hooks decide it, each guidance branch of each request on its own (as ``cache_context``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paradit.request import StepCacheConfig
from paradit.request_hooks import Denoise, RequestHook

if TYPE_CHECKING:
    from paradit.parallel.cfg import BatchedBranches, SplitBranches

Streams = dict[str, torch.Tensor]
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over the group's ranks


@dataclasses.dataclass
class CacheRecord:
    """What a request's caching did, per model call: whether each guidance branch of each request (global order:
    [conditional parts; unconditional parts]) had its blocks skipped; MagCache's calibration curve, a ratio a call."""

    skipped: list[tuple[bool, ...]] = dataclasses.field(default_factory=list)
    blocks_skipped: int = 0
    mag_ratios: list[float] = dataclasses.field(default_factory=list)

    @property
    def skipped_steps(self) -> int:
        return sum(all(call) for call in self.skipped)


class StepCaching(RequestHook):
    """Each request's guidance branches are groups of their own; experts keep caches of their own, one record."""

    def __init__(self, models: list[nn.Module], reduce: Reduce, branches: BatchedBranches | SplitBranches) -> None:
        self.caches = [StepCache(model, reduce) for model in models]
        self.branches = branches

    def begin_denoise(self, denoise: Denoise) -> None:
        config = denoise.request.cache
        if config is None:
            for cache in self.caches:
                cache.model.stack_runner = None
            return
        parts = torch.tensor([part.batch for part in denoise.requests])
        rows = torch.repeat_interleave(torch.arange(len(denoise.requests)), parts).to(denoise.latents.device)
        groups = len(denoise.requests)
        if denoise.guided:
            rows = self.branches.local(torch.cat([rows, rows + groups]))
            groups *= 2
        record = denoise.features["step_cache"] = CacheRecord()
        for cache in self.caches:
            cache.begin(config, len(denoise.timesteps), rows, groups, record)


class StepCache:
    """Hands the model's own ``run_blocks`` a slice of each block list, so each family joins its lists its own way."""

    def __init__(self, model: nn.Module, reduce: Reduce) -> None:
        self.model, self.reduce = model, reduce
        self.run_all, self.head_all = model.run_blocks, model.head
        self.lists = {name: getattr(model, name) for name in model.BLOCK_LISTS}
        sizes = [len(blocks) for blocks in self.lists.values()]
        # diffusers hooks the stacks it names "blocks", "layers" and the like; Z-Image's refiners run before them.
        self.first = sum(sizes[: model.BLOCK_LISTS.index(getattr(model, "CACHED_FROM", model.BLOCK_LISTS[0]))])
        self.count = sum(sizes)
        self.slices: dict[tuple[int, int], dict[str, nn.ModuleList]] = {}

    def begin(
        self, config: StepCacheConfig, steps: int, row_groups: torch.Tensor, groups: int, record: CacheRecord
    ) -> None:
        """``row_groups``: each of this rank's rows' global branch-and-request index, of ``groups``."""
        self.steps, self.row_groups, self.groups, self.record = steps, row_groups, groups, record
        self.model.stack_runner = METHODS[config.method](config, self).run_stack

    def run_range(self, tokens, start: int, stop: int):
        if start >= stop:
            return tokens
        if (start, stop) not in self.slices:
            offset, cut = 0, {}
            for name, blocks in self.lists.items():
                cut[name] = blocks[max(0, start - offset) : max(0, stop - offset)]
                offset += len(blocks)
            self.slices[start, stop] = cut
        modules = self.model._modules  # assigned directly: the lists are put back as they were, not re-registered
        try:
            modules.update(self.slices[start, stop])
            return self.run_all(tokens)
        finally:
            modules.update(self.lists)

    def streams(self, tokens) -> Streams:
        own = [name for name, (stream, _) in type(tokens).SEQUENCE_FIELDS.items() if name == stream]
        return {name: getattr(tokens, name) for name in own if getattr(tokens, name) is not None}

    def statistic_streams(self, tokens) -> Streams:
        """What diffusers' hook reads as the head block's hidden states: the output stream, or ``CACHE_STREAMS``."""
        names = getattr(self.model, "CACHE_STREAMS", (type(tokens).OUTPUT_STREAM,))
        return {name: getattr(tokens, name) for name in names if getattr(tokens, name, None) is not None}


class FirstBlock:
    """diffusers' FirstBlockCache: the rest runs once the head block's residual moved past ``threshold``."""

    def __init__(self, config: StepCacheConfig, cache: StepCache) -> None:
        self.threshold, self.cache = config.threshold, cache
        self.row_groups, self.groups = cache.row_groups, cache.groups
        self.head_residual: Streams | None = None
        self.tail_residual: Streams = {}

    def row_sums(self, values: Streams) -> torch.Tensor:
        return sum(v.abs().sum(dim=tuple(range(1, v.ndim)), dtype=torch.float32) for v in values.values())

    def decide(self, residual: Streams) -> list[bool]:
        if self.head_residual is None:
            return [True] * self.groups
        sums = torch.zeros(self.groups, 2, device=self.row_groups.device)
        moved = {name: value - self.head_residual[name] for name, value in residual.items()}
        sums[:, 0].index_add_(0, self.row_groups, self.row_sums(moved))
        sums[:, 1].index_add_(0, self.row_groups, self.row_sums(self.head_residual))
        sums = self.cache.reduce(sums)
        return (sums[:, 0] / sums[:, 1] > self.threshold).tolist()

    def run_stack(self, tokens) -> torch.Tensor:
        cache = self.cache
        tokens = cache.run_range(tokens, 0, cache.first)
        before = cache.statistic_streams(tokens)
        tokens = cache.run_range(tokens, cache.first, cache.first + 1)
        head = cache.streams(tokens)
        residual = {name: head[name] - value for name, value in before.items()}
        computes = self.decide(residual)
        cache.record.skipped.append(tuple(not c for c in computes))
        rows = torch.tensor(computes, device=self.row_groups.device)[self.row_groups]
        if not bool(rows.any()):
            cache.record.blocks_skipped += cache.count - cache.first - 1
            # The streams the last block returns (SD3.5's drops its text): what the head reads is among them.
            cached = {name: residual + head[name] for name, residual in self.tail_residual.items()}
            return cache.head_all(dataclasses.replace(tokens, **cached))
        tokens = cache.run_range(tokens, cache.first + 1, cache.count)
        out = cache.streams(tokens)
        tail = {name: out[name] - head[name] for name in out}
        if not bool(rows.all()):  # some branches skip: their rows take the cached residual, and keep it
            keep = rows[:, None, None]  # every stream is (batch, tokens, channels)
            out = {name: torch.where(keep, value, self.tail_residual[name] + head[name]) for name, value in out.items()}
            tail = {name: torch.where(keep, value, self.tail_residual[name]) for name, value in tail.items()}
            residual = {name: torch.where(keep, value, self.head_residual[name]) for name, value in residual.items()}
        self.tail_residual, self.head_residual = tail, residual
        return cache.head_all(dataclasses.replace(tokens, **out))


class MagCache:
    """diffusers' MagCache: past ``retention_ratio``, steps skip while the ratios' summed error is in ``threshold``."""

    def __init__(self, config: StepCacheConfig, cache: StepCache) -> None:
        self.config, self.cache, self.groups = config, cache, cache.groups
        self.ratios = None if config.calibrate else nearest_interpolation(config.mag_ratios, cache.steps)
        self.retention_step = int(config.retention_ratio * cache.steps + 0.5)
        self.step, self.ratio, self.error, self.skips = 0, 1.0, 0.0, 0
        self.residual: Streams | None = None

    def skips_step(self) -> bool:
        if self.config.calibrate or self.step < self.retention_step:
            return False
        self.ratio *= float(self.ratios[self.step]) if self.step < len(self.ratios) else 1.0
        self.skips += 1
        self.error += abs(1.0 - self.ratio)
        config = self.config
        if self.residual is not None and self.error <= config.threshold and self.skips <= config.max_skip_steps:
            return True
        self.ratio, self.error, self.skips = 1.0, 0.0, 0
        return False

    def run_stack(self, tokens) -> torch.Tensor:
        cache = self.cache
        tokens = cache.run_range(tokens, 0, cache.first)
        before = cache.statistic_streams(tokens)
        skip = self.skips_step()
        self.step += 1
        cache.record.skipped.append((skip,) * self.groups)
        if skip:
            cache.record.blocks_skipped += cache.count - cache.first
            skipped = {name: value + self.residual[name] for name, value in before.items()}
            return cache.head_all(dataclasses.replace(tokens, **skipped))
        tokens = cache.run_range(tokens, cache.first, cache.count)
        residual = {name: value - before[name] for name, value in cache.statistic_streams(tokens).items()}
        if self.config.calibrate:
            cache.record.mag_ratios.append(1.0 if self.residual is None else self.norm_ratio(residual))
        self.residual = residual
        return cache.head_all(tokens)

    def norm_ratio(self, residual: Streams) -> float:
        ratios = [
            (torch.linalg.norm(value.float(), dim=-1) / (torch.linalg.norm(self.residual[name].float(), dim=-1) + 1e-8))
            for name, value in residual.items()
        ]
        count = torch.tensor(float(sum(r.numel() for r in ratios)), device=ratios[0].device)
        sums = self.cache.reduce(torch.stack([sum(r.sum() for r in ratios), count]))
        return float(sums[0] / sums[1])


class TaylorSeer:
    """diffusers' TaylorSeer (lite): the steps between computed ones predicted from their divided differences."""

    def __init__(self, config: StepCacheConfig, cache: StepCache) -> None:
        self.config, self.cache, self.groups = config, cache, cache.groups
        self.step, self.last_update = -1, None
        self.factors: list[torch.Tensor] = []

    def run_stack(self, tokens) -> torch.Tensor:
        config, cache = self.config, self.cache
        self.step += 1
        after = config.disable_cache_after_step
        computes = (
            self.step < config.disable_cache_before_step
            or (self.step - config.disable_cache_before_step - 1) % config.cache_interval == 0
            or (after is not None and self.step >= after)
        )
        cache.record.skipped.append((not computes,) * self.groups)
        if not computes:
            cache.record.blocks_skipped += cache.count
            offset = self.step - self.last_update
            return sum(factor * (offset**order / math.factorial(order)) for order, factor in enumerate(self.factors))
        out = cache.head_all(cache.run_all(tokens))
        factors = [out]
        if self.last_update is not None:  # divided differences against the last computed step's, order by order
            delta = self.step - self.last_update
            for previous in self.factors[: config.max_order]:
                factors.append((factors[-1] - previous) / delta)
        self.factors, self.last_update = factors, self.step
        return out


METHODS: dict[str, Any] = {"first-block": FirstBlock, "mag": MagCache, "taylorseer": TaylorSeer}


def nearest_interpolation(ratios: tuple[float, ...], length: int) -> torch.Tensor:
    """diffusers' ``nearest_interp``."""
    curve = torch.tensor(ratios)
    if length == 1:
        return curve[-1:]
    scale = (len(curve) - 1) / (length - 1)
    return curve[torch.round(torch.arange(length, dtype=torch.float32) * scale).long()]
