"""One definition per command-line option: a ``TrainConfig`` field says its flag, its help, how
its text is read and how its value is checked; ``zbuf.cli`` builds argparse from the fields.

[Note: one definition per option]
An option used to live in three places: an ``add_argument`` in cli.py, a ``TrainConfig`` field
and a check in ``TrainConfig.validate`` (``--mem-frac`` was range-checked twice, by a parser of
its own and by ``validate``, with two messages). Now the field carries a ``CliOption`` in its
metadata. Its ``check`` (``Check``) is the only place a value's range is decided: argparse's
``type=`` reads the text and calls it (so a bad value stops at parse time, exit 2), and
``validate`` calls it on every field set from Python, with the same message. Options that are
not one field (``--model`` fills ``preset`` or ``hf_model``; ``--engine``/``--engines`` fill
``engines`` and ``engine_ac``; ``bench --merge`` runs nothing) stay in cli.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, NamedTuple, Optional

from .errors import ConfigError

__all__ = ["Check", "CliOption", "option", "cli_option", "POSITIVE_INT", "INTEGER",
           "NON_NEGATIVE_INT", "FRACTION", "POSITIVE_NUMBER", "SECONDS", "BYTES", "NAME_LIST",
           "parse_bytes"]


class Check(NamedTuple):
    """How one kind of value is read from text and what it must satisfy."""

    read: Callable[[str], Any]
    """Text -> value; raises ``ValueError`` when the text is not such a value."""
    ok: Callable[[Any], bool]
    """Whether a value (read from text or set from Python) is acceptable."""
    wants: str
    """What the option must be, for the message: ``a positive integer``."""
    out_of_range: Optional[str] = None
    """The message's end for a value of the right type outside the range, when ``must be
    <wants>`` would not say what the option means."""

    def parse(self, flag: str, text: str) -> Any:
        try:
            value = self.read(text)
        except ValueError:
            raise ConfigError(f"{flag} must be {self.wants}, got {text!r}") from None
        self.check(flag, value)
        return value

    def check(self, flag: str, value: Any) -> None:
        if value is not None and not self.ok(value):
            if self.out_of_range and _is_number(value):
                raise ConfigError(f"{flag} {value} is out of range: {self.out_of_range}")
            raise ConfigError(f"{flag} must be {self.wants}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE_INT = Check(int, lambda v: _is_int(v) and v >= 1, "a positive integer")
INTEGER = Check(int, _is_int, "an integer")
NON_NEGATIVE_INT = Check(int, lambda v: _is_int(v) and v >= 0, ">= 0")
FRACTION = Check(float, lambda v: _is_number(v) and 0.0 < v <= 1.0, "a number in (0, 1]",
                 "a fraction of the GPU's memory in (0, 1], e.g. 0.68")
POSITIVE_NUMBER = Check(float, lambda v: _is_number(v) and v > 0, "a positive number")
SECONDS = Check(float, lambda v: _is_number(v) and v > 0, "a positive number of seconds")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"8GiB"``, ``"1.5g"``, ``"1000000"`` -> bytes (binary for K/M/G/T and *iB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a byte count; write e.g. 8GiB, 512MiB or "
                          f"1073741824")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"byte count {text!r} must be positive")
    return value


class _ByteCheck(Check):
    def parse(self, flag: str, text: str) -> Any:
        try:
            return parse_bytes(text)
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None


BYTES = _ByteCheck(parse_bytes, lambda v: _is_int(v) and v > 0, "a positive byte count")
NAME_LIST = Check(lambda t: tuple(n.strip() for n in t.split(",") if n.strip()),
                  lambda v: isinstance(v, tuple), "a comma-separated list")


@dataclasses.dataclass(frozen=True)
class CliOption:
    """The command-line side of one ``TrainConfig`` field."""

    help: str
    group: str = "system"
    """The ``--help`` section: model, training, system or checkpoints."""
    flag: Optional[str] = None
    """Default: ``--`` + the field name with dashes."""
    check: Optional[Check] = None
    """Reads and checks the value (argparse's ``type=`` and ``TrainConfig.validate`` alike)."""
    choices: Optional[tuple[str, ...]] = None
    metavar: Optional[str] = None
    commands: tuple[str, ...] = ("train", "bench")
    """The subcommands that have this option."""
    help_for: dict = dataclasses.field(default_factory=dict)
    """Command -> its own help, where the option means or defaults to something else there
    (``zbuf fit``'s probes run 5 steps, not 30)."""
    argparse: dict = dataclasses.field(default_factory=dict)
    """Anything else ``add_argument`` takes (``action``, ``nargs``, ``const``)."""

    def flag_of(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")

    def validate(self, name: str, value: Any) -> None:
        """``ConfigError`` unless ``value`` (of field ``name``) passes the check and choices."""
        if value is None:
            return
        if self.check is not None:
            self.check.check(self.flag_of(name), value)
        if self.choices is not None and getattr(value, "value", value) not in self.choices:
            raise ConfigError(f"{self.flag_of(name)} must be one of {', '.join(self.choices)}, "
                              f"got {value!r}")


def option(default: Any = None, help: str = "", **cli: Any) -> Any:
    """A ``TrainConfig`` field with a command-line option (``CliOption``'s fields as keywords)."""
    meta = {"cli": CliOption(help=help, **cli)}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def cli_option(f: dataclasses.Field) -> Optional[CliOption]:
    """The field's ``CliOption``, if it has one."""
    return f.metadata.get("cli")
