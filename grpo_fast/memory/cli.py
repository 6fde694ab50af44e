"""Input checks for command lines (the estimator's and the examples'): each numeric flag's values, one-line errors.

    RANGES = {"micro_batch_size": Range(1, 1024), "beta": Range(0.0)}
    add_ranges_to_help(parser, RANGES)   # each numeric flag's --help says what it accepts
    args = parser.parse_args(argv)
    check_numbers(PROG, args, RANGES)    # InputError: one line on stderr, exit status 2
    fail(PROG, "--heads x: expected ...")

An ``InputError`` is a ``SystemExit`` with status 2 (argparse's for a usage error) whose one-line message is on
stderr already: no traceback, and nothing slow has run.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

__all__ = ["InputError", "Range", "add_ranges_to_help", "check_numbers", "fail", "flag"]


class InputError(SystemExit):
    """Exit status 2 for input that cannot work; ``message`` is the one line printed on stderr."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: ``low`` <= value (<, ``low_open``), value <= ``high`` (<, ``high_open``),
    finite, or one of the special values ``also`` ({value: meaning})."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: dict = field(default_factory=dict)

    def accepts(self, value) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"
        if self.low is not None and self.high is not None:
            text = (
                f"{kind} in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {_number(self.high)}"
        else:
            text = f"a finite {kind.removeprefix('a ').removeprefix('an ')}"
        return text + "".join(f", or {_number(v)} ({meaning})" for v, meaning in self.also.items())


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def add_ranges_to_help(parser, ranges: dict) -> None:
    """Append "accepts ..." to the --help text of each flag in ``ranges`` (its type says integer or number)."""
    for action in parser._actions:
        if action.dest in ranges:
            accepts = (
                "accepts "
                + ranges[action.dest].describe(action.type is int)
                + (f"; default {_number(action.default)}" if action.default is not None else "")
            )
            action.help = f"{action.help}; {accepts}" if action.help else accepts


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_numbers(prog, args, ranges: dict) -> None:
    """A one-line ``InputError`` for the first numeric flag outside its range (flags left at None are not given)."""
    for dest, accepted in ranges.items():
        value = getattr(args, dest)
        if value is not None and not accepted.accepts(value):
            fail(prog, f"{flag(dest)} {_number(value)}: expected {accepted.describe(isinstance(value, int))}")


def fail(prog: str, message) -> None:
    """Stop with one line on stderr that says what to pass instead (no traceback), exit status 2."""
    line = f"{prog}: error: {message}"
    print(line, file=sys.stderr, flush=True)
    raise InputError(line)
