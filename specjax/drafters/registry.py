"""Drafters by name: one place that turns a config's method name and fields into
a drafter and its parameters, so every experiment builds them the same way.

  drafter, draft_params = make_drafter("prompt_lookup", config, target_model)

`config` is any object or mapping with the fields a method reads (missing or
None fields take the defaults below); it is typically the run's ConfigDict:

  prompt_lookup  k, max_ngram, min_ngram
  layer_skip     k, layers ('0-9', '0,2,4', 'every2'; default the first third)
  draft_model    k, draft_model: 'distilled' (the draft model distilled from
                 SmolLM2-135M shipped in specjax/checkpoints/; the default for
                 that target), a distilled checkpoint directory
                 (experiments/train.py --config=configs/draft_model.py), 'self:N'
                 (the target's first N layers, final norm and LM head as a
                 separate model with its own cache; the default for other
                 targets: 'self:<num_layers // 3>'), or a model name / GGUF / HF
                 directory that `specjax.io.load.load_model` understands;
                 draft_vocab for a distilled one as for eagle
  replay         k; the reference continuations (`reference=`, e.g. the AR output)
  always_reject  k
  medusa         k (<= the checkpoint's heads), checkpoint (default: the heads
                 shipped for SmolLM2-135M in specjax/checkpoints/); guesses
                 drawn from each head's q with the target's sampling settings;
                 draft_vocab as for eagle (heads trained with a reduced one)
  blockwise      the same heads' top-1 chain (Stern et al.; one-hot q)
  draft_stop     draft_model, eagle, eagle3: a dynamic draft length per row --
                 stop once the product of the drafter's confidences in its
                 guesses falls below draft_stop (0: always k guesses)
  eagle, eagle3  k, checkpoint (default: the shipped head), draft_vocab (default:
                 the checkpoint's own draft vocabulary; 'full' for the whole
                 vocabulary; N for the N most frequent tokens of its training data)
  medusa_tree    the medusa heads drafting a static sparse tree of depth k with
                 tree_nodes nodes (Medusa's construction from the heads' top-1
                 accuracies on the checkpoint card, ranks modelled
                 geometrically); tree_mode 'wor' (siblings without
                 replacement, default), 'iid' or 'topk' (deterministic); all exact
  eagle_tree,    the eagle / eagle3 head drafting an EAGLE-2 dynamic tree of
  eagle3_tree    depth k: tree_topk children per expanded node, tree_width
                 nodes expanded per depth, reranked to tree_nodes (greedy or
                 tree_mode 'topk'); tree_mode 'wor' keeps every sampled child
  lookahead      k and the fields `specjax.drafters.lookahead.Lookahead` declares
                 (window, ngram, max_candidates, pool_size, select, next_token)
  lookahead_tree the same, verifying its max_candidates (+1) candidates as a
                 trie of depth ngram - 1 in one tree forward

Drafters joined by '+' ('eagle3+prompt_lookup') are one `union.Union`: each
part drafts its chain with the same fields (k the union's depth), and the
chains are verified as one tree.

A method name may carry its own field values after '@', so one run compares
settings side by side: 'eagle3_tree@tree_nodes=8', 'eagle@k=2@draft_vocab=full'
(each record keeps the full name).

Each method is one row of `BUILDERS` (name -> builder(Request) -> (drafter,
draft params)); `register(name, build)` adds one.

Drafters that sample (draft model, layer skip) draw with the target's own
sampling settings, read from the config's temperature / top_k / top_p unless
`sampling=` is given: one SamplingConfig for draft and target.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.errors import BadInputError, ConfigValueError
from specjax.io import checkpoints
from specjax.io.load import load_model
from specjax.drafters.base import Drafter
from specjax.drafters import draft_model as draft_model_lib
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.layer_skip import LayerSkip, parse_layers
from specjax.drafters.lookahead import Lookahead, LookaheadTree
from specjax.drafters import eagle, eagle_tree
from specjax.drafters import medusa as medusa_lib
from specjax.drafters.medusa import (Blockwise, Medusa, MedusaTree, geometric_accuracies,
                                     tree_from_accuracies)
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.drafters.replay import AlwaysReject, Replay, ReplayParams
from specjax.drafters.union import Union
# The settings, re-exported: callers name them through the registry.
from specjax.drafters.settings import (  # pylint: disable=unused-import
    CONFIG_FIELDS, LOOKAHEAD_FIELDS, LOOKAHEAD_METHODS, DrafterSettings, config_defaults,
    method_config, parse_method, sampling_of)

BUILTIN = ("prompt_lookup", "layer_skip", "draft_model", "replay", "always_reject", "medusa",
           "blockwise", "eagle", "eagle3", "medusa_tree", "eagle_tree", "eagle3_tree")
# Trained drafters shipped with the package: checkpoints/<target>/<kind>.
CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "checkpoints")
SHIPPED_TARGET = "smollm2-135m"
_CHECKPOINT_KIND = {"medusa": "medusa", "blockwise": "medusa", "eagle": "eagle",
                    "eagle3": "eagle3", "medusa_tree": "medusa", "eagle_tree": "eagle",
                    "eagle3_tree": "eagle3"}


def available_methods() -> tuple:
  """Method names make_drafter accepts (the built-in ones, then any registered)."""
  return BUILTIN + LOOKAHEAD_METHODS + tuple(m for m in BUILDERS if m not in BUILTIN
                                             and m not in LOOKAHEAD_METHODS)


def is_method(name: str) -> bool:
  """Whether `name` (without '@' fields) names a drafting method: one of
  `available_methods()`, or several of them joined by '+' (a union)."""
  methods = available_methods()
  return all(part in methods for part in str(name).split("+"))


def default_layers(num_layers: int) -> str:
  """The first third of the layers (at least one), as a layer string."""
  return f"0-{max(1, num_layers // 3) - 1}"


def truncated_model(params, cfg, num_layers: int):
  """The target's first `num_layers` layers + final norm + LM head as a model of
  its own: (params, cfg). Arrays are shared with the target, not copied."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"draft_model 'self:N' needs 1 <= N <= {cfg.num_layers}, got {num_layers}")
  return draft_model_lib.truncated_model(params, cfg, num_layers)


