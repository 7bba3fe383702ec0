"""``ParallelConfig``: how one request is spread over a group of GPUs, and the check that it can be."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paradit.errors import InvalidRequest
from paradit.flags import GENERATE, PLAN, option, positive

COMM_DTYPES = ("auto", "fp8")
MESH_DIMS = ("cfg", "pipefusion", "ring", "ulysses", "tensor")  # outermost first
PARALLEL = "parallelism (one request across several GPUs or CPU processes)"
# A flag of how one request is spread over the group; a server's groups run the plan generate chooses for their size.
parallel_option = functools.partial(option, commands=(GENERATE, PLAN), group=PARALLEL)


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each strategy, whose product is the group's size. ``comm_dtype`` "fp8" sends Ulysses' and Ring's
    traffic as FP8 with scales. ``pipefusion`` stages run ``warmup_steps`` exact steps, then ``patches`` patches a
    step against stale K/V. ``shard_weights`` N (0: off) keeps 1/N of every block on each of N neighbouring ranks."""

    ulysses: int = parallel_option(1, type=positive, help="Ulysses (all-to-all over heads) degree")
    ring: int = parallel_option(1, type=positive, help="Ring attention degree")
    cfg: int = parallel_option(
        1,
        name="--cfg-parallel",
        action="store_true",
        convert=lambda asked: 2 if asked else None,
        help="guidance branches on the two halves of the group",
    )
    tensor: int = parallel_option(
        1, type=positive, help="tensor parallel degree (weights and heads sharded; fast links)"
    )
    pipefusion: int = parallel_option(1, type=positive, help="pipeline stages over the blocks (least traffic)")
    patches: int = 1
    warmup_steps: int = 1
    comm_dtype: str = "auto"
    shard_weights: int = 0

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.pipefusion * self.tensor

    @property
    def sequence_degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def keeps_sequence_and_stack_whole(self) -> bool:
        """Every rank runs every block over every token, its weights gathered at no step: one GPU, tensor, CFG."""
        return self.sequence_degree == 1 and self.pipefusion == 1 and not self.shard_weights

    @property
    def exact(self) -> bool:
        """Computes what one process does (up to rounding): not with FP8 on the wire, nor PipeFusion's stale K/V."""
        return self.comm_dtype != "fp8" and not (self.pipefusion > 1 and self.patches > 1)

    def describe(self) -> str:
        parts = [f"{name} {degree}" for name, degree in self.degrees() if degree > 1]
        plan = " x ".join(parts) if parts else "1 GPU"
        if self.pipefusion > 1:
            patches = "1 patch" if self.patches == 1 else f"{self.patches} patches"
            warmup = "1 warm-up step" if self.warmup_steps == 1 else f"{self.warmup_steps} warm-up steps"
            plan += f" ({patches} after {warmup})"
        plan += " (fp8 transport)" if self.comm_dtype == "fp8" else ""
        if self.shard_weights:
            plan += f", weights sharded over {self.shard_weights} ({self.shard_dims()})"
        return plan

    def shard_dims(self) -> str:
        """The mesh dimensions ``shard_weights`` spans, innermost first ("ulysses", "cfg x ulysses", "2 of ring 4")."""
        spanned, left = [], self.shard_weights
        for name, degree in reversed(self.degrees()):
            if left == 1:
                break
            if degree > 1:
                spanned.append(name if left % degree == 0 else f"{left} of {name} {degree}")
                left = max(1, left // degree)
        return " x ".join(reversed(spanned)) or "the one GPU"

    def degrees(self) -> tuple[tuple[str, int], ...]:
        return tuple((name, getattr(self, name)) for name in MESH_DIMS)

    def validate(self, gpus: int, has_cfg: bool, heads: int) -> None:
        """Raises InvalidRequest naming the problem and the plans that do work for ``gpus``."""
        for name, degree in self.degrees():
            if degree < 1:
                raise InvalidRequest(f"{name} degree {degree} is not allowed; give 1 or more")
        problem = None
        if self.comm_dtype not in COMM_DTYPES:
            raise InvalidRequest(f"unknown comm dtype {self.comm_dtype!r}; choose one of {', '.join(COMM_DTYPES)}")
        if self.cfg not in (1, 2):
            problem = f"cfg degree {self.cfg} is not allowed (1 or 2: the two guidance branches)"
        elif self.cfg == 2 and not has_cfg:
            problem = "cfg parallel needs a model run with classifier-free guidance, and this one has none"
        elif heads % self.tensor:
            problem = f"tensor degree {self.tensor} does not divide the model's {heads} attention heads"
        elif self.ulysses > heads // self.tensor:
            problem = (
                f"ulysses degree {self.ulysses} exceeds the {heads // self.tensor} attention heads each rank holds"
            )
        elif self.patches < 1 or self.warmup_steps < 1:
            # The warm-up steps fill every layer's K/V buffer that the patched steps read.
            problem = f"patches {self.patches} and warmup steps {self.warmup_steps} must both be 1 or more"
        elif self.patches > 1 and self.pipefusion == 1:
            problem = "patches only apply to pipefusion; give pipefusion 2 or more"
        elif self.shard_weights < 0 or self.shard_weights and self.world_size % self.shard_weights:
            problem = f"shard weights {self.shard_weights} does not divide the plan's {self.world_size} GPUs"
        elif self.shard_weights and (self.tensor > 1 or self.pipefusion > 1):
            # Sharded ranks gather each block together, so they must run the same blocks at once on whole weights.
            problem = "shard weights combines with ulysses, ring and cfg, not with tensor or pipefusion"
        elif self.world_size != gpus:
            problem = f"{self.describe()} uses {self.world_size} GPUs, not the {gpus} asked for"
        if problem:
            options = "; ".join(plan.describe() for plan in plans_for(gpus, has_cfg, heads))
            raise InvalidRequest(f"{problem}; plans for {gpus} GPUs: {options}")


def plans_for(gpus: int, has_cfg: bool, heads: int) -> list[ParallelConfig]:
    """Best first (the first is the default): CFG parallel when the model has two branches (one exchange per step),
    the rest Ulysses (the fastest sequence split on fast links); Ring takes over only where the heads run out."""
    plans = []
    for cfg in (2, 1) if has_cfg else (1,):
        if gpus % cfg:
            continue
        sequence = gpus // cfg
        for ring in range(1, sequence + 1):
            if sequence % ring == 0 and sequence // ring <= heads:
                plans.append(ParallelConfig(ulysses=sequence // ring, ring=ring, cfg=cfg))
    return plans
