"""The frozen target's features for drafter training, kept on disk in shards.

One target forward per batch of sequences gives, per position j, the final
normed hidden state f_j, the tapped layer outputs EAGLE-3 fuses, and (with
`top_k`) the teacher's top-K distribution of x_{j+1}: ids and probabilities of
softmax(LMHead(f_j)), so a training step need not run the 49,152-row LM head
for its labels. Features are stored in the target's own dtype (a bf16 target
serves bf16 features, as the drafter sees them while drafting).

Shards: the sequences, in their order, cut into groups of `shard_sequences`;
each shard is a directory of `.npy` files (memory-mapped when read) named by
the hash of its content and of everything that determines its features (the
target's fingerprint and dtype, seq_len, taps, top_k). Data that grows computes
only its new shards; a shard is written to a temporary directory and renamed,
so a killed run leaves no half-written shard.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.models import cache as cache_lib
from specjax.models import transformer

SHARD_SEQUENCES = 256
FORMAT = 1


@functools.partial(jax.jit, static_argnames=("cfg", "taps", "top_k"))
def _forward(params, cfg, tokens, taps, top_k):
  b, t = tokens.shape
  cache = cache_lib.init_cache(cfg, b, t)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  layers = tuple(taps) + (cfg.num_layers,) if taps else ()
  _, hidden, _ = transformer.forward(params, cfg, tokens, pos, cache, compute_logits=False,
                                     hidden_layers=layers)
  if not top_k:
    return hidden, None, None
  final = hidden[..., -cfg.dim:]
  p = jax.nn.softmax(transformer.lm_head(params, cfg, final), -1)
  top_p, top_ids = jax.lax.top_k(p, top_k)
  return hidden, top_p, top_ids.astype(jnp.int32)


def compute(params, cfg, sequences: Sequence[Tuple[List[int], int]], *, seq_len: int,
            taps: Tuple[int, ...] = (), top_k: int = 0, batch_size: int = 4,
            progress: Optional[Callable[[str], None]] = None) -> Dict[str, list]:
  """Per-sequence features of `sequences` (kept: at least 3 tokens and an
  answer, cut to seq_len), in the given order: {tokens, plen, final, taps,
  top_ids, top_p} lists (taps / top_* entries None when not asked for)."""
  d = cfg.dim
  store = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)
  # Similar lengths together, each batch padded to a multiple of 64 (a few
  # compiled shapes, little padding).
  order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
  feats = {}
  for s in range(0, len(order), batch_size):
    idx = order[s:s + batch_size]
    chunk = [sequences[i] for i in idx]
    width = min(seq_len, cache_lib.round_up(max(len(ids) for ids, _ in chunk), 64))
    toks = np.full((batch_size, width), cfg.pad_id, np.int32)
    for i, (ids, _) in enumerate(chunk):
      ids = list(ids)[:seq_len]
      toks[i, :len(ids)] = ids
    hid, tp, ti = _forward(params, cfg, jnp.asarray(toks), tuple(taps), top_k)
    hid = np.asarray(hid).astype(store)
    tp = None if tp is None else np.asarray(tp, np.float32)
    ti = None if ti is None else np.asarray(ti, np.int32)
    for j, (i, (ids, plen)) in enumerate(zip(idx, chunk)):
      n = min(len(ids), seq_len)
      if n >= 3 and plen < n:
        feats[i] = (hid[j, :n], list(ids)[:n], plen,
                    None if tp is None else tp[j, :n], None if ti is None else ti[j, :n])
    if progress:
      progress(f"features: {min(s + batch_size, len(sequences))}/{len(sequences)} sequences")
  out = {"tokens": [], "plen": [], "final": [], "taps": [], "top_ids": [], "top_p": []}
  for i in sorted(feats):
    h, ids, plen, tp, ti = feats[i]
    out["tokens"].append(np.asarray(ids, np.int32))
    out["plen"].append(int(plen))
    out["final"].append(h[:, -d:])
    out["taps"].append(h[:, :-d] if taps else None)
    out["top_p"].append(tp)
    out["top_ids"].append(ti)
  return out


def shard_key(fingerprint: str, cfg, sequences, *, seq_len: int, taps, top_k: int) -> str:
  h = hashlib.sha1(json.dumps([FORMAT, fingerprint, cfg.dtype, seq_len, list(taps),
                               top_k]).encode())
  for ids, plen in sequences:
    h.update(np.asarray(list(ids) + [-1, plen, -2], np.int64).tobytes())
  return h.hexdigest()[:20]


_FIELDS = ("final", "taps", "top_ids", "top_p")


def save_shard(path: str, feats: Dict[str, list]) -> None:
  """One shard directory (concatenated arrays + per-sequence lengths), atomically."""
  tmp = f"{path}.tmp-{os.getpid()}"
  os.makedirs(tmp, exist_ok=True)
  lens = np.asarray([len(t) for t in feats["tokens"]], np.int64)
  np.save(os.path.join(tmp, "lens.npy"), lens)
  np.save(os.path.join(tmp, "plen.npy"), np.asarray(feats["plen"], np.int64))
  np.save(os.path.join(tmp, "tokens.npy"),
          np.concatenate(feats["tokens"]) if len(lens) else np.zeros(0, np.int32))
  meta = {"format": FORMAT, "sequences": int(len(lens)), "dtypes": {}}
  for name in _FIELDS:
    parts = feats[name]
    if not parts or parts[0] is None:
      continue
    arr = np.concatenate(parts)
    meta["dtypes"][name] = str(arr.dtype)
    if arr.dtype == ml_dtypes.bfloat16:  # .npy has no bfloat16: its raw bits
      arr = arr.view(np.uint16)
    np.save(os.path.join(tmp, f"{name}.npy"), arr)
  with open(os.path.join(tmp, "meta.json"), "w") as f:
    json.dump(meta, f)
  os.replace(tmp, path)


def load_shard(path: str) -> Dict[str, list]:
  """A shard's per-sequence arrays: views of memory-mapped files."""
  with open(os.path.join(path, "meta.json")) as f:
    meta = json.load(f)
  lens = np.load(os.path.join(path, "lens.npy"))
  cuts = np.cumsum(lens)[:-1]
  out = {"tokens": np.split(np.load(os.path.join(path, "tokens.npy")), cuts) if len(lens) else [],
         "plen": [int(x) for x in np.load(os.path.join(path, "plen.npy"))]}
  for name in _FIELDS:
    if name not in meta["dtypes"]:
      out[name] = [None] * len(lens)
      continue
    arr = np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")
    if meta["dtypes"][name] == "bfloat16":
      arr = arr.view(ml_dtypes.bfloat16)
    out[name] = np.split(arr, cuts) if len(lens) else []
  return out


