"""What every benchmark's report shares: ratios and number formatting that
tolerate missing values, quartiles, EOS trimming, the run's settings, the code
(git commit) and hardware it ran on, and a wall clock for progress lines.
Used by the Spec-Bench protocol, the paper tables, the peers comparison, the
AR benchmark and the generate experiment."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import subprocess
from typing import List, Mapping, Optional, Sequence

import jax


def ratio(a, b, missing=float("nan")):
  """a / b, or `missing` when b is 0 / None or either is None or not finite."""
  if a is None or b is None or not b or not (math.isfinite(a) and math.isfinite(b)):
    return missing
  return a / b


def fmt(x, spec: str = "{:.2f}", suffix: str = "") -> str:
  """`spec` applied to x (plus `suffix`), or '-' for None / NaN / inf."""
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  return spec.format(x) + suffix


def quartiles(values: Sequence[float]) -> list:
  """[q1, q3] of the finite values ([None, None] when there are none)."""
  v = sorted(x for x in values if math.isfinite(x))
  if not v:
    return [None, None]
  if len(v) == 1:
    return [v[0], v[0]]
  q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
  return [q1, q3]


def median(values: Sequence[float]) -> Optional[float]:
  """The median of the finite values (None when there are none)."""
  v = [x for x in values if x is not None and math.isfinite(x)]
  return statistics.median(v) if v else None


def upto_eos(tokens: Sequence[int], eos_id: int) -> list:
  """Tokens up to and including the first EOS (every system stops there)."""
  tokens = list(tokens)
  return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
  """The first position where two token sequences differ (the shorter one's
  length when one is a prefix of the other); None when they are equal."""
  if list(a) == list(b):
    return None
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def config_settings(c, names: Sequence[str]) -> dict:
  """The named fields of a run config (None where absent): what a resumed
  log's records must match. `c`: a ConfigDict, a dataclass, a mapping or any
  object with the fields as attributes."""
  if isinstance(c, Mapping):
    return {k: c.get(k) for k in names}
  return {k: getattr(c, k, None) for k in names}


def as_dict(c) -> dict:
  """A run config's fields as a plain dict (for result records): a ConfigDict,
  a dataclass, a mapping or any object with attributes."""
  if dataclasses.is_dataclass(c) and not isinstance(c, type):
    return dataclasses.asdict(c)
  if hasattr(c, "to_dict"):
    return c.to_dict()
  if isinstance(c, Mapping):
    return dict(c)
  return dict(vars(c))


def git_commit() -> Optional[str]:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__),
                          capture_output=True, text=True, check=True,
                          timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def hardware() -> dict:
  dev = jax.devices()[0]
  return {"platform": platform.platform(), "machine": platform.machine(),
          "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
          "device_kind": dev.device_kind, "jax": jax.__version__}


def comma_list(text) -> List[str]:
  """A comma-separated setting ('a, b,,c') as its non-empty, stripped names."""
  return [x.strip() for x in str(text).split(",") if x.strip()]


def clock(s: float) -> str:
  """Seconds as '4m05s' or '1h02m'."""
  s = int(s)
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
