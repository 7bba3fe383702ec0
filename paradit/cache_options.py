"""The command line's step cache, and MagCache's calibrated curves, kept per model for the next ``--cache mag``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

from paradit.errors import InvalidRequest
from paradit.flags import GENERATE, flagged_fields, flags_given, from_args
from paradit.request import CACHE_PARAMETERS, StepCacheConfig


def curve_path(model: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paradit" / "mag_ratios"
    return root / (re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model) + ".json")


def cache_config(args: argparse.Namespace) -> StepCacheConfig | None:
    """The flags' step cache (None without ``--cache``); a parameter flag without ``--cache`` is refused."""
    if args.method is None:
        if flags_given(args, GENERATE, StepCacheConfig):
            raise InvalidRequest("the --cache-* parameters need a method: give --cache first-block, mag or taylorseer")
        return None
    if args.calibrate and args.method != "mag":
        raise InvalidRequest("--cache-calibrate measures MagCache's curve; give it with --cache mag")
    fields = {flag.name: each.name for each, flag in flagged_fields(StepCacheConfig, GENERATE)}
    reads = [name for name, field in fields.items() if field in CACHE_PARAMETERS[args.method]]
    for name in flags_given(args, GENERATE, StepCacheConfig):
        if name != "--cache" and name not in reads:
            raise InvalidRequest(f"{name} is not a parameter of --cache {args.method}, which reads {', '.join(reads)}")
    config = from_args(StepCacheConfig, args, GENERATE)
    if config.method == "mag" and not config.calibrate and config.mag_ratios is None:
        if (ratios := kept_curve(args.model)) is None:
            raise InvalidRequest(
                f"--cache mag needs {args.model}'s magnitude ratios: measure them once with --cache mag "
                f"--cache-calibrate (kept in {curve_path(args.model)}), or give --cache-mag-ratios"
            )
        config = dataclasses.replace(config, mag_ratios=ratios)
    return config


def kept_curve(model: str) -> tuple[float, ...] | None:
    path = curve_path(model)
    if not path.is_file():
        return None
    try:
        return tuple(float(ratio) for ratio in json.loads(path.read_text())["mag_ratios"])
    except (OSError, ValueError, KeyError, TypeError):
        raise InvalidRequest(f"{path} holds no magnitude ratios; measure them again with --cache-calibrate") from None


def keep_curve(model: str, ratios: list[float]) -> Path:
    path = curve_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "mag_ratios": ratios}) + "\n")
    return path
