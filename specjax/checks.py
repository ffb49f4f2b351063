"""Range checks for settings, with no dependency beyond specjax.errors (so
light modules such as the prompt-file reader can use them): each returns the
value or raises ConfigValueError naming the setting."""

from __future__ import annotations

import math
import numbers
from typing import List, Optional

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


def require_whole_list(name: str, spec, low: int = 1, high: Optional[int] = None,
                       why: str = "", distinct: bool = False) -> List[int]:
  """The comma-separated whole numbers of `spec` (blanks skipped, '_' allowed
  as in '46_000'), each >= `low` (and <= `high`); else ConfigValueError
  naming the setting and the item (+ `why`). distinct: repeats dropped, the
  first kept in place."""
  out = []
  for item in (s.strip() for s in str(spec).split(",")):
    if not item:
      continue
    try:
      value = int(item.replace("_", ""))
    except ValueError:
      value = None
    if value is None or value < low or (high is not None and value > high):
      raise ConfigValueError(f"{name}={spec!r}: {item!r} is not a whole number >= {low}"
                             + (f" and <= {high}" if high is not None else "")
                             + (f" ({why})" if why else ""))
    out.append(value)
  if not out:
    raise ConfigValueError(f"{name}={spec!r}: no {name}" + (f" ({why})" if why else ""))
  return list(dict.fromkeys(out)) if distinct else out
