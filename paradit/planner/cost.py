"""The cost model: one denoise step of a plan on a hardware profile, in ms and bytes sent, for the busiest rank;
plan changes are counted, not fitted (the model's efficiency comes from its one-GPU step)."""

from __future__ import annotations

from dataclasses import dataclass

from paradit.layers.attention import FP8_MIN_KEYS
from paradit.parallel.config import ParallelConfig
from paradit.planner.facts import ModelFacts, Workload
from paradit.planner.profile import HardwareProfile

BF16_BYTES = 2


def ms(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


@dataclass(frozen=True)
class Transfer:
    collective: str
    strategy: str
    bytes: float
    ms: float


@dataclass(frozen=True)
class StepCost:
    """``steady_ms``: a steady-state step; ``warmup_ms``: one of PipeFusion's exact warm-up steps (else equal to it)."""

    compute_ms: float
    transfers: tuple[Transfer, ...]
    steady_ms: float
    warmup_ms: float
    warmup_steps: int

    @property
    def bytes_sent(self) -> float:
        return sum(t.bytes for t in self.transfers)

    def mean_ms(self, steps: int) -> float:
        warmup = min(self.warmup_steps, steps)
        return (warmup * self.warmup_ms + (steps - warmup) * self.steady_ms) / steps


def attention_ms(
    facts: ModelFacts,
    workload: Workload,
    batch: float,
    profile: HardwareProfile,
    fp8_attention: bool = False,
    ring: int = 1,
    density: float = 1.0,
) -> float:
    """With ``fp8_attention``, the calls the runtime gives the FP8 kernel at its rate, the rest at SDPA's;
    ``density``: the share of pairs block-sparse attention keeps in the attention the sequence ranks exchange (a
    video's self-attention), at the dense rate (an estimate until benchmarks/sparse_attention.py measures it)."""
    total = 0.0
    for group in facts.attention:
        keys = group.key_tokens.at(workload.image_tokens, workload.text_tokens) / ring
        fp8 = fp8_attention and keys >= FP8_MIN_KEYS
        kept = density if group.exchanged else 1.0
        total += kept * group.flops(workload) * batch / (profile.attention_rate(group.head_dim, fp8) * 1e9)
    return total


def linear_efficiency(
    facts: ModelFacts, workload: Workload, batch: int, fp8: bool, profile: HardwareProfile, measured_ms: float
) -> float:
    """The share of the matmul rates the linears reach: their time at full rate over what the measured step leaves."""
    image, text = workload.image_tokens, workload.text_tokens
    full_rate_ms = sum(
        g.flops.at(image, text) * batch / (profile.matmul_tflops["fp8" if fp8 and g.kind.fp8 else "bf16"] * 1e9)
        for g in facts.linear
    )
    other_ms = facts.other_flops.at(image, text) * batch / (profile.matmul_tflops["bf16"] * 1e9)
    linear_ms = measured_ms - attention_ms(facts, workload, batch, profile) - other_ms
    return full_rate_ms / linear_ms


def step_cost(
    facts: ModelFacts,
    workload: Workload,
    batch: int,
    parallel: ParallelConfig,
    fp8: bool,
    profile: HardwareProfile,
    efficiency: float,
    cuda_graphs: bool,
    weight_bytes: float = 0.0,
    fp8_attention: bool = False,
    attention_density: float = 1.0,
) -> StepCost:
    """``weight_bytes``: the transformer's (one expert's), which sharded weights gather once a step;
    ``attention_density``: sparse attention's kept share (``attention_ms``)."""
    image, text = workload.image_tokens, workload.text_tokens
    local_batch = batch / parallel.cfg
    sequence, tensor, stages = parallel.sequence_degree, parallel.tensor, parallel.pipefusion

    compute = 0.0
    for group in facts.linear:
        rate = profile.matmul_tflops["fp8" if fp8 and group.kind.fp8 else "bf16"] * efficiency
        token_flops = group.flops.at(image, text) - group.flops.fixed
        if group.kind.in_blocks:  # the split happens after the embedders and is undone before the head
            token_flops /= sequence * stages * (tensor if group.kind.sharded else 1)
        compute += (token_flops + group.flops.fixed) * local_batch / (rate * 1e9)
    attention = attention_ms(facts, workload, local_batch, profile, fp8_attention, parallel.ring, attention_density)
    compute += attention / (sequence * tensor * stages)
    compute += facts.other_flops.at(image, text) * local_batch / (profile.matmul_tflops["bf16"] * efficiency * 1e9)

    transfers = _transfers(facts, workload, local_batch, parallel, profile, weight_bytes)
    transfers = tuple(t for t in transfers if t.bytes > 0)
    exchanged_ms = sum(t.ms for t in transfers if t.strategy not in ("pipefusion", "shard"))
    gather_ms = sum(t.ms for t in transfers if t.strategy == "shard")
    stage_ms = compute + exchanged_ms + max(0.0, gather_ms - compute) + gather_ms / facts.blocks
    # A step launches every block once per patch on each stage (once per step in a warm-up step, stages in turn).
    launch_ms = 0.0 if cuda_graphs else facts.blocks * profile.host_ms_per_block
    if stages == 1:
        step = max(stage_ms, launch_ms)
        return StepCost(compute, transfers, step, step, 0)
    hop_ms = sum(t.ms for t in transfers if t.strategy == "pipefusion")
    patches = parallel.patches
    steady = max(stage_ms * max(patches, stages) / patches, launch_ms * patches / stages) + hop_ms / patches
    warmup = max(stage_ms * stages, launch_ms) + hop_ms
    return StepCost(compute, transfers, steady, warmup, parallel.warmup_steps)


def _transfers(
    facts: ModelFacts,
    workload: Workload,
    batch: float,
    parallel: ParallelConfig,
    profile: HardwareProfile,
    weight_bytes: float,
) -> list[Transfer]:
    image, text = workload.image_tokens, workload.text_tokens
    ulysses, ring, tensor, stages = parallel.ulysses, parallel.ring, parallel.tensor, parallel.pipefusion
    sequence = ulysses * ring
    ulysses_bytes = ring_bytes = 0.0
    for group in facts.attention:
        if not group.exchanged:
            continue
        query, key = group.query_tokens.at(image, text), group.key_tokens.at(image, text)
        row = group.heads / tensor * group.head_dim * BF16_BYTES
        if parallel.comm_dtype == "fp8":  # a byte per value and a float32 scale per token and head
            row *= (group.head_dim + 4) / (BF16_BYTES * group.head_dim)
        layers = group.layers / stages * batch
        # Q, K, V and the output each leave this rank but for its own share of the heads.
        ulysses_bytes += layers * (2 * query + 2 * key) / sequence * row * (ulysses - 1) / ulysses
        # K and V of this rank's tokens (its Ulysses group's heads) go round the ring once.
        ring_bytes += layers * 2 * key / ring * row / ulysses * (ring - 1)
    reduced = facts.all_reduce_elements.at(image, text) * batch / sequence / stages * BF16_BYTES
    all_reduce_bytes = reduced * 2 * (tensor - 1) / tensor
    prediction = facts.prediction_elements.at(image, text) * BF16_BYTES * batch
    cfg_bytes = prediction * (parallel.cfg - 1)
    # Stage 0 passes the activations of every token on (the last stage's prediction back is a small fraction).
    stage_bytes = (image + text) * facts.width * BF16_BYTES * batch / sequence if stages > 1 else 0.0
    # A gather sends this rank's 1/N of every block to the N - 1 others (one forward a step).
    shard = parallel.shard_weights
    gather_bytes = weight_bytes / shard * (shard - 1) if shard else 0.0

    def transfer(collective: str, strategy: str, nbytes: float) -> Transfer:
        return Transfer(collective, strategy, nbytes, nbytes / (profile.link_gbps[collective] * 1e6))

    return [
        transfer("all_to_all", "ulysses", ulysses_bytes),
        transfer("send_recv", "ring", ring_bytes),
        transfer("all_reduce", "tensor", all_reduce_bytes),
        transfer("all_gather", "cfg", cfg_bytes),
        transfer("send_recv", "pipefusion", stage_bytes),
        transfer("all_gather", "shard", gather_bytes),
    ]
