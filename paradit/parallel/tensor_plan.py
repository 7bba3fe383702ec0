"""A family's tensor-parallel sharding, as data: which linears split by output features (column) or input features
(row), over which packed parts; and the check that a degree divides a model's heads and widths. Light (no
collectives), for the family records and the plan's validation; ``tensor`` applies it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from paradit.errors import InvalidRequest


@dataclass(frozen=True)
class Shard:
    """``style`` "column" (output features) or "row" (input features); ``parts``: the packed parts along it, in order,
    by their key in the plan's ``widths``."""

    style: str
    parts: tuple[str, ...] = ("attention",)


@dataclass(frozen=True)
class TensorPlan:
    """One family's sharding, as data; patterns are ``fnmatch`` patterns of module names."""

    family: str
    heads: Callable[[nn.Module], int]  # model -> attention heads
    # model -> width of each part kind ("attention", "MLP hidden"), read from the model so it follows any checkpoint
    widths: Callable[[nn.Module], dict[str, int]]
    linears: dict[str, Shard]
    # module pattern -> attributes that count heads or features of the whole layer, divided by T after sharding
    local_attributes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # RMS norms (patterns) over the whole "attention" width, after a column-parallel projection
    norms_across_heads: tuple[str, ...] = ()


COLUMN = Shard("column")
ROW = Shard("row")
COLUMN_MLP = Shard("column", ("MLP hidden",))
ROW_MLP = Shard("row", ("MLP hidden",))


def joint_attention(prefix: str, out_projection: bool = True) -> dict[str, Shard]:
    """Both streams' Q/K/V column-parallel, both output projections row-parallel (``to_add_out`` may be absent)."""
    plan = {f"{prefix}.{name}": COLUMN for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")}
    plan[f"{prefix}.to_out.0"] = ROW
    if out_projection:
        plan[f"{prefix}.to_add_out"] = ROW
    return plan


def check_tensor_plan(plan: TensorPlan | None, model: nn.Module, degree: int) -> TensorPlan:
    if plan is None:
        raise InvalidRequest(f"tensor parallelism has no plan for {type(model).__name__}; drop --tensor")
    heads = plan.heads(model)
    if heads % degree:
        raise InvalidRequest(f"tensor degree {degree} does not divide {plan.family}'s {heads} attention heads")
    for kind, width in plan.widths(model).items():
        if width % degree:
            raise InvalidRequest(
                f"tensor degree {degree} does not divide {plan.family}'s {kind} width {width}; "
                f"give a degree that divides it and the {heads} attention heads"
            )
    return plan
