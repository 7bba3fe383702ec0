"""The planner: every plan of N GPUs for a model, costed, checked against rank 0's memory, and ranked."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, PRESETS, find_facts
from paradit.memory import MemoryPlan, MetaModels, estimates, gib
from paradit.options import CONFLICTS, PLACEMENTS, ExecutionOptions
from paradit.parallel.config import ParallelConfig
from paradit.parallel.validate import check_plan
from paradit.planner.cost import StepCost, linear_efficiency, step_cost
from paradit.planner.facts import ModelFacts
from paradit.planner.measurements import Measurement, one_gpu_reference
from paradit.planner.profile import HardwareProfile
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec

SAME_SPEED = 0.02
EXACT_PREMIUM = 0.10
T = TypeVar("T")
# Host-to-device copies of a swapped expert: measured on the H200 machine (docs/benchmarks.md, "Wan 2.2 A14B experts
# taking turns"); PCIe 5 x16, as the profiles' other cards have.
SWAP_GBPS = 53.6


@dataclass(frozen=True)
class Request:
    height: int
    width: int
    frames: int | None
    steps: int
    batch: int  # samples a step: 2 when both guidance branches run
    input_tokens: int = 0  # what input images add to each sample's sequence (references, an edit's inputs)

    @property
    def uses_cfg(self) -> bool:
        return self.batch == 2


def resolved_for(spec: ModelSpec, request: GenerationRequest | ResolvedRequest | None = None) -> ResolvedRequest:
    """A model that animates an image, given none, is planned for a blank first frame."""
    if isinstance(request, ResolvedRequest):
        return request
    family = FAMILIES[spec.family]
    request = request or GenerationRequest(prompt="a")
    try:
        return family.resolve_request(spec, request)
    except InvalidRequest:
        if request.image is not None:
            raise
        from PIL import Image

        blank = Image.new("RGB", (request.width or spec.width, request.height or spec.height))
        return family.resolve_request(spec, dataclasses.replace(request, image=blank))


def request_for(spec: ModelSpec, request: GenerationRequest | ResolvedRequest | None = None) -> Request:
    resolved = resolved_for(spec, request)
    guides = spec.guidance_mode == "cfg" and FAMILIES[spec.family].uses_cfg(spec, resolved)
    return Request(
        resolved.height, resolved.width, resolved.frames, resolved.steps, 2 if guides else 1, resolved.reference_tokens
    )


@dataclass(frozen=True)
class Candidate:
    """A plan as a family's ``check_run`` reads a settled run (``family.SettledRun``)."""

    spec: ModelSpec
    parallel: ParallelConfig
    options: ExecutionOptions


def family_takes(spec: ModelSpec, resolved: ResolvedRequest, parallel: ParallelConfig, cuda_graphs: bool) -> bool:
    """Whether the family's rules (``check_run``) let ``resolved`` run under ``parallel``: a plan ``settle`` would
    refuse is never proposed."""
    check = FAMILIES[spec.family].check_run
    if check is None:
        return True
    try:
        check(Candidate(spec, parallel, ExecutionOptions(cuda_graphs=cuda_graphs)), resolved)
    except InvalidRequest:
        return False
    return True


def facts_for(spec: ModelSpec) -> ModelFacts:
    facts = find_facts(spec)
    if facts is None:
        counted = ", ".join(name for family in FAMILIES.values() for name in family.measured.model_facts)
        raise InvalidRequest(
            f"the planner has no FLOP counts for {spec.name}'s transformer (it knows {counted}); "
            "pass the parallel flags yourself, or add its preset and rerun benchmarks/model_facts.py"
        )
    return facts


@dataclass(frozen=True)
class Calibration:
    """The linear layers' achieved share of the matmul rates, and its measurement (None: the profile's figure)."""

    efficiency: float
    source: Measurement | None

    def describe(self, profile: HardwareProfile, fp8: bool) -> str:
        precision = "fp8" if fp8 else "bf16"
        if self.source is None:
            return (
                f"no step of this model measured on {profile.name}: its linear layers are taken at "
                f"{self.efficiency:.0%} of {profile.matmul_tflops[precision]:.0f} TFLOP/s, the profile's typical share"
            )
        s = self.source
        return (
            f"compute calibrated by {s.model}'s measured one-GPU step, {s.ms:.1f} ms ({s.precision}, {s.execution}, "
            f'batch {s.batch}; docs/benchmarks.md "{s.run.section}", {s.run.date})'
        )


def calibration(facts: ModelFacts, profile: HardwareProfile, fp8: bool, cuda_graphs: bool) -> Calibration:
    """From the latest one-GPU measurement of a preset with the same transformer, in the plan's execution if any."""
    precision = "fp8" if fp8 else "bf16"
    same = [name for name, spec in PRESETS.items() if spec.transformer == PRESETS[facts.preset].transformer]
    for execution in ("graphs", "compiled") if cuda_graphs else ("compiled", "graphs"):
        measured = next(filter(None, (one_gpu_reference(name, precision, execution, profile) for name in same)), None)
        if measured is not None:
            preset = PRESETS[measured.model]
            workload = facts.workload(preset.height, preset.width, preset.frames)
            efficiency = linear_efficiency(facts, workload, measured.batch, fp8, profile, measured.ms)
            return Calibration(efficiency, measured)
    return Calibration(profile.linear_efficiency[precision], None)


