"""What the run configs share. Config files are loaded by file path, so each
config loads this one the same way (importlib, `common` in its namespace).

  settings_fields(c, cls)  a run's fields from its settings dataclass
                           (specjax.settings.RunSettings): one default each
  drafter_fields(c)        the drafting methods' fields (specjax.drafters.settings)
  apply_variants(c, arg)   the ':sample' / ':bf16' variants
  training_config(method)  the fields every drafter training config shares

The experiment mains turn these ConfigDicts into the settings dataclasses once
(`Settings.of(config)`); only configs and experiments import ml_collections.
"""

import ml_collections

from specjax.drafters.settings import DrafterSettings, config_defaults


def settings_fields(c, cls) -> None:
  """The fields of a run built on settings dataclass `cls` with its defaults
  (a None default is a placeholder typed by the field's annotation; the
  sampling settings flat, as temperature / top_k / top_p), plus the drafter
  fields when the settings hold a DrafterSettings."""
  for name, default in cls.config_defaults().items():
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
  """The fields every drafter's training config shares (configs/medusa.py,
  configs/eagle.py): target, self-distillation data, features, optimizer,
  checkpoint cadence. Each config adds its drafter's fields."""
  c = ml_collections.ConfigDict()
  c.method = method
  c.model = "smollm2-135m"
  c.dtype = "float32"
  # data
  c.sources = "alpaca,code_alpaca,gpteacher_code,gsm8k_train"
  c.num_examples = 600
  c.max_new_tokens = 192
  c.max_prompt_tokens = 192
  c.gen_batch_size = 8
  c.sample_fraction = 0.25
  c.valid_fraction = 0.05
  c.data_path = ""
  c.seed = 0
  # + this many datasets' reference answers (teacher-forced through the target:
  # one forward each instead of a generation)
  c.reference_examples = 0
  # features
  c.seq_len = 384
  c.feature_batch = 4
  # computed features are kept here and reused by runs over the same data ('' = off)
  c.feature_cache = "/tmp/specjax_train/features"
  # optimizer and cadence
  c.steps = 1500
  c.lr = 1e-3
  c.warmup = 50
  c.weight_decay = 0.0
  c.clip = 1.0
  c.eval_every = 250
  c.save_every = 250
  c.log_every = 25
  c.workdir = f"/tmp/specjax_train/{method}"
  # data-parallel over several processes of one JAX job on this machine
  # (experiments/train.py starts them; process 0 writes data, checkpoints and
  # the export): processes x local_devices devices on the `data` axis
  c.processes = 1
  c.local_devices = 0  # host CPU devices per process; 0: JAX's default
  c.update(overrides)
  return c