def _is_drafter_checkpoint(spec: str) -> bool:
  return os.path.isfile(os.path.join(spec, checkpoints.CARD))


def distilled_model(path: str, target_model, draft_vocab=None):
  """A distilled draft model (configs/draft_model.py) for this target -> (params, cfg):
  its layers and final norm from the checkpoint (fingerprint checked), the
  target's embedding and LM head, the draft vocabulary chosen by `draft_vocab`."""
  cfg = target_model.cfg
  student, card = checkpoints.load_drafter(path, target_model.params, cfg, method="draft_model")
  n = len(student.get("layers", ()))
  if n != card.get("num_layers") or "final_norm" not in student:
    raise checkpoints.CheckpointError(
        f"{path}: a draft_model checkpoint needs {card.get('num_layers')} layers and a final "
        f"norm, found {n} layers")
  dcfg = draft_model_lib.student_config(cfg, n)
  params = draft_model_lib.assemble(student, target_model.params, cfg)
  params["vocab_rank"] = student.get("vocab_rank")
  if params["vocab_rank"] is None:
    params.pop("vocab_rank")
  return draft_model_lib.with_draft_vocab(params, dcfg, draft_vocab), dcfg


def _draft_model(spec: str, target_model, draft_vocab=None):
  if spec.startswith("self:"):
    try:
      n = int(spec[len("self:"):])
    except ValueError:
      raise ValueError(f"draft_model {spec!r}: expected 'self:N' with an integer N") from None
    out = truncated_model(target_model.params, target_model.cfg, n)
  elif spec == "distilled":
    out = distilled_model(shipped_checkpoint("draft_model"), target_model, draft_vocab)
  elif os.path.isdir(spec) and _is_drafter_checkpoint(spec):
    out = distilled_model(spec, target_model, draft_vocab)
  else:
    draft = load_model(spec, target_model.cfg.dtype)
    out = draft.params, draft.cfg
  if draft_vocab not in (None, "") and spec != "distilled" and not _is_drafter_checkpoint(spec):
    if str(draft_vocab) != "full":
      raise ValueError(f"draft_vocab={draft_vocab}: only a distilled draft model (with its "
                       f"token ranking) can be narrowed; {spec!r} drafts over its full vocabulary")
  return out


