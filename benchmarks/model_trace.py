"""What one transformer forward does, counted on the meta device: the FLOPs of every linear layer (sorted by where
it sits and what the parallel runtime does to it), the FLOPs of everything else, and every attention call's shape.

A meta-device forward costs no memory and a fraction of a second even for a 32B model, and it counts what the model
code really runs, so the counts follow the model rather than a hand-written formula. Nothing here knows a family:
the caller builds the model and says how to call it.

Must not import torch.distributed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from paradit.compile import model_blocks
from paradit.layers.attention import AttentionDispatch
from paradit.parallel.tensor_plan import TensorPlan
from paradit.planner.facts import LinearKind
from paradit.quantize import quantizable


@dataclass(frozen=True)
class AttentionCall:
    """One attention call: ``exchanged`` is False when its keys belong to no split token stream (every rank holds
    them whole, so sequence parallelism sends nothing for it)."""

    exchanged: bool
    batch: int
    heads: int
    head_dim: int
    query_tokens: int
    key_tokens: int


@dataclass
class StepTrace:
    """FLOPs by linear kind, other FLOPs (convolutions, batched matmuls outside attention), the elements that
    tensor parallelism all-reduces (row-parallel outputs) and how many all-reduces, the attention calls, and the
    elements of the prediction (what CFG parallelism exchanges)."""

    linear_flops: dict[LinearKind, float] = field(default_factory=lambda: defaultdict(float))
    other_flops: float = 0.0
    prediction_elements: int = 0
    all_reduce_elements: float = 0.0
    all_reduce_calls: int = 0
    attention: list[AttentionCall] = field(default_factory=list)


def _row_parallel(name: str, plan: TensorPlan | None) -> bool:
    return plan is not None and any(
        shard.style == "row" and fnmatchcase(name, pattern) for pattern, shard in plan.linears.items()
    )


def _sharded(name: str, plan: TensorPlan | None) -> bool:
    return plan is not None and any(fnmatchcase(name, pattern) for pattern in plan.linears)


def _numel(prediction) -> int:
    """Elements of a prediction: one tensor, or one per sample (families that take lists of variable sizes)."""
    if isinstance(prediction, torch.Tensor):
        return prediction.numel()
    return sum(_numel(part) for part in prediction)


def trace_step(
    model: nn.Module,
    call: Callable[[nn.Module], object],
    tensor_plan: TensorPlan | None,
    keep_high_precision: tuple[str, ...],
) -> StepTrace:
    """Run ``call(model)`` (returning the prediction) on the meta-device ``model`` and count what it does. The
    model's attention modules are swapped for a recorder meanwhile (its output has the query's shape)."""
    trace = StepTrace()
    in_blocks = {id(module) for block in model_blocks(model) for module in block.modules()}
    hooks = []

    def count_linear(kind: LinearKind, row: bool):
        def hook(module: nn.Linear, inputs, output) -> None:
            rows = inputs[0].numel() // module.in_features
            trace.linear_flops[kind] += 2.0 * rows * module.in_features * module.out_features
            if row:
                trace.all_reduce_elements += output.numel()
                trace.all_reduce_calls += 1

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            kind = LinearKind(
                in_blocks=id(module) in in_blocks,
                sharded=_sharded(name, tensor_plan),
                fp8=quantizable(name, module, keep_high_precision),
            )
            hooks.append(module.register_forward_hook(count_linear(kind, _row_parallel(name, tensor_plan))))

    previous = {}
    for module in model.modules():
        if isinstance(module, AttentionDispatch):
            previous[module] = module.attention_fn
            exchanged = module.sequence_streams != ()

            def record(query, key, value, key_mask=None, exchanged=exchanged):
                batch, query_tokens, heads, head_dim = query.shape
                trace.attention.append(AttentionCall(exchanged, batch, heads, head_dim, query_tokens, key.shape[1]))
                return torch.empty_like(query)

            module.set_attention_fn(record)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            prediction = call(model)
    finally:
        for hook in hooks:
            hook.remove()
        for module, fn in previous.items():
            module.set_attention_fn(fn)
    trace.other_flops = counter.get_total_flops() - sum(trace.linear_flops.values())
    trace.prediction_elements = _numel(prediction)
    return trace
