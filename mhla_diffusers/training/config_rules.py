"""The typed rules of the training config's keys (:mod:`mhla_diffusers.training.config` holds the table): a choice,
an integer bound, a boolean, a number range. Every refusal is one line naming the key and what it must be."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import yaml

__all__ = ["Choice", "Integer", "Boolean", "Number"]


@dataclass(frozen=True)
class Choice:
    """One of ``choices`` (or null when ``nullable``)."""

    choices: tuple
    nullable: bool = False

    def check(self, name: str, value: Any) -> Any:
        """``value``, or the choice YAML 1.1 read as this boolean; raises ``ValueError`` otherwise."""
        if isinstance(value, bool):
            # YAML 1.1 reads no / off / yes / on as booleans (`mixed_precision: no` arrives as False):
            # the one choice that YAML reads as this boolean is what was written.
            spelled = [c for c in self.choices if isinstance(c, str) and yaml.safe_load(c) is value]
            if len(spelled) == 1:
                value = spelled[0]
        if (value is None and self.nullable) or (not isinstance(value, bool) and value in self.choices):
            return value
        raise ValueError(f"{name} must be one of {list(self.choices)}{' or null' if self.nullable else ''}; got {value!r}")


def _refusal(name: str, wanted: str, nullable: bool, note: str, value: Any) -> ValueError:
    """The one-line error of a rule: ``<name> must be <wanted>[ or null][ (<note>)]; got <value>``."""
    return ValueError(f"{name} must be {wanted}{' or null' if nullable else ''}{f' ({note})' if note else ''}; got {value!r}")


@dataclass(frozen=True)
class Integer:
    """An integer (not a boolean) ``>= minimum`` (1: "a positive integer"), or null when ``nullable``; ``note``
    (what 0 / null mean) is said in the error."""

    minimum: int
    nullable: bool = False
    note: str = ""

    def check(self, name: str, value: Any) -> Any:
        """``value`` unchanged; raises ``ValueError`` when it breaks the rule."""
        if value is None and self.nullable:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= self.minimum:
            return value
        wanted = "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"
        raise _refusal(name, wanted, self.nullable, self.note, value)


@dataclass(frozen=True)
class Boolean:
    """``true`` or ``false`` (YAML booleans; not 0 / 1 or strings), or null when ``nullable``."""

    nullable: bool = False

    def check(self, name: str, value: Any) -> Any:
        """``value`` unchanged; raises ``ValueError`` unless it is a boolean (or an allowed null)."""
        if isinstance(value, bool) or (value is None and self.nullable):
            return value
        raise ValueError(f"{name} must be true or false{' or null' if self.nullable else ''}; got {value!r}")


@dataclass(frozen=True)
class Number:
    """A finite number (numeric strings accepted: PyYAML reads ``1e-4`` as a string; booleans, NaN and
    infinities refused) for which ``valid`` holds (``bound`` says it in words: ``"a finite number > 0"``);
    null when ``nullable``; ``note`` (what 0 / null mean) is said in the error."""

    valid: Callable[[float], bool] = lambda v: True
    bound: str = "a finite number"
    nullable: bool = False
    note: str = ""

    def check(self, name: str, value: Any) -> Any:
        """``float(value)`` (or None); raises ``ValueError`` when it is not a finite number or out of bounds."""
        if value is None and self.nullable:
            return None
        try:
            if isinstance(value, bool):  # YAML's true / false: not a number (float(True) would be 1.0)
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number; got {value!r}") from None
        if not (math.isfinite(number) and self.valid(number)):
            raise _refusal(name, self.bound, self.nullable, self.note, number)
        return number
