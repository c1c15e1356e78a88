"""The values the command line takes, read and checked where they are parsed: durations as
kubectl writes them (`10m`, `1h30m`, `90s`), `-o` formats, `wait --for` targets, and the
positive numbers and KEY=VALUE pairs of submit. Each raises argparse.ArgumentTypeError with a
message naming what it wants, so argparse prints a usage error (exit 2)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from accelerate_operator.constants import CONDITION_TYPES

from .jsonpath import Template, TemplateError, compile_template

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def duration(value: str) -> float:
    """Seconds, from a Go duration as kubectl takes it (`10m`, `1h30m`, `2.5s`, `0`)."""
    text = value.strip()
    if text == "0":
        return 0.0
    if not text or _DURATION_PART.sub("", text) != "":
        raise argparse.ArgumentTypeError(
            f"must be a duration with its unit, such as 30s, 10m or 1h30m, not {value!r}")
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(text))


def positive(value: str, what: str = "a positive integer") -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be {what}, not {value!r}")
    return number


def procs(value: str) -> int | str:
    return value if value == "auto" else positive(value, "a positive integer or auto")


def env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {value!r}")
    return key, val


@dataclass(frozen=True)
class Output:
    """An `-o` format: its kind (`json`, `wide`, `jsonpath`...) and, for jsonpath, the template."""

    kind: str
    template: Template | None = None


def output(value: str) -> Output:
    kind, sep, template = value.partition("=")
    if kind != "jsonpath":
        if sep:
            raise argparse.ArgumentTypeError(f"{kind} takes no =VALUE (only jsonpath= does)")
        return Output(kind)
    try:
        return Output(kind, compile_template(template))
    except TemplateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class WaitFor:
    """What `wait --for` waits for: a condition True, a JSONPath value, or the job gone."""

    kind: str  # condition, jsonpath or delete
    condition: str | None = None
    template: Template | None = None
    value: str | None = None  # None: the path has any value

    def describe(self) -> str:
        if self.kind == "condition":
            return f"condition met: {self.condition}"
        if self.kind == "jsonpath":
            want = "" if self.value is None else f"={self.value}"
            return f"condition met: jsonpath {self.template.source}{want}"
        return "deleted"


def wait_for(value: str) -> WaitFor:
    """`condition=Succeeded`, `jsonpath={.status.phase}=Running` or `delete`, as kubectl's."""
    kind, sep, rest = value.partition("=")
    if value == "delete":
        return WaitFor("delete")
    if kind == "jsonpath" and sep:
        return _jsonpath_target(rest)
    condition = rest if kind == "condition" and sep else None
    if condition not in CONDITION_TYPES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: wait for condition=TYPE (TYPE one of {', '.join(CONDITION_TYPES)}), "
            "jsonpath='{.status.phase}'=VALUE, or delete")
    return WaitFor("condition", condition=condition)


def _jsonpath_target(rest: str) -> WaitFor:
    close = rest.rfind("}")
    path, value = (rest[:close + 1], rest[close + 1:]) if close >= 0 else rest.partition("=")[::2]
    if close >= 0:
        if value and not value.startswith("="):
            raise argparse.ArgumentTypeError(
                f"jsonpath={rest}: put = between the path and the value, "
                "e.g. jsonpath='{.status.phase}'=Running")
        value = value[1:] if value else None
    try:
        return WaitFor("jsonpath", template=compile_template(path), value=value or None)
    except TemplateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
