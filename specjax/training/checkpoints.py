"""Drafter checkpoints: orbax-format parameters + a JSON card, tied to the
target by a fingerprint.

A shipped drafter references the target's frozen embedding / LM head instead
of copying it, so loading it against another target would run silently wrong;
`load_drafter` refuses a fingerprint mismatch, and a missing or damaged
directory is an error, never a silent fresh init.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

CARD = "card.json"
PARAMS = "params"


class CheckpointError(ValueError):
  pass


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
  """Write params (orbax) and the card (must hold 'method' and 'target_fingerprint')."""
  for field in ("method", "target_fingerprint"):
    if field not in card:
      raise ValueError(f"drafter card needs {field!r}")
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  target = os.path.join(path, PARAMS)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(target, jax.device_get(params), force=True)
  ckptr.wait_until_finished()
  with open(os.path.join(path, CARD + ".tmp"), "w") as f:
    json.dump(card, f, indent=1)
  os.replace(os.path.join(path, CARD + ".tmp"), os.path.join(path, CARD))


def read_card(path: str) -> dict:
  """The card of the drafter checkpoint at `path` (CheckpointError if missing or unreadable)."""
  path = os.path.abspath(path)
  card_path = os.path.join(path, CARD)
  if not os.path.isdir(path):
    raise CheckpointError(f"drafter checkpoint {path} does not exist")
  if not os.path.exists(card_path):
    raise CheckpointError(f"{path} is not a drafter checkpoint (no {CARD})")
  try:
    with open(card_path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{card_path} is unreadable: {e}") from e


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
  try:
    params = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS))
  except Exception as e:  # orbax raises many types for damaged trees
    raise CheckpointError(f"{path}: cannot restore the parameters ({type(e).__name__}: {e})") \
        from e
  return jax.tree.map(jnp.asarray, params), card
