"""A ``PlanChoice`` as text (plan and runners-up, why the winner won), and a plan's ``paradit generate`` command."""

from __future__ import annotations

from paradit.memory import gib
from paradit.options import ExecutionOptions
from paradit.parallel.config import ParallelConfig
from paradit.planner.cost import ms
from paradit.planner.plan import EXACT_PREMIUM, Option, PlanChoice

RUNNERS_UP = 5
RIVALS = 2
COLLECTIVE_NAMES = {
    "all_to_all": "all-to-all",
    "send_recv": "point-to-point",
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
}


def size(nbytes: float) -> str:
    if nbytes == 0:
        return "0"
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"


def traffic(option: Option, profile_gbps: dict[str, float]) -> str:
    """'sends 3.0 GiB per step: 121 ms at 26.1 GB/s (all-to-all)', naming the costliest collective."""
    cost = option.cost
    if not cost.transfers:
        return "sends nothing between GPUs"
    main = max(cost.transfers, key=lambda t: t.ms)
    hidden = ", hidden behind the next patch but for one patch's hop" if option.parallel.pipefusion > 1 else ""
    if main.strategy == "shard":
        hidden = ", each block's weights gathered while the block before it computes"
    return (
        f"sends {size(cost.bytes_sent)} per step: {ms(main.ms)} ms at {profile_gbps[main.collective]:g} GB/s "
        f"({COLLECTIVE_NAMES[main.collective]}){hidden}"
    )


def approximation_note(option: Option) -> str:
    if option.parallel.comm_dtype == "fp8":
        return "Ulysses/Ring traffic in FP8"
    return "each patch attends to the previous step's activations of the others"


def _row(option: Option, marker: str) -> str:
    placement = option.placement or f"none fits ({option.memory.text_encoder_placement} smallest)"
    exact = "exact" if option.parallel.exact else "approximate"
    return (
        f"{marker} {option.describe():<60} {ms(option.mean_ms):>9} {ms(option.cost.compute_ms):>9} "
        f"{size(option.cost.bytes_sent):>10} {gib(option.memory.total) + ' GiB':>10}  {placement:<8} {exact}"
    )


def why(choice: PlanChoice) -> str:
    best = choice.best
    link = choice.profile.link_gbps
    rivals: dict[tuple, Option] = {}
    for option in choice.ranked[1:]:
        if option.parallel.degrees() != best.parallel.degrees():
            rivals.setdefault(tuple(name for name, degree in option.parallel.degrees() if degree > 1), option)
    lines = [
        f"{option.describe()} computes {ms(option.cost.compute_ms)} ms and {traffic(option, link)}."
        for option in [best, *list(rivals.values())[:RIVALS]]
    ]
    exact = [o for o in choice.ranked if o.parallel.exact]
    quicker = [o for o in choice.ranked if not o.parallel.exact and o.mean_ms < best.mean_ms]
    if not best.parallel.exact and exact:
        lines.append(
            f"It is approximate ({approximation_note(best)}) and ranks first because it is predicted more than "
            f"{EXACT_PREMIUM:.0%} faster than the best exact plan, {exact[0].describe()} ({ms(exact[0].mean_ms)} ms)."
        )
    elif best.parallel.exact and quicker:
        lines.append(
            f"{quicker[0].describe()} is predicted faster ({ms(quicker[0].mean_ms)} ms) but approximate "
            f"({approximation_note(quicker[0])}); an approximate plan must be {EXACT_PREMIUM:.0%} faster to rank first."
        )
    quickest = min((o for o in choice.refused if o.mean_ms < best.mean_ms), key=lambda o: o.mean_ms, default=None)
    if quickest is not None:
        lines.append(
            f"{quickest.describe()} would take {ms(quickest.mean_ms)} ms but does not fit: it needs "
            f"{quickest.memory.describe()} against {gib(choice.profile.memory_bytes)} GiB."
        )
    if best.parallel.pipefusion > 1:
        lines.append(
            f"PipeFusion's {best.cost.warmup_steps} warm-up step(s) run whole ({ms(best.cost.warmup_ms)} ms), "
            f"the rest {ms(best.cost.steady_ms)} ms with {best.parallel.patches} patches in flight."
        )
    if choice.single_gpu is not None and choice.single_gpu.fits and choice.single_gpu.mean_ms <= best.mean_ms:
        lines.append(
            f"One GPU would be as fast or faster ({ms(choice.single_gpu.mean_ms)} ms/step): at this size the "
            "exchanges cost more than the split saves."
        )
    return "\n".join(lines)


def generate_command(
    model: str, parallel: ParallelConfig, options: ExecutionOptions, placement: str | None, extra: tuple[str, ...] = ()
) -> str:
    flags = [f"--model {model}", f"--gpus {parallel.world_size}"]
    for name, degree in parallel.degrees():
        if degree > 1:
            flags.append("--cfg-parallel" if name == "cfg" else f"--{name} {degree}")
    optional = [
        (parallel.pipefusion > 1, f"--patches {parallel.patches} --warmup-steps {parallel.warmup_steps}"),
        (parallel.comm_dtype == "fp8", "--comm-dtype fp8"),
        (options.quantize == "fp8", "--quantize fp8"),
        (options.attention == "fp8", "--attention fp8"),
        (options.sparse_attention, f"--sparse-attention {options.sparse_attention}"),
        *((True, f"--sparse-{name.replace('_', '-')} {value}") for name, value in options.sparse_parameters().items()),
        (options.cuda_graphs, "--cuda-graphs"),
        (options.swap_experts, "--swap-experts"),
        (parallel.shard_weights, f"--shard-weights {parallel.shard_weights}"),
        (placement not in (None, "gpu"), f"--text-encoder-placement {placement}"),
    ]
    flags += [flag for wanted, flag in optional if wanted]
    return "paradit generate " + " ".join([*flags, *extra]) + ' --prompt "..."'


def render(choice: PlanChoice) -> str:
    request, profile = choice.request, choice.profile
    frames = f", {request.frames} frames" if request.frames else ""
    branches = ", both guidance branches" if request.uses_cfg else ""
    status = "predicted from published specifications" if profile.predicted else "measured figures"
    lines = [
        f"{choice.spec.name} on {choice.gpus} x {profile.name} ({profile.description}; {status})",
        f"{request.width}x{request.height}{frames}, {request.steps} steps{branches}; "
        f"{gib(profile.memory_bytes)} GiB per GPU",
        choice.best.calibration.describe(profile, choice.best.fp8),
        *choice.notes,
        "",
        f"  {'plan':<60} {'ms/step':>9} {'compute':>9} {'sent/step':>10} {'GPU mem':>10}  {'encoders':<8} result",
        *(_row(option, "*" if option is choice.best else " ") for option in choice.ranked[: 1 + RUNNERS_UP]),
        *(_row(option, "x") for option in sorted(choice.refused, key=lambda o: o.mean_ms)[:2]),
        *([_row(choice.single_gpu, "1")] if choice.single_gpu is not None else []),
        "(* chosen; x does not fit in memory; 1 one GPU for comparison; ms/step averages the request's steps)",
        "",
        "Why: " + why(choice),
    ]
    return "\n".join(lines)