def default_draft_model(target_model) -> str:
  """'distilled' for the target the shipped draft model was trained for, else 'self:L/3'."""
  try:
    fp = checkpoints.read_card(shipped_checkpoint("draft_model")).get("target_fingerprint")
  except checkpoints.CheckpointError:
    fp = None
  if fp is not None and fp == checkpoints.target_fingerprint(target_model.params,
                                                            target_model.cfg):
    return "distilled"
  return f"self:{max(1, target_model.cfg.num_layers // 3)}"


def reference_params(continuations: Sequence[Sequence[int]], width: Optional[int] = None,
                     pad_id: int = 0) -> ReplayParams:
  """Replay's params padded to a fixed `width` (a fixed shape compiles once)."""
  longest = max((len(c) for c in continuations), default=0)
  width = max(1, longest, width or 0)
  arr = np.full((len(continuations), width), pad_id, np.int32)
  for i, c in enumerate(continuations):
    arr[i, :len(c)] = c
  return ReplayParams(jnp.asarray(arr), jnp.asarray([len(c) for c in continuations], jnp.int32))


def shipped_checkpoint(kind: str) -> str:
  return os.path.join(CHECKPOINT_DIR, SHIPPED_TARGET, kind)


def _relative(path: str) -> str:
  path = os.path.abspath(path)
  if path.startswith(CHECKPOINT_DIR + os.sep):
    path = os.path.relpath(path, CHECKPOINT_DIR)
  return path


def drafter_id(method: str, config, target_model=None) -> Optional[str]:
  """Which trained weights a method uses (for result records): the checkpoint
  path relative to the shipped ones when it is shipped, plus the draft
  vocabulary choice; for the draft model its spec; None for training-free
  drafters."""
  method, settings = method_config(method, config)
  if "+" in method:  # a union: its parts' weights
    ids = [drafter_id(name, settings, target_model) for name in method.split("+")]
    return " + ".join(i for i in ids if i) or None
  vocab = settings.draft_vocab
  if method == "draft_model":
    spec = settings.draft_model
    if spec is None and target_model is not None:
      spec = default_draft_model(target_model)
    if spec == "distilled":
      spec = _relative(shipped_checkpoint("draft_model"))
    elif spec and _is_drafter_checkpoint(spec):
      spec = _relative(spec)
    else:
      vocab = None
    return None if spec is None else spec + (f" (draft_vocab={vocab})" if vocab else "")
  if method not in _CHECKPOINT_KIND:
    return None
  path = _relative(settings.checkpoint or shipped_checkpoint(_CHECKPOINT_KIND[method]))
  vocab = vocab if method.startswith(("eagle", "medusa", "blockwise")) else None
  return path + (f" (draft_vocab={vocab})" if vocab else "")


def _trained(method: str, settings: DrafterSettings, target_model):
  """A trained drafter's params from `settings.checkpoint` or the shipped one;
  the checkpoint's target fingerprint must match this target."""

  kind = _CHECKPOINT_KIND[method]
  path = settings.checkpoint or shipped_checkpoint(kind)
  params, _ = checkpoints.load_drafter(path, target_model.params, target_model.cfg, method=kind)
  return params


def medusa_tree_choices(top1, nodes: int) -> tuple:
  """Medusa's sparse tree of `nodes` nodes from per-head top-1 accuracies
  (ranks modelled geometrically; at most `nodes` ranks per head)."""
  return tree_from_accuracies(geometric_accuracies(top1, max(1, min(nodes, 16))), nodes)