def build(params, cfg, sequences: Sequence[Tuple[List[int], int]], *, seq_len: int,
          taps: Tuple[int, ...] = (), top_k: int = 0, batch_size: int = 4,
          cache_dir: Optional[str] = None, shard_sequences: int = SHARD_SEQUENCES,
          reuse_taps: Sequence[Tuple[int, ...]] = (),
          progress: Optional[Callable[[str], None]] = None) -> Dict[str, list]:
  """`compute`'s features of `sequences`; with `cache_dir`, shard by shard:
  a shard computed before (same content, same target and settings) is read
  from there, the others are computed and written.

  reuse_taps (only when `taps` is empty): tap sets whose cached shards serve
  this call too -- a shard computed with taps holds the same tokens, final
  features and teacher top-K (the taps are not read), so e.g. a draft model
  trains on the shards an EAGLE-3 run of the same data left."""
  if reuse_taps and taps:
    raise ValueError("reuse_taps serves a call without taps only (the final features and "
                     "teacher top-K of another run's shards)")
  if not cache_dir:
    return compute(params, cfg, sequences, seq_len=seq_len, taps=taps, top_k=top_k,
                   batch_size=batch_size, progress=progress)
  from specjax.io import checkpoints  # pylint: disable=import-outside-toplevel
  fingerprint = checkpoints.target_fingerprint(params, cfg)
  os.makedirs(cache_dir, exist_ok=True)
  out = {name: [] for name in ("tokens", "plen") + _FIELDS}
  loaded = made = 0
  for s in range(0, len(sequences), shard_sequences):
    part = list(sequences[s:s + shard_sequences])
    paths = [os.path.join(cache_dir, "shard-" + shard_key(fingerprint, cfg, part,
                                                          seq_len=seq_len, taps=t, top_k=top_k))
             for t in [tuple(taps)] + [tuple(r) for r in reuse_taps]]
    path = next((p for p in paths if os.path.isdir(p)), None)
    if path is not None:
      loaded += 1
    else:
      path = paths[0]
      save_shard(path, compute(params, cfg, part, seq_len=seq_len, taps=taps, top_k=top_k,
                               batch_size=batch_size))
      made += 1
    feats = load_shard(path)
    if not taps:  # a reused shard's taps are not this call's
      feats["taps"] = [None] * len(feats["tokens"])
    for name in out:
      out[name] += feats[name]
    if progress:
      progress(f"features: {min(s + shard_sequences, len(sequences))}/{len(sequences)} "
               f"sequences ({loaded} shards loaded, {made} computed)")
  return out