@dataclass(frozen=True)
class Option:
    """A plan with its cost and rank 0's memory with ``placement``, the first that fits (None: none; the smallest)."""

    parallel: ParallelConfig
    fp8: bool
    cost: StepCost
    mean_ms: float
    memory: MemoryPlan
    placement: str | None
    calibration: Calibration
    cuda_graphs: bool
    swap_experts: bool = False  # the experts take turns on the device, the idle one in host memory
    fp8_attention: bool = False  # which CUDA graphs do not combine with

    @property
    def fits(self) -> bool:
        return self.placement is not None

    def describe(self) -> str:
        return self.parallel.describe() + " + FP8" * self.fp8 + " + experts swapped" * self.swap_experts


@dataclass(frozen=True)
class PlanChoice:
    spec: ModelSpec
    gpus: int
    profile: HardwareProfile
    request: Request
    ranked: tuple[Option, ...]
    refused: tuple[Option, ...]
    single_gpu: Option | None = None
    fp8_needed: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> Option:
        return self.ranked[0]


def approximation(parallel: ParallelConfig) -> tuple[int, int]:
    """How far a plan strays from one process: FP8 transport, then PipeFusion's stale patches (more are staler)."""
    patched = parallel.patches if parallel.pipefusion > 1 and parallel.patches > 1 else 0
    return int(parallel.comm_dtype == "fp8"), patched


def rank(items: list[T], ms: Callable[[T], float], parallel: Callable[[T], ParallelConfig]) -> list[T]:
    """Best first by ms, approximate plans charged ``EXACT_PREMIUM``; within ``SAME_SPEED``, the least approximate."""

    def charged(item: T) -> float:
        return ms(item) * (1 if parallel(item).exact else 1 + EXACT_PREMIUM)

    best = min((charged(item) for item in items), default=0.0)

    def key(item: T) -> tuple:
        tied = charged(item) <= best * (1 + SAME_SPEED)
        return (not tied, approximation(parallel(item)) if tied else (0, 0), charged(item))

    return sorted(items, key=key)


def parallel_candidates(spec: ModelSpec, gpus: int, uses_cfg: bool, fp8_transport: bool) -> list[ParallelConfig]:
    family = FAMILIES[spec.family]
    found = []
    for cfg in (2, 1) if uses_cfg and gpus % 2 == 0 else (1,):
        for pipefusion, ring, ulysses, tensor in _factorizations(gpus // cfg, 4):
            base = ParallelConfig(ulysses=ulysses, ring=ring, cfg=cfg, tensor=tensor, pipefusion=pipefusion)
            variants = [base]
            if pipefusion > 1:
                variants = [dataclasses.replace(base, patches=p) for p in (pipefusion, 2 * pipefusion)]
            if fp8_transport and ulysses * ring > 1:
                variants += [dataclasses.replace(v, comm_dtype="fp8") for v in variants]
            if tensor == pipefusion == 1:
                shards = [n for n in range(2, gpus + 1) if gpus % n == 0]
                variants += [dataclasses.replace(v, shard_weights=n) for v in variants for n in shards]
            for parallel in variants:
                with contextlib.suppress(InvalidRequest):
                    check_plan(family, spec, parallel)
                    found.append(parallel)
    return found


def _factorizations(n: int, slots: int) -> list[tuple[int, ...]]:
    if slots == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, slots - 1)]


class MemoryEstimates:
    """``estimates`` per plan shape, the meta models built once (per plan, they were the planner's slowest part)."""

    def __init__(self, spec: ModelSpec, extra_tokens: int = 0, fp8_attention: bool = False) -> None:
        self.sized_for = (spec, extra_tokens, fp8_attention)
        self._known: dict[tuple, dict[str, MemoryPlan]] = {}
        built = MetaModels.build(spec, torch.bfloat16)  # compiled: the GPUs' default
        self._fixed = {"compiled": True, "built": built, "extra_tokens": extra_tokens, "fp8_attention": fp8_attention}

    def __call__(self, parallel: ParallelConfig, fp8: bool, swap: bool = False) -> dict[str, MemoryPlan]:
        key = (parallel.tensor, parallel.pipefusion, parallel.sequence_degree, parallel.cfg, parallel.shard_weights)
        key += (fp8, swap)
        if key not in self._known:
            self._known[key] = estimates(self.sized_for[0], parallel, torch.bfloat16, fp8, swap, **self._fixed)
        return self._known[key]


