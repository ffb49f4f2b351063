"""Range checks for settings, with no dependency beyond specjax.errors (so
light modules such as the prompt-file reader can use them): each returns the
value or raises ConfigValueError naming the setting."""

from __future__ import annotations

import math
import numbers

from specjax.errors import ConfigValueError


def require_whole(name: str, value, low: int = 0, why: str = ""):
  """`value` if it is a whole number >= `low` (a bool is not); else
  ConfigValueError naming the setting (+ `why`)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ConfigValueError(f"{name} must be a whole number >= {low}, got {value!r}"
                           + (f" ({why})" if why else ""))
  return value


def require_real(name: str, value, low: float, high=None, *, low_open: bool = False,
                 high_open: bool = False, why: str = ""):
  """`value` if it is a finite number in the interval from `low` to `high`
  (None: unbounded), each end excluded if `*_open`; else ConfigValueError
  naming the setting and the interval."""
  ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or (value < high if high_open else value <= high)))
  if not ok:
    where = ("(" if low_open else "[") + f"{low:g}, " + (
        "inf)" if high is None else f"{high:g}" + (")" if high_open else "]"))
    raise ConfigValueError(f"{name} must be a finite number in {where}, got {value!r}"
                           + (f" ({why})" if why else ""))
  return value
