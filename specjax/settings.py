"""Run settings: one frozen dataclass per entry point, read once at the boundary.

Every run entry point of the library (`runner.generate`, the benchmarks, the
paper tables, the peers, the invariance runs, the exactness matrix, data
generation, drafter training) takes its settings as a frozen dataclass that
subclasses `RunSettings`: each field has one name, one type and one default,
written once, in the dataclass. The config files (`configs/`) build their
ConfigDicts from those defaults (`config_defaults`), and the experiment mains
turn the parsed ConfigDict into the dataclass once (`Settings.of(config)`);
nothing in `specjax/` reads a ConfigDict after that.

Two fields are nested: a field typed `SamplingConfig` is read from the flat
config fields temperature / top_k / top_p, and a field typed `DrafterSettings`
from the drafter fields every run config carries (`configs/common.py`). Their
flat view (`flat`) is what result logs hash and record, so the records of a
run keep the names of the config fields that set them.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict

from specjax import sampling as sampling_lib
from specjax.drafters.settings import (DrafterSettings, config_field, refuse_unknown_keys,
                                      sampling_of)

_NESTED = (sampling_lib.SamplingConfig, DrafterSettings)


@functools.lru_cache(maxsize=None)
def _hints(cls) -> Dict[str, Any]:
  return typing.get_type_hints(cls)


def _nested_kind(cls, name: str):
  hint = _hints(cls)[name]
  return hint if hint in _NESTED else None


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """Base of the run settings dataclasses (fields in the subclasses)."""

  @classmethod
  def of(cls, config, **overrides):
    """From a run config (ConfigDict, mapping, this dataclass or any object
    with these fields as attributes), then `overrides` (field=value).

    Missing or None fields take the dataclass's defaults; a SamplingConfig
    field is read from temperature / top_k / top_p (greedy when absent), a
    DrafterSettings field from the drafter fields. A plain dict with a key
    that is none of these is refused (ConfigValueError naming it). A dataclass
    of this class is returned as it is (with the overrides replaced in)."""
    if isinstance(config, cls):
      return dataclasses.replace(config, **overrides) if overrides else config
    if isinstance(config, RunSettings):  # another run's settings: by their flat names
      config = config.flat()
    else:
      refuse_unknown_keys(config, cls.dict_fields(), cls.__name__)
    values = {}
    for f in dataclasses.fields(cls):
      kind = _nested_kind(cls, f.name)
      if kind is sampling_lib.SamplingConfig:
        values[f.name] = sampling_of(config)
      elif kind is DrafterSettings:
        values[f.name] = DrafterSettings.of(config)
      else:
        value = config_field(config, f.name)
        if value is not None:
          values[f.name] = value
    values.update(overrides)
    return cls(**values)

  @classmethod
  def config_defaults(cls) -> Dict[str, Any]:
    """{field: default} of a run config built on these settings, flat: a
    SamplingConfig field as temperature / top_k / top_p; a DrafterSettings
    field is left out (configs/common.py adds the drafter fields)."""
    out = {}
    for f in dataclasses.fields(cls):
      kind = _nested_kind(cls, f.name)
      default = _default(f)
      if kind is sampling_lib.SamplingConfig:
        out.update(temperature=default.temperature, top_k=default.top_k, top_p=default.top_p)
      elif kind is None:
        out[f.name] = default
    return out

  @classmethod
  def dict_fields(cls) -> frozenset:
    """The keys a plain-dict config of these settings may hold: the flat
    field names, a DrafterSettings field's drafter fields included."""
    names = set(cls.config_defaults())
    for f in dataclasses.fields(cls):
      if _nested_kind(cls, f.name) is DrafterSettings:
        names |= {d.name for d in dataclasses.fields(DrafterSettings)}
    return frozenset(names)

  @classmethod
  def field_type(cls, name: str):
    """The type a config placeholder of field `name` holds (Optional[T] -> T)."""
    hint = _hints(cls)[name]
    args = [t for t in typing.get_args(hint) if t is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and args else hint

  def flat(self) -> Dict[str, Any]:
    """The settings as one flat dict of config field names: the sampling
    settings as temperature / top_k / top_p, the drafter's by their names."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, sampling_lib.SamplingConfig):
        out.update(temperature=value.temperature, top_k=value.top_k, top_p=value.top_p)
      elif isinstance(value, DrafterSettings):
        out.update(dataclasses.asdict(value))
      else:
        out[f.name] = value
    return out


def _default(f: dataclasses.Field):
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  raise TypeError(f"settings field {f.name!r} has no default")


def require(settings, cls, entry_point: str):
  """`settings` if it is a `cls`; TypeError naming the entry point otherwise
  (a ConfigDict is turned into settings once, by `cls.of(config)`)."""
  if not isinstance(settings, cls):
    raise TypeError(f"{entry_point} takes a {cls.__name__} ({cls.__name__}.of(config) reads a "
                    f"run config), got {type(settings).__name__}")
  return settings