def plan(
    spec: ModelSpec,
    gpus: int,
    profile: HardwareProfile,
    request: GenerationRequest | None = None,
    quantize: str | None = None,
    memory: MemoryEstimates | None = None,
    attention: str = "sdpa",
    attention_density: float = 1.0,
) -> PlanChoice:
    """``quantize`` None tries bf16, then FP8 compute where nothing fits; ``attention_density``: the share of a
    video's self-attention a sparse mask keeps, where one was asked for (the planner never chooses one)."""
    resolved = resolved_for(spec, request)
    wanted = request_for(spec, resolved)
    sized = dataclasses.replace(spec, height=wanted.height, width=wanted.width)
    fp8_attention = attention == "fp8"
    sized_for = (sized, wanted.input_tokens, fp8_attention)
    if memory is None or memory.sized_for != sized_for:
        memory = MemoryEstimates(*sized_for)
    facts = facts_for(spec)
    workload = facts.workload(wanted.height, wanted.width, wanted.frames)
    workload = dataclasses.replace(workload, image_tokens=workload.image_tokens + wanted.input_tokens)
    fp8_supported = "fp8" in profile.matmul_tflops
    if quantize == "fp8" and not fp8_supported:
        raise InvalidRequest(f"{profile.name} has no FP8 matmul rate: its GPUs cannot run --quantize fp8")
    attempts = [quantize == "fp8"] if quantize is not None else [False] + ([True] if fp8_supported else [])
    if fp8_attention and not profile.fp8_attention_tflops:
        raise InvalidRequest(
            f"{profile.name} has no measured FP8 attention rate: run benchmarks/fp8_attention.py "
            "there, or plan with --attention sdpa"
        )

    def option(parallel: ParallelConfig, fp8: bool, swap: bool) -> Option:
        graphs = graphs_for(parallel, swap, fp8_attention) and family_takes(spec, resolved, parallel, True)
        calibrated = calibration(facts, profile, fp8, graphs)
        weights = memory(ParallelConfig(), fp8, swap=True)["gpu"].transformer if parallel.shard_weights else 0.0
        cost = step_cost(
            facts,
            workload,
            wanted.batch,
            parallel,
            fp8,
            profile,
            calibrated.efficiency,
            graphs,
            weights,
            fp8_attention,
            attention_density,
        )
        tried = [memory(parallel, fp8, swap)[p] for p in PLACEMENTS if fp8 or p != "fp8"]
        fitting = next((m for m in tried if m.total <= profile.memory_bytes), None)
        chosen = fitting or min(tried, key=lambda m: m.total)
        placement = fitting.text_encoder_placement if fitting else None
        # Swapped experts copy one expert in twice a request (to the low-noise one, and back for the next request).
        swap_ms = 2 * chosen.transformer / (SWAP_GBPS * 1e9) * 1e3 if swap else 0.0
        mean_ms = cost.mean_ms(wanted.steps) + swap_ms / wanted.steps
        return Option(parallel, fp8, cost, mean_ms, chosen, placement, calibrated, graphs, swap, fp8_attention)

    refused: list[Option] = []
    for fp8 in attempts:  # bf16 first: FP8 compute only when nothing else fits
        # Swapping experts gains nothing over sharding, which keeps 1/N of each resident already.
        options = [
            option(parallel, fp8, swap)
            for parallel in parallel_candidates(spec, gpus, wanted.uses_cfg, fp8)
            if family_takes(spec, resolved, parallel, False)
            for swap in ((False, True) if spec.experts and not parallel.shard_weights else (False,))
        ]
        refused += [o for o in options if not o.fits]
        fitting = rank([o for o in options if o.fits], lambda o: o.mean_ms, lambda o: o.parallel)
        if not fitting:
            continue
        best = fitting[0]
        single = option(ParallelConfig(), fp8, best.swap_experts) if gpus > 1 else None
        needed = fp8 and quantize is None
        notes = [f"no plan fits {gib(profile.memory_bytes)} GiB per GPU in bf16: FP8 halves the weights"] * needed
        swapping = f"the experts take turns on each GPU (--swap-experts): {SWAP_GBPS:g} GB/s host copies"
        notes += [swapping] * best.swap_experts
        return PlanChoice(spec, gpus, profile, wanted, tuple(fitting), tuple(refused), single, needed, tuple(notes))
    if not refused:
        raise InvalidRequest(f"{spec.name} has no plan for {gpus} GPUs")
    smallest = min(refused, key=lambda o: o.memory.total)
    raise InvalidRequest(
        f"{spec.name} fits no plan on {gpus} x {gib(profile.memory_bytes)} GiB ({profile.name}): the smallest, "
        f"{smallest.describe()} with the text encoders {smallest.memory.text_encoder_placement}, needs "
        f"{smallest.memory.describe()}; use more GPUs or GPUs with more memory"
    )


def graphs_for(parallel: ParallelConfig, swap_experts: bool, fp8_attention: bool) -> bool:
    """CUDA graphs where ``CONFLICTS`` allows them and they were measured with the plan (not tensor parallelism)."""
    attention = "fp8" if fp8_attention else "sdpa"
    options = ExecutionOptions(cuda_graphs=True, swap_experts=swap_experts, attention=attention)
    return parallel.tensor == 1 and not any(conflict.applies(parallel, options, "cuda", None) for conflict in CONFLICTS)
