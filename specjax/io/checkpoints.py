"""Drafter checkpoints: orbax-format parameters + a JSON card, tied to the
target by a fingerprint.

A shipped drafter references the target's frozen embedding / LM head instead
of copying it, so loading it against another target would run silently wrong;
`load_drafter` refuses a fingerprint mismatch, and a missing or damaged
directory is an error, never a silent fresh init.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specjax.errors import MalformedFileError
from specjax.io import jsonl

CARD = "card.json"
PARAMS = "params"


class CheckpointError(MalformedFileError):
  """A drafter checkpoint directory that is missing, damaged or for another target."""


def target_fingerprint(params, cfg) -> str:
  """Config (architecture fields, not the dtype) + a hash of a few weights
  rounded to bf16, so an f32 and a bf16 load of one model agree."""
  arch = {k: getattr(cfg, k) for k in ("vocab_size", "dim", "num_layers", "num_heads",
                                       "num_kv_heads", "head_dim", "ffn_dim")}
  h = hashlib.sha1(json.dumps(arch, sort_keys=True).encode())
  for leaf in (params["embed"], params["final_norm"], params["layers"][0]["wqkv"],
               params["layers"][-1]["w_down"]):
    h.update(np.asarray(jnp.asarray(leaf).astype(jnp.bfloat16)).view(np.uint16).tobytes())
  return h.hexdigest()[:16]


def save_drafter(path: str, params, card: dict) -> None:
  """Write params (orbax) and the card (must hold 'method' and 'target_fingerprint').

  The new parameters are written beside the old ones (`params.new`) and swapped
  in once complete, the card last: a save that fails leaves the previous
  checkpoint as it was; one killed during the swap leaves a directory without a
  card (an error to load, redone by rerunning), never an old card beside new
  parameters. Other files of the directory (a README) are kept."""
  for field in ("method", "target_fingerprint"):
    if field not in card:
      raise ValueError(f"drafter card needs {field!r}")
  card_text = json.dumps(card, indent=1)  # a card that cannot be written fails before any write
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  target, new, old = (os.path.join(path, PARAMS + suffix) for suffix in ("", ".new", ".old"))
  for stale in (new, old):  # left by an earlier save that was killed
    if os.path.exists(stale):
      shutil.rmtree(stale)
  ckptr = ocp.StandardCheckpointer()
  try:
    ckptr.save(new, jax.device_get(params))
    ckptr.wait_until_finished()
  except Exception as e:  # orbax / tensorstore raise many types (e.g. a non-numeric leaf)
    for partial in [new] + glob.glob(glob.escape(new) + ".orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)
    raise CheckpointError(f"{path}: cannot save the parameters ({type(e).__name__}: {e}); "
                          "the checkpoint there is unchanged") from e
  with open(os.path.join(path, CARD + ".tmp"), "w") as f:
    f.write(card_text)
  if os.path.exists(os.path.join(path, CARD)):
    os.remove(os.path.join(path, CARD))
  if os.path.exists(target):
    os.replace(target, old)
  os.replace(new, target)
  os.replace(os.path.join(path, CARD + ".tmp"), os.path.join(path, CARD))
  if os.path.exists(old):
    shutil.rmtree(old)


def read_card(path: str) -> dict:
  """The card of the drafter checkpoint at `path` (CheckpointError if missing or unreadable)."""
  path = os.path.abspath(path)
  card_path = os.path.join(path, CARD)
  if not os.path.isdir(path):
    raise CheckpointError(f"drafter checkpoint {path} does not exist")
  if not os.path.exists(card_path):
    raise CheckpointError(f"{path} is not a drafter checkpoint (no {CARD})")
  return jsonl.read_object(card_path, CheckpointError)


def check_params(path: str, params) -> None:
  """Every leaf of restored drafter params is a float array of finite values
  (CheckpointError naming the leaf otherwise)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise CheckpointError(f"{path}: the checkpoint holds no parameters")
  for key_path, leaf in leaves:
    name = jax.tree_util.keystr(key_path)
    if leaf is None:
      continue
    arr = np.asarray(leaf)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool
                                   or arr.dtype == jnp.bfloat16):
      raise CheckpointError(f"{path}: parameter {name} has dtype {arr.dtype}, not a number")
    if not np.issubdtype(arr.dtype, np.integer) and arr.dtype != bool and \
        not np.isfinite(arr.astype(np.float32)).all():
      raise CheckpointError(f"{path}: parameter {name} contains NaN or inf values")


def load_drafter(path: str, target_params=None, target_cfg=None,
                 method: str | None = None) -> Tuple[Any, dict]:
  """-> (params, card). Checks the method and the target fingerprint when given."""
  path = os.path.abspath(path)
  card = read_card(path)
  if method is not None and card.get("method") != method:
    raise CheckpointError(f"{path} holds a {card.get('method')!r} drafter, not {method!r}")
  if target_params is not None:
    fp = target_fingerprint(target_params, target_cfg)
    if card.get("target_fingerprint") != fp:
      raise CheckpointError(
          f"{path} was trained for another target (fingerprint "
          f"{card.get('target_fingerprint')} != this target's {fp}); train one for this "
          "model with experiments/train.py")
  if not os.path.isdir(os.path.join(path, PARAMS)):
    raise CheckpointError(f"{path}: the parameters ({PARAMS}/) are missing")
  try:
    params = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS))
  except Exception as e:  # orbax raises many types for damaged trees
    raise CheckpointError(f"{path}: cannot restore the parameters ({type(e).__name__}: {e})") \
        from e
  check_params(path, params)
  return jax.tree.map(jnp.asarray, params), card