def _lookahead(settings: DrafterSettings, tree: bool = False):
  cls = LookaheadTree if tree else Lookahead
  kwargs = {name: getattr(settings, name) for name in LOOKAHEAD_FIELDS - {"k"}
            if getattr(settings, name) is not None}
  # a chain drafts k tokens; a trie's depth is N - 1
  ngram = kwargs.get("ngram", Lookahead.__dataclass_fields__["ngram"].default)
  return cls(k=ngram - 1 if tree else settings.k, **kwargs)


def make_drafter(method: str, config, target_model, *, reference=None,
                 sampling: Optional[sampling_lib.SamplingConfig] = None,
                 reference_width: Optional[int] = None) -> tuple[Drafter, Any]:
  """Build the drafter named `method` -> (drafter, draft_params); see
  `_make_drafter`. Bad settings (unknown method or field, a value of the wrong
  type or out of range) raise ConfigValueError naming the method; a bad
  checkpoint or model file raises its MalformedFileError."""
  try:
    return _make_drafter(method, config, target_model, reference=reference, sampling=sampling,
                         reference_width=reference_width)
  except BadInputError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigValueError(f"method {method!r}: {e}") from e


def _make_drafter(method: str, config, target_model, *, reference=None,
                  sampling: Optional[sampling_lib.SamplingConfig] = None,
                  reference_width: Optional[int] = None) -> tuple[Drafter, Any]:
  """Build the drafter named `method` -> (drafter, draft_params).

  Args:
    method: one of `available_methods()`.
    config: the method's settings: DrafterSettings, or a config / dict with
      its fields (see the module docstring), read once into DrafterSettings.
    target_model: a `specjax.io.load.Model` (params, cfg) the drafter serves.
    reference: replay only: per-row reference continuations (token lists).
    sampling: the target's sampling settings (default: from the config).
    reference_width: replay only: pad the references to this many tokens.
  """
  base, settings = method_config(method, config)
  methods = available_methods()
  names = base.split("+")
  for name in names:
    if name not in methods:
      raise ValueError(f"unknown drafting method {name!r}; available: {', '.join(methods)} "
                       "(or several joined by '+': a union)")
  sampling = sampling or sampling_of(config)
  built = [BUILDERS[name](Request(method=name, settings=settings, target_model=target_model,
                                  sampling=sampling, reference=reference,
                                  reference_width=reference_width)) for name in names]
  if len(built) == 1:
    return built[0]
  drafter = Union(k=int(settings.k), parts=tuple(d for d, _ in built),
                  merge=sampling.greedy)
  params = tuple(p for _, p in built)
  drafter.check(target_model.cfg, params)
  return drafter, params


# --- the table: method name -> how to build it -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
  """What a builder gets: the method's name and settings, the target model,
  the sampling settings drafters that sample use; replay's references."""

  method: str
  settings: DrafterSettings
  target_model: Any
  sampling: sampling_lib.SamplingConfig
  reference: Any = None
  reference_width: Optional[int] = None

  @property
  def k(self):
    return self.settings.k


def _prompt_lookup(r: Request):
  return PromptLookup(k=r.k, max_ngram=int(r.settings.max_ngram),
                      min_ngram=int(r.settings.min_ngram)), None


def _layer_skip(r: Request):
  num_layers = r.target_model.cfg.num_layers
  layers = parse_layers(r.settings.layers or default_layers(num_layers), num_layers)
  return LayerSkip(k=r.k, layers=layers, sampling=r.sampling), None


def _draft_model_drafter(r: Request):
  spec = str(r.settings.draft_model or default_draft_model(r.target_model))
  draft_params, draft_cfg = _draft_model(spec, r.target_model, r.settings.draft_vocab)
  return DraftModel(k=r.k, cfg=draft_cfg, sampling=r.sampling,
                    draft_stop=float(r.settings.draft_stop)), draft_params


