"""Drafting methods' settings: one dataclass (`DrafterSettings`) with every
field's one name and one default, read once at the boundary from a run's
config, a dict or None; the '@' method syntax ('eagle3_tree@tree_nodes=8')
applies to the same fields; the target's sampling settings from a config.

Configs carry these fields (configs/common.py adds `config_defaults()` to each
run config); the registry's builders read only a DrafterSettings.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

import numpy as np

from specjax import sampling as sampling_lib
from specjax.errors import ConfigValueError
from specjax.drafters.lookahead import Lookahead

LOOKAHEAD_METHODS = ("lookahead", "lookahead_tree")


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
  """Every drafting method's settings: one name and one default each (a method
  reads the ones it uses; the module docstring says which). `of(config)` builds
  them once, at the boundary, from a run's ConfigDict, a dict or None; the
  builders below read only these."""

  k: Any = 4  # draft length (a tree's depth)
  max_ngram: Any = 3  # prompt_lookup
  min_ngram: Any = 1  # prompt_lookup
  layers: Any = None  # layer_skip, e.g. '0-9' (None: the first third)
  draft_model: Any = None  # draft_model, e.g. 'self:10' (None: the shipped or 'self:L/3')
  checkpoint: Any = None  # trained drafters (None: the shipped checkpoint)
  draft_vocab: Any = None  # eagle(3), medusa, distilled draft model: 'full' or N tokens
  # draft_model, eagle(3) chains: dynamic draft length, stop drafting a row once the
  # product of the drafter's confidences in its guesses falls below this (0: off)
  draft_stop: Any = 0.0
  # trees (medusa_tree, ...): node budget, sibling draws (wor / iid / topk)
  tree_nodes: Any = 16
  tree_mode: Any = "wor"
  tree_topk: Any = 4  # eagle(3)_tree: children per expanded node
  tree_width: Any = 4  # eagle(3)_tree: nodes expanded per depth
  # Lookahead's own fields (`lookahead.Lookahead`; None: its defaults), set per
  # method: 'lookahead@window=4@ngram=3'
  window: Any = None
  ngram: Any = None
  max_candidates: Any = None
  pool_size: Any = None
  select: Any = None
  next_token: Any = None

  @classmethod
  def of(cls, config, overrides: Optional[dict] = None) -> "DrafterSettings":
    """From a ConfigDict, dict, object with these attributes, DrafterSettings
    or None (missing or None fields take the defaults), then `overrides`."""
    if isinstance(config, cls) and not overrides:
      return config
    values = {}
    for f in dataclasses.fields(cls):
      value = (overrides[f.name] if overrides and f.name in overrides
               else config_field(config, f.name))
      if value is not None:
        # numpy scalars from array-valued configs as plain Python numbers
        values[f.name] = value.item() if isinstance(value, np.generic) else value
    return cls(**values)


LOOKAHEAD_FIELDS = frozenset(f.name for f in dataclasses.fields(Lookahead) if f.init)
# The fields every run config carries (Lookahead's own are set per method with '@').
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(DrafterSettings)
                      if f.name not in ("window", "ngram", "max_candidates", "pool_size",
                                        "select", "next_token"))


def config_defaults() -> dict:
  """{field: default} for the fields a run config carries (None: unset, the
  method's own default)."""
  return {name: getattr(DrafterSettings, name) for name in CONFIG_FIELDS}


def _parse_value(text: str):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return {"None": None, "true": True, "false": False}.get(text, text)


_TRAINED = frozenset({"k", "checkpoint", "draft_vocab"})
_TREE = frozenset({"tree_nodes", "tree_mode"})
# The fields each built-in method reads. A '@' value of a field the method does
# not read is refused: it would be silently ignored ('draft_model@checkpoint=DIR'
# would run the shipped draft model; its directory is draft_model=DIR). Methods
# added with `registry.register` are not listed and take any field.
METHOD_FIELDS = {
    "prompt_lookup": frozenset({"k", "max_ngram", "min_ngram"}),
    "layer_skip": frozenset({"k", "layers"}),
    "draft_model": frozenset({"k", "draft_model", "draft_vocab", "draft_stop"}),
    "replay": frozenset({"k"}),
    "always_reject": frozenset({"k"}),
    "medusa": _TRAINED,
    "blockwise": _TRAINED,
    "eagle": _TRAINED | {"draft_stop"},
    "eagle3": _TRAINED | {"draft_stop"},
    "medusa_tree": _TRAINED | _TREE,
    "eagle_tree": _TRAINED | _TREE | {"tree_topk", "tree_width"},
    "eagle3_tree": _TRAINED | _TREE | {"tree_topk", "tree_width"},
    "lookahead": LOOKAHEAD_FIELDS | {"k"},
    "lookahead_tree": LOOKAHEAD_FIELDS - {"k"},  # a trie's depth is ngram - 1
}


def parse_method(method: str) -> tuple[str, dict]:
  """'eagle3_tree@tree_nodes=8@k=3' -> ('eagle3_tree', {'tree_nodes': 8, 'k': 3}).
  ValueError for a field that does not exist or that the method does not read."""
  base, *parts = str(method).split("@")
  allowed = set(CONFIG_FIELDS)
  if base in LOOKAHEAD_METHODS:
    allowed |= LOOKAHEAD_FIELDS
  names = base.split("+")  # a union reads what any of its parts reads
  reads = (frozenset().union(*(METHOD_FIELDS[n] for n in names))
           if all(n in METHOD_FIELDS for n in names) else None)
  overrides = {}
  for part in parts:
    key, sep, value = part.partition("=")
    if not sep or not key:
      raise ValueError(f"method {method!r}: each '@' must be followed by field=value, "
                       f"got {part!r}")
    if key not in allowed:
      raise ValueError(f"method {method!r}: unknown field {key!r}; fields: "
                       f"{', '.join(sorted(allowed))}")
    if reads is not None and key not in reads:
      raise ValueError(f"method {method!r}: {base} does not read {key!r}; its fields: "
                       f"{', '.join(sorted(reads))}")
    overrides[key] = _parse_value(value)
  return base, overrides


def method_config(method: str, config) -> tuple[str, DrafterSettings]:
  """(base method name, its DrafterSettings: the config's fields with the
  method's own '@' values applied)."""
  base, overrides = parse_method(method)
  refuse_unknown_keys(config, DICT_FIELDS, f"method {method!r}")
  return base, DrafterSettings.of(config, overrides)


# The keys a plain-dict drafter config may hold: the drafter's fields, the
# sampling settings (`sampling_of`) and the method's name.
DICT_FIELDS = frozenset(f.name for f in dataclasses.fields(DrafterSettings)) | {
    "temperature", "top_k", "top_p", "method"}


def refuse_unknown_keys(config, allowed, what: str) -> None:
  """ConfigValueError naming the keys of a plain dict `config` outside `allowed`.
  Only a plain dict is checked: a run's ConfigDict is checked by its flags, and
  a misspelled key of a dict would otherwise run the default silently."""
  if type(config) is not dict:  # pylint: disable=unidiomatic-typecheck
    return
  unknown = sorted(set(config) - set(allowed))
  if unknown:
    raise ConfigValueError(f"{what}: unknown setting(s) {', '.join(map(repr, unknown))}; "
                           f"settings: {', '.join(sorted(allowed))}")


def config_field(config, name: str, default=None):
  """config.name or config[name]; missing or None -> default."""
  if config is None:
    return default
  if isinstance(config, dict):
    value = config.get(name)
  else:
    try:
      value = getattr(config, name)
    except (AttributeError, KeyError):
      value = None
  return default if value is None else value


def sampling_of(config) -> sampling_lib.SamplingConfig:
  """The target's sampling settings named by a config (greedy when absent);
  ConfigValueError for values that are not numbers or out of range."""
  values = {name: config_field(config, name, default)
            for name, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0))}
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise ConfigValueError(f"{name} must be a number, got {value!r}")
  top_k = values["top_k"]
  if not math.isfinite(top_k) or float(top_k) != int(top_k):
    raise ConfigValueError(f"top_k must be a non-negative integer, got {top_k!r}")
  return sampling_lib.SamplingConfig(temperature=float(values["temperature"]),
                                     top_k=int(top_k), top_p=float(values["top_p"]))
