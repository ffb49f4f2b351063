"""A drafter training run's settings (`run.run`): one frozen dataclass with
the fields every training config shares and each drafter's own, one default
each. The training configs (configs/common.py `training_config`) carry the
shared fields and their method's (`config_fields`), and set the per-method
choices (steps, lr, workdir, export, ...) in configs/medusa.py, eagle.py,
eagle3.py and draft_model.py; `experiments/train.py` reads its ConfigDict
into these settings once (`TrainSettings.of(config)`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Dict, Optional, Tuple

from specjax.checks import require_real, require_whole
from specjax.errors import ConfigValueError
from specjax.settings import RunSettings

METHODS = ("medusa", "eagle", "eagle3", "draft_model")


@dataclasses.dataclass(frozen=True)
class TrainSettings(RunSettings):
  """One drafter training run (`specjax.training.run.run`)."""

  method: str = "medusa"  # medusa | eagle | eagle3 | draft_model
  model: str = "smollm2-135m"  # the target ('tiny': a small random one, for tests)
  dtype: str = "float32"
  # self-distillation data
  sources: str = "alpaca,code_alpaca,gpteacher_code,gsm8k_train"
  num_examples: int = 600  # 0: train on what the data file holds
  max_new_tokens: int = 192
  max_prompt_tokens: int = 192
  gen_batch_size: int = 8
  sample_fraction: float = 0.25
  valid_fraction: float = 0.05
  data_path: str = ""  # '': workdir/distill.jsonl
  # > 0: a fixed validation set of this many records, stratified by source
  # (else the records' hash split by valid_fraction)
  valid_sequences: int = 0
  # a JSON list of validation record ids (overrides the above; a scaling run
  # fixes its held-out set this way while the data grows)
  valid_ids_path: str = ""
  # > 0: train on the shortest prefix of the training records holding this
  # many answer tokens (nested subsets: a data-scaling curve)
  train_positions: int = 0
  # '' = every source; else train only on these (comma-separated; e.g.
  # 'alpaca,gsm8k_train,xsum': a data mix without code), validation unchanged
  train_sources: str = ""
  # the order the train_positions prefix is taken in: 'file' or 'sources'
  # (round-robin over the sources, so data appended per source is in every prefix)
  train_order: str = "file"
  seed: int = 0
  # + this many datasets' reference answers (teacher-forced through the target:
  # one forward each instead of a generation), added to the training records
  # after the selection above (train_sources' sources, else `sources`; never
  # validation)
  reference_examples: int = 0
  # Data grown on top of a run's (EAGLE / EAGLE-3), appended after it so the
  # run's cached feature shards still serve. grow_records: + the training
  # records after the train_positions prefix (the rest of the data file, after
  # the references). long_reference_examples: + up to this many reference
  # answers of `long_sources` whose prompts are longer than max_prompt_tokens
  # and at most long_prompt_tokens (e.g. whole XSum documents: the long inputs
  # of summarization and RAG that drafting meets). Grown sequences longer than
  # seq_len are kept whole, in feature shards of their own at long_seq_len.
  grow_records: bool = False
  long_reference_examples: int = 0
  long_sources: str = "xsum"
  long_prompt_tokens: int = 1024
  long_seq_len: int = 1280
  # features
  seq_len: int = 384
  feature_batch: int = 4
  # computed features are kept here and reused by runs over the same data ('' = off)
  feature_cache: str = "/tmp/specjax_train/features"
  # optimizer and cadence
  steps: int = 1500
  lr: float = 1e-3
  warmup: int = 50
  weight_decay: float = 0.0
  clip: float = 1.0
  # > 0: train this many epochs over the training answer positions instead of
  # `steps` (EAGLE / EAGLE-3, draft model, Medusa)
  epochs: float = 0.0
  # > 0: stop once this many evaluations in a row brought no new best tau
  patience: int = 0
  # an exported checkpoint of the same method and target to start from (a run
  # that continues on grown data); '' = a fresh initialisation
  init_from: str = ""
  eval_every: int = 250
  save_every: int = 250
  log_every: int = 25
  workdir: str = "/tmp/specjax_train/medusa"  # checkpoints, metrics; a run resumes from it
  # data-parallel over several processes of one JAX job on this machine
  # (experiments/train.py starts them; process 0 writes data, checkpoints and
  # the export): processes x local_devices devices on the `data` axis
  processes: int = 1
  local_devices: int = 0  # host CPU devices per process; 0: JAX's default
  # Medusa heads
  num_heads: int = 4
  decay: float = 0.8  # Medusa heads / EAGLE unrolled step s: loss weight decay**s
  batch_positions: int = 128
  valid_max_positions: int = 4096  # validation positions (0: all)
  # EAGLE / EAGLE-3 head (draft_vocab also the draft model's and Medusa's)
  draft_vocab: int = 0  # 0: the full vocabulary; else the N most frequent answer tokens
  ttt_steps: int = 1  # unrolled steps (EAGLE-3's training-time test)
  w_reg: float = 1.0  # EAGLE: feature regression (smooth L1)
  w_cls: float = 0.1
  noise: float = 0.1  # EAGLE: uniform feature noise U(-noise, noise)
  # EAGLE / EAGLE-3: dropout rate on the (fused) target features the head reads
  # (training only; 0 = off)
  feature_dropout: float = 0.0
  # 'sequence': whole sequences from position 0 (prompt + answer, one length
  # bucket per batch, batch_tokens positions), the prefix drafting sees;
  # 'window': random `window`-position windows near the answer, batch_windows a batch
  # the teacher's labels (EAGLE / EAGLE-3, draft model; Medusa: 0 = hard
  # labels, the tokens themselves): 0 = the full
  # distribution (the LM head at every step); K = its top K per position,
  # stored with the features (the mean covered mass on validation is reported)
  teacher_top_k: int = 0
  # >= 0 (or negative, from the end): start the head's layer as a copy of this
  # target layer (EAGLE-3: the fusion passes the high tap, the norm is the
  # target's final norm); None = a random layer
  head_init_layer: Optional[int] = None
  # EAGLE / EAGLE-3: the head's decoder layers (1: the papers' head)
  head_layers: int = 1
  context: str = "sequence"
  # the positions the loss covers: 'answer', or 'sequence' (every position
  # after the chat template's shared head, the prompt's included: the target's
  # distribution is a label at every position; needs context='sequence').
  # Validation and the epoch count stay on answer positions.
  loss_positions: str = "answer"
  # 'sequence' batches draw a length bucket in proportion to its 'answer'
  # positions, or to its 'loss' positions (with loss_positions='sequence':
  # every position trained on equally likely, the long prompts' included)
  bucket_weight: str = "answer"
  batch_tokens: int = 1024
  window: int = 128
  batch_windows: int = 4
  eval_k: int = 4  # EAGLE(-3), draft model: the tau estimate's chain length
  valid_max_windows: int = 48  # validation windows ('sequence': whole sequences; 0: all)
  train_eval_sequences: int = 0  # > 0: also the final estimate on this many training ones
  # distilled draft model
  draft_layers: int = 4
  init_layers: str = ""  # '' = the target's first draft_layers layers; else e.g. '0,1,2,29'
  loss: str = "kl"  # kl | tv | kl+tv against the target's T = 1 distributions
  batch_seqs: int = 4
  valid_max_seqs: int = 32  # validation sequences (0: all)
  # the exported weights' dtype (loading casts them to the target's dtype)
  store_dtype: str = "bfloat16"
  export: str = ""  # the exported drafter checkpoint ('': none)

  @classmethod
  def config_fields(cls, method: str) -> Tuple[str, ...]:
    """The fields a training config of `method` carries, in its order: the
    shared ones, the method's own, then `export`."""
    if method not in METHOD_FIELDS:
      raise ValueError(f"unknown drafter to train {method!r} (known: {', '.join(METHODS)})")
    return SHARED_FIELDS + METHOD_FIELDS[method] + ("export",)

  def check(self) -> None:
    """ConfigValueError (a ValueError) naming the first field out of its range
    (`run.run` calls it before any work: a negative count or a NaN learning
    rate otherwise ran, silently, as something else)."""
    if self.method not in METHODS:
      raise ConfigValueError(f"unknown drafter to train {self.method!r} (known: "
                             f"{', '.join(METHODS)})")
    for names, low in ((_AT_LEAST_ONE, 1), (_AT_LEAST_ZERO, 0)):
      for name in names:
        require_whole(name, getattr(self, name), low)
    for name, low, high, low_open, high_open in _REALS:
      require_real(name, getattr(self, name), low, high, low_open=low_open, high_open=high_open)
    if self.head_init_layer is not None and (
        isinstance(self.head_init_layer, bool)
        or not isinstance(self.head_init_layer, numbers.Integral)):
      raise ConfigValueError(f"head_init_layer must be a layer index or None, got "
                             f"{self.head_init_layer!r}")

  def config(self) -> Dict[str, Any]:
    """{field: value} of this run's method's config fields (the exported
    checkpoint's card records them)."""
    return {name: getattr(self, name) for name in self.config_fields(self.method)}


