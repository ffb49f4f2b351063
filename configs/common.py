"""What the run configs share. Config files are loaded by file path, so each
config loads this one the same way (importlib, `common` in its namespace).

  settings_fields(c, cls)  a run's fields from its settings dataclass
                           (specjax.settings.RunSettings): one default each
  drafter_fields(c)        the drafting methods' fields (specjax.drafters.settings)
  apply_variants(c, arg)   the ':sample' / ':bf16' variants
  training_config(method)  a drafter training config: the shared fields and
                           the method's own (specjax.training.settings)

The experiment mains turn these ConfigDicts into the settings dataclasses once
(`Settings.of(config)`); only configs and experiments import ml_collections.
"""

import ml_collections

from specjax.drafters.settings import DrafterSettings, config_defaults
from specjax.training.settings import TrainSettings


def settings_fields(c, cls, names=None) -> None:
  """The fields of a run built on settings dataclass `cls` with its defaults
  (a None default is a placeholder typed by the field's annotation; the
  sampling settings flat, as temperature / top_k / top_p), plus the drafter
  fields when the settings hold a DrafterSettings. `names`: only these
  fields, in this order."""
  defaults = cls.config_defaults()
  for name in defaults if names is None else names:
    default = defaults[name]
    setattr(c, name, default if default is not None else
            ml_collections.config_dict.placeholder(cls.field_type(name)))
  if any(cls.field_type(f) is DrafterSettings for f in cls.__dataclass_fields__):
    drafter_fields(c)


def drafter_fields(c) -> None:
  """The drafter fields every run config carries (DrafterSettings' defaults;
  None fields are typed placeholders; Lookahead's own fields are set per
  method with '@')."""
  for name, default in config_defaults().items():
    setattr(c, name, ml_collections.config_dict.placeholder(str) if default is None else default)


def apply_variants(c, arg, config_name: str) -> None:
  """The variants shared by run configs, combinable with '+': sample, bf16."""
  for variant in (arg or "").split("+"):
    if not variant:
      continue
    if variant == "sample":
      c.temperature, c.top_p = 0.7, 0.9
    elif variant == "bf16":
      c.dtype = "bfloat16"
    else:
      raise ValueError(f"unknown variant {variant!r} of {config_name} (sample, bf16)")


def training_config(method: str, **overrides):
  """A drafter's training config (configs/medusa.py, configs/eagle.py,
  configs/eagle3.py, configs/draft_model.py): the fields every training
  config shares (target, self-distillation data, features, optimizer,
  checkpoint cadence, processes) and the method's own, with their defaults
  from specjax.training.settings.TrainSettings; then `overrides`, the
  method's own choices (steps, lr, workdir, export, ...)."""
  c = ml_collections.ConfigDict()
  settings_fields(c, TrainSettings, TrainSettings.config_fields(method))
  c.method = method
  c.update(overrides)
  return c