def _replay(r: Request):
  if r.reference is None:
    raise ValueError("method 'replay' needs reference continuations (reference=...), e.g. "
                     "the autoregressive output for the same prompts")
  return Replay(k=r.k), reference_params(r.reference, r.reference_width,
                                         r.target_model.cfg.pad_id)


def _always_reject(r: Request):
  return AlwaysReject(k=r.k), None


def _eagle(r: Request):
  cfg, st = r.target_model.cfg, r.settings
  params = _trained(r.method, st, r.target_model)
  params = eagle.with_draft_vocab(params, st.draft_vocab, cfg)
  fused = r.method.startswith("eagle3")
  if r.method.endswith("_tree"):
    drafter = eagle_tree.EagleTree(k=r.k, sampling=r.sampling, fused=fused,
                                   tree_topk=int(st.tree_topk), tree_width=int(st.tree_width),
                                   tree_nodes=int(st.tree_nodes), tree_mode=str(st.tree_mode))
  else:
    drafter = eagle.Eagle(k=r.k, sampling=r.sampling, fused=fused,
                          draft_stop=float(st.draft_stop))
  drafter.check(cfg, params)
  return drafter, eagle.prepare(params, r.target_model.params, cfg)


def _medusa_tree(r: Request):
  cfg, k = r.target_model.cfg, r.k
  path = r.settings.checkpoint or shipped_checkpoint("medusa")
  params, card = checkpoints.load_drafter(path, r.target_model.params, cfg, method="medusa")
  heads = int(params["w"].shape[0])
  if k > heads:
    raise ValueError(f"medusa_tree: depth k={k} needs {k} heads, the checkpoint has {heads}")
  top1 = [card.get("estimated", {}).get(f"top1_{i}", 0.5 ** (i + 1)) for i in range(k)]
  nodes = int(r.settings.tree_nodes)
  if nodes < 1:
    raise ValueError(f"tree_nodes must be >= 1, got {nodes}")
  choices = medusa_tree_choices(top1, nodes)
  drafter = MedusaTree(k=max(len(c) for c in choices), choices=choices, sampling=r.sampling,
                       tree_mode=str(r.settings.tree_mode))
  params = medusa_lib.with_draft_vocab(params, r.settings.draft_vocab, cfg)
  drafter.check(cfg, params)
  return drafter, medusa_lib.prepare(params, r.target_model.params, cfg)


def _medusa(r: Request):
  cfg = r.target_model.cfg
  params = _trained(r.method, r.settings, r.target_model)
  params = medusa_lib.with_draft_vocab(params, r.settings.draft_vocab, cfg)
  cls = Medusa if r.method == "medusa" else Blockwise
  drafter = cls(k=r.k, sampling=r.sampling)
  drafter.check(cfg, params)
  return drafter, medusa_lib.prepare(params, r.target_model.params, cfg)


def _lookahead_drafter(r: Request):
  return _lookahead(r.settings, tree=r.method == "lookahead_tree"), None


# One row per method: name -> builder(Request) -> (drafter, draft params).
BUILDERS = {
    "prompt_lookup": _prompt_lookup,
    "layer_skip": _layer_skip,
    "draft_model": _draft_model_drafter,
    "replay": _replay,
    "always_reject": _always_reject,
    "medusa": _medusa,
    "blockwise": _medusa,
    "eagle": _eagle,
    "eagle3": _eagle,
    "medusa_tree": _medusa_tree,
    "eagle_tree": _eagle,
    "eagle3_tree": _eagle,
    "lookahead": _lookahead_drafter,
    "lookahead_tree": _lookahead_drafter,
}


def register(name: str, build) -> None:
  """Add a drafting method: `build(Request) -> (drafter, draft params)`. Its
  name then works everywhere a method name does (make_drafter, the configs'
  `method`, the benchmark's `methods`, '@' field values of the config's fields)."""
  if name in BUILDERS or "@" in name:
    raise ValueError(f"method name {name!r} is taken or malformed")
  BUILDERS[name] = build
