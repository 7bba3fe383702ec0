"""Options declared on their records' fields (``option``) and the flags derived from them; imports none of them."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paradit.errors import InvalidRequest

GENERATE, SERVE, PLAN = "generate", "serve", "plan"
RUN = (GENERATE, SERVE, PLAN)  # what chooses how a run executes: generate runs it, serve its groups, plan predicts it
OPTION = "paradit_option"  # the key of a field's metadata that holds its ``Flag``
REQUIRED = object()  # ``option``'s default for a field that has none


@dataclass(frozen=True)
class Flag:
    """How the command line spells an option; ``http``: the field's JSON type and pydantic constraints (``routes``)."""

    help: str
    name: str | None = None
    commands: tuple[str, ...] = RUN
    group: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    action: str | type[argparse.Action] | None = None
    metavar: str | None = None
    nargs: str | None = None  # "?": a flag that may stand alone, meaning ``const``
    const: Any = None
    required: bool = False
    absent: Any = None  # what argparse answers when the flag is absent (None: the field's own default)
    convert: Callable[[Any], Any] | None = None
    remote: str | None = None  # set by ``flag_of``: the body's field, the field's name where ``http`` is set
    http: tuple[Any, dict[str, Any]] | None = None
    routes: tuple[str, ...] = ("images", "edits", "videos")

    def add_to(self, parser: Any, dest: str) -> None:
        keywords = {"type": self.type, "choices": self.choices, "metavar": self.metavar, "action": self.action}
        keywords |= {"nargs": self.nargs, "const": self.const}
        keywords = {key: value for key, value in keywords.items() if value is not None}
        if self.action is None and self.choices is None and self.metavar is None:  # named as the flag, not the field
            keywords["metavar"] = self.name.removeprefix("--").replace("-", "_").upper()
        if self.required:
            keywords["required"] = True
        parser.add_argument(self.name, dest=dest, default=self.absent, help=self.help, **keywords)


def option(default: Any = None, *, factory: Callable[[], Any] | None = None, **flag: Any) -> Any:
    """A record's field declared as the option ``Flag(**flag)`` (no flag: a field the Python API sets alone)."""
    metadata = {OPTION: Flag(**flag)} if flag else {}
    if default is REQUIRED:
        return field(metadata=metadata)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


generate_option = functools.partial(option, commands=(GENERATE,))
serve_option = functools.partial(option, commands=(SERVE,))


def flag_of(each: dataclasses.Field) -> Flag | None:
    """The flag a field declares, named, and its ``remote`` name where the HTTP bodies take it."""
    flag = each.metadata.get(OPTION)
    if flag is None:
        return None
    name = flag.name or "--" + each.name.replace("_", "-")
    return dataclasses.replace(flag, name=name, remote=each.name if flag.http is not None else None)


def flagged_fields(record: type, command: str) -> list[tuple[dataclasses.Field, Flag]]:
    found = [(each, flag_of(each)) for each in dataclasses.fields(record)]
    return [(each, flag) for each, flag in found if flag is not None and command in flag.commands]


def add_flags(parser: argparse.ArgumentParser, command: str, *records: type) -> None:
    groups: dict[str | None, Any] = {None: parser}
    for record in records:
        for each, flag in flagged_fields(record, command):
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            flag.add_to(groups[flag.group], each.name)


def from_args(record: type, args: argparse.Namespace, command: str, **fields: Any) -> Any:
    for each, flag in flagged_fields(record, command):
        if (value := getattr(args, each.name, None)) is not None and each.name not in fields:
            fields[each.name] = flag.convert(value) if flag.convert else value
    return record(**fields)


def flags_given(args: argparse.Namespace, command: str, *records: type) -> dict[str, Any]:
    found = {}
    for record in records:
        for each, flag in flagged_fields(record, command):
            if (value := getattr(args, each.name, None)) is not None and value != flag.absent:
                found[flag.name] = value
    return found


def check_choices(record: Any) -> None:
    """Refuse a value set through the Python API that its field's flag does not allow."""
    for each in dataclasses.fields(record):
        flag, value = flag_of(each), getattr(record, each.name)
        if flag is not None and flag.choices and isinstance(value, str) and value not in flag.choices:
            raise InvalidRequest(f"{flag.name} {value!r} is not allowed; choose one of {', '.join(flag.choices)}")


def whole_number(text: str, problem: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}") from None


def at_least(least: int, text: str) -> int:
    if (value := whole_number(text, "is not a whole number")) < least:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give {least} or more")
    return value


positive = functools.partial(at_least, 1)
nonnegative = functools.partial(at_least, 0)


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
