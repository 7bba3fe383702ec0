"""The command line's step-cache flags (``--cache`` and its parameters, by diffusers' names) and MagCache's
calibrated curves, kept per model where the next ``--cache mag`` finds them. Must not import torch."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from paradit.errors import InvalidRequest
from paradit.request import CACHE_METHODS, StepCacheConfig

# flag -> (StepCacheConfig field, type, help)
PARAMETERS = {
    "--cache-threshold": ("threshold", float, "first-block, mag: the threshold (default 0.05; mag 0.06)"),
    "--cache-interval": ("cache_interval", int, "taylorseer: steps between computed ones (default 5)"),
    "--cache-disable-before-step": ("disable_cache_before_step", int, "taylorseer: steps computed first (default 3)"),
    "--cache-disable-after-step": ("disable_cache_after_step", int, "taylorseer: computed from this step on"),
    "--cache-max-order": ("max_order", int, "taylorseer: the expansion's highest order (default 1)"),
    "--cache-max-skip-steps": ("max_skip_steps", int, "mag: most steps skipped in a row (default 3)"),
    "--cache-retention-ratio": ("retention_ratio", float, "mag: the share of first steps never skipped (default 0.2)"),
}


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache",
        choices=CACHE_METHODS,
        help="step caching: skip the blocks of steps that barely "
        "change, as diffusers' FirstBlockCache, MagCache and TaylorSeer (lite) hooks do",
    )
    for flag, (_, kind, text) in PARAMETERS.items():
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument(
        "--cache-mag-ratios",
        help="mag: the model's magnitude ratios, comma-separated (default: "
        "the curve --cache-calibrate measured for this model)",
    )
    parser.add_argument(
        "--cache-calibrate",
        action="store_true",
        help="with --cache mag: skip nothing, print the "
        "model's magnitude ratios and keep them for the next --cache mag run",
    )


def curve_path(model: str) -> Path:
    """Where ``model``'s calibrated MagCache curve is kept: under the user's cache folder, by the model's name."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paradit" / "mag_ratios"
    return root / (re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model) + ".json")


def cache_config(args: argparse.Namespace) -> StepCacheConfig | None:
    """The flags' step cache (None without ``--cache``); a parameter flag without ``--cache`` is refused."""
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in PARAMETERS.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if args.cache is None:
        if given or args.cache_mag_ratios or args.cache_calibrate:
            raise InvalidRequest("the --cache-* parameters need a method: give --cache first-block, mag or taylorseer")
        return None
    if args.cache_calibrate and args.cache != "mag":
        raise InvalidRequest("--cache-calibrate measures MagCache's curve; give it with --cache mag")
    ratios = None
    if args.cache == "mag" and not args.cache_calibrate:
        ratios = read_ratios(args.cache_mag_ratios) if args.cache_mag_ratios else stored_curve(args.model)
    return StepCacheConfig(args.cache, mag_ratios=ratios, calibrate=args.cache_calibrate, **given)


def read_ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequest(f"--cache-mag-ratios {text!r} is not a comma-separated list of numbers") from None


def stored_curve(model: str) -> tuple[float, ...]:
    path = curve_path(model)
    if not path.is_file():
        raise InvalidRequest(
            f"--cache mag needs {model}'s magnitude ratios: measure them once with --cache mag "
            f"--cache-calibrate (kept in {path}), or give --cache-mag-ratios"
        )
    try:
        return read_ratios(",".join(str(r) for r in json.loads(path.read_text())["mag_ratios"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise InvalidRequest(f"{path} holds no magnitude ratios; measure them again with --cache-calibrate") from None


def keep_curve(model: str, ratios: list[float]) -> Path:
    path = curve_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "mag_ratios": ratios}) + "\n")
    return path