# the ranges `check` holds the fields to
_AT_LEAST_ONE = ("max_new_tokens", "max_prompt_tokens", "gen_batch_size", "long_prompt_tokens",
                 "long_seq_len", "seq_len", "feature_batch", "steps", "eval_every", "save_every",
                 "log_every", "processes", "num_heads", "batch_positions",
                 "ttt_steps", "head_layers", "batch_tokens", "window", "batch_windows",
                 "eval_k", "draft_layers", "batch_seqs")
# (0 means: all / none / off / the default, as each field's comment says)
_AT_LEAST_ZERO = ("num_examples", "valid_sequences", "train_positions", "seed",
                  "reference_examples", "long_reference_examples", "warmup", "patience",
                  "local_devices", "draft_vocab", "teacher_top_k", "train_eval_sequences",
                  "valid_max_positions", "valid_max_windows", "valid_max_seqs")
# (name, low, high or None, low excluded, high excluded)
_REALS = (("lr", 0.0, None, True, False), ("weight_decay", 0.0, None, False, False),
          ("clip", 0.0, None, True, False), ("epochs", 0.0, None, False, False),
          ("decay", 0.0, None, True, False), ("w_reg", 0.0, None, False, False),
          ("w_cls", 0.0, None, False, False), ("noise", 0.0, None, False, False),
          ("feature_dropout", 0.0, 1.0, False, True),
          ("sample_fraction", 0.0, 1.0, False, False),
          ("valid_fraction", 0.0, 1.0, False, True))

_EAGLE = ("draft_vocab", "ttt_steps", "w_reg", "w_cls", "noise", "feature_dropout", "decay",
          "teacher_top_k",
          "head_init_layer", "head_layers",
          "context", "loss_positions", "bucket_weight", "batch_tokens", "window", "batch_windows",
          "eval_k", "valid_max_windows", "train_eval_sequences",
          "grow_records", "long_reference_examples", "long_sources", "long_prompt_tokens",
          "long_seq_len")
# each method's own fields (the others of its config are shared)
METHOD_FIELDS = {
    "medusa": ("num_heads", "decay", "batch_positions", "valid_max_positions", "draft_vocab",
               "teacher_top_k"),
    "eagle": _EAGLE,
    "eagle3": _EAGLE,
    "draft_model": ("draft_layers", "init_layers", "loss", "draft_vocab", "teacher_top_k",
                    "loss_positions", "batch_seqs", "eval_k", "valid_max_seqs", "store_dtype"),
}
_OWN = {name for names in METHOD_FIELDS.values() for name in names} | {"export"}
SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(TrainSettings) if f.name not in _OWN)
