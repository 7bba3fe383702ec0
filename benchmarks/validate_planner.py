"""The cost model against what was measured: every current multi-GPU row of ``measurements.json`` predicted from its
own run's one-GPU row (same model, precision and execution), and, per case (model x link x precision), whether the
plan the model ranks first is the measured best or within 5% of it.

    python -m benchmarks.validate_planner     (prints the table and the hit rate in Markdown)

Must not import torch.distributed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from paradit.planner.cost import StepCost, linear_efficiency, step_cost
from paradit.planner.measurements import Measurement, all_measurements, one_gpu_reference
from paradit.planner.plan import facts_for, rank
from paradit.planner.profile import HardwareProfile, all_profiles

WITHIN_BEST = 1.05  # a pick this close to the measured best counts as the best
WITHIN_PREDICTION = 0.15  # a prediction this close to the measurement counts as right
# The execution the planner runs each plan in, best first: CUDA graphs where a plan allows them (PipeFusion does not).
EXECUTION_ORDER = ("graphs", "compiled", "eager")


@dataclass(frozen=True)
class Prediction:
    measurement: Measurement
    reference: Measurement
    cost: StepCost

    @property
    def predicted_ms(self) -> float:
        return self.cost.steady_ms

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measurement.ms - 1


@dataclass(frozen=True)
class Case:
    """The plans measured for one model, link, precision and batch on 2 GPUs, each in the execution the planner
    would use."""

    model: str
    link: str
    precision: str
    batch: int
    predictions: tuple[Prediction, ...]

    @property
    def measured_best(self) -> Prediction:
        return min(self.predictions, key=lambda p: p.measurement.ms)

    @property
    def picked(self) -> Prediction:
        """The plan the planner ranks first among those measured (its ranking rule, ties included)."""
        return rank(list(self.predictions), lambda p: p.predicted_ms, lambda p: p.measurement.parallel)[0]

    @property
    def pick_is_best(self) -> bool:
        return self.picked.measurement.ms <= WITHIN_BEST * self.measured_best.measurement.ms

    @property
    def hit(self) -> bool:
        return self.pick_is_best and abs(self.picked.error) <= WITHIN_PREDICTION

    @property
    def in_sample(self) -> bool:
        """Whether the pick's own row calibrated a profile figure (its prediction is then no test)."""
        return self.picked.measurement.calibrates is not None


def profile_of(measurement: Measurement) -> HardwareProfile:
    return next(p for p in all_profiles().values() if measurement.on(p) and measurement.link is not None)


def predict(measurement: Measurement) -> Prediction | None:
    """The cost model's step for a measured multi-GPU row, its compute calibrated by the same run's one-GPU row."""
    from paradit.families import PRESETS

    profile = profile_of(measurement)
    reference = one_gpu_reference(
        measurement.model, measurement.precision, measurement.execution, profile, measurement.run, measurement.batch
    )
    if reference is None:
        return None
    spec = PRESETS[measurement.model]
    facts = facts_for(spec)
    workload = facts.workload(spec.height, spec.width, spec.frames)
    batch = measurement.batch
    fp8 = measurement.precision == "fp8"
    efficiency = linear_efficiency(facts, workload, batch, fp8, profile, reference.ms)
    graphs = measurement.execution == "graphs"
    cost = step_cost(facts, workload, batch, measurement.parallel, fp8, profile, efficiency, graphs)
    return Prediction(measurement, reference, cost)


def predictions() -> list[Prediction]:
    rows = [m for m in all_measurements() if m.parallel.world_size > 1 and m.superseded is None]
    return [p for p in map(predict, rows) if p is not None]


def cases(rows: list[Prediction]) -> list[Case]:
    """Per model, link, precision and batch on 2 GPUs, each plan once: in the execution the planner would run it,
    from the latest run that measured it so. Eager runs are left out (the planner never proposes them)."""
    chosen: dict[tuple, dict[object, Prediction]] = defaultdict(dict)
    for p in rows:
        m = p.measurement
        if m.execution == "eager" or m.parallel.world_size != 2:
            continue
        plans = chosen[(m.model, m.link, m.precision, m.batch)]
        held = plans.get(m.parallel)
        if held is None or EXECUTION_ORDER.index(m.execution) <= EXECUTION_ORDER.index(held.measurement.execution):
            plans[m.parallel] = p
    return [
        Case(model, link, precision, batch, tuple(plans.values()))
        for (model, link, precision, batch), plans in chosen.items()
        if len(plans) > 1
    ]


def markdown() -> str:
    rows = predictions()
    lines = [
        "| model | link | precision | execution | plan | measured ms | predicted ms | error | MiB sent (predicted) "
        "| one-GPU reference ms | run | in-sample |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in rows:
        m = p.measurement
        lines.append(
            f"| {m.model} | {m.link} | {m.precision} | {m.execution} | {m.parallel.describe()} | {m.ms:.1f} | "
            f"{p.predicted_ms:.1f} | {p.error:+.1%} | {p.cost.bytes_sent / 2**20:.0f} | {p.reference.ms:.1f} | "
            f"{m.run.id} | {m.calibrates or ''} |"
        )
    within = sum(abs(p.error) <= WITHIN_PREDICTION for p in rows)
    lines += ["", f"Rows predicted within {WITHIN_PREDICTION:.0%}: {within} of {len(rows)}.", ""]
    lines += [
        "| case | plans measured | measured best | planner's pick | pick's error | hit |",
        "|---|---|---|---|---:|---|",
    ]
    found = cases(rows)
    for case in found:
        best, picked = case.measured_best, case.picked
        plans = ", ".join(f"{p.measurement.parallel.describe()} {p.measurement.ms:.1f}" for p in case.predictions)
        name = f"{case.model}, {case.link}, {case.precision}, batch {case.batch}"
        lines.append(
            f"| {name} | {plans} | {best.measurement.parallel.describe()} | {picked.measurement.parallel.describe()} "
            f"({picked.predicted_ms:.1f} predicted) | {picked.error:+.1%} | {'yes' if case.hit else 'no'} |"
        )
    hits = sum(case.hit for case in found)
    independent = [case for case in found if not case.in_sample]
    lines += [
        "",
        f"Hit rate: {hits} of {len(found)} cases (pick within {WITHIN_BEST - 1:.0%} of the measured best, its "
        f"prediction within {WITHIN_PREDICTION:.0%}); {sum(c.hit for c in independent)} of {len(independent)} "
        "where the pick's row calibrated nothing.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
