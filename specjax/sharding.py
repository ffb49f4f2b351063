"""Placing a decoding run on a device mesh: batch over `data`, weights over `model`.

Opt-in. Without a mesh nothing here runs and every array lives on the
default device, exactly as before. With one (`make_mesh`, e.g. (2, 4): two
data-parallel groups of four model-parallel devices) the params, drafter
params, per-request inputs and the whole loop state get `NamedSharding`s,
and the jitted prefill and `lax.while_loop` compile as one SPMD program over
the mesh (XLA's partitioner inserts the collectives).

Partition rules (`param_spec`), chosen for SmolLM2-135M (V 49152, D 576,
F 1536, 9 query / 3 KV heads of 64) on 4 or 8 model devices:

  embed, lm_head, lm_rows  (V, D)      vocab over `model` (49152 = 8 * 6144):
                                       the LM head -- 21% of the weights and
                                       the largest single product -- splits
                                       evenly; logits come out vocab-sharded.
  wqkv  ((H + 2G) Dh, D)               width D over `model` (576 = 8 * 72).
                                       9 and 3 heads do not divide 4 or 8,
                                       and the fused Q/K/V rows would not
                                       split at head boundaries anyway: each
                                       device holds every head's projection
                                       for a slice of the input width, the
                                       partial products are summed (one
                                       all-reduce), and the attention core
                                       runs on whole heads on every model
                                       device (it is small next to the
                                       projections for decode-sized blocks).
  wo    (D, H Dh)                      head features over `model` (576): the
                                       contraction is split, one all-reduce.
  w_gate_up (2F, D)                    intermediate over `model` (3072).
  w_down (D, F)                        intermediate over `model` (1536): the
                                       Megatron pairing, one all-reduce.
  EAGLE fc (D, 2D), fuse (D, 3D)       input over `model`; Medusa w (H, D, D)
                                       input over `model`.
  norms, biases, vocab ids             replicated.

A dimension that does not divide the axis size falls back to the rule's next
choice, then to replication: any model fits any mesh, only the split changes.
Activations and the KV cache (B, S, G, Dh) are sharded over `data` on the
batch axis and replicated over `model`; every loop-state leaf whose leading
axis is the batch is sharded over `data`.

Outputs equal the single-device run: sampling keys are per request
(`specjax.decoding.batch`), and `jax_threefry_partitionable` (the default in
this JAX, set explicitly here) makes random bits independent of how the key
array is split. Split contractions sum in a different order, so greedy
outputs are compared with the near-tie rule (`specjax.analysis.greedy_identity`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Parameter name -> axes to split over `model`, in order of preference.
MODEL_AXES = {
    "embed": (0, 1), "lm_head": (0, 1), "lm_rows": (0, 1),
    "wqkv": (1,), "wo": (1,),
    "w_gate_up": (0, 1), "w_down": (1, 0),
    "fc": (1,), "fuse": (1,),
    "w": (2,),
}


def parse_mesh_shape(spec) -> Optional[Tuple[int, int]]:
  """'' / None -> None (no mesh); '2,4' / (2, 4) -> (2, 4); '8' -> (8, 1)."""
  if spec is None or (isinstance(spec, str) and not spec.strip()):
    return None
  parts = [p for p in str(spec).replace("x", ",").split(",") if p.strip()] \
      if isinstance(spec, str) else list(spec)
  try:
    shape = tuple(int(p) for p in parts)
  except (TypeError, ValueError):
    raise ValueError(f"mesh {spec!r}: expected 'data,model' device counts, e.g. '2,4'") from None
  if len(shape) == 1:
    shape = (shape[0], 1)
  if len(shape) != 2 or min(shape) < 1:
    raise ValueError(f"mesh {spec!r}: expected two positive device counts (data, model)")
  return shape


def make_mesh(shape=None, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, model) mesh over `devices` (default all of them). `shape` may be
  a tuple or a '2,4' string; default (all devices, 1)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = parse_mesh_shape(shape) or (len(devices), 1)
  n = shape[0] * shape[1]
  if n > len(devices):
    raise ValueError(f"mesh {shape} needs {n} devices, {len(devices)} available (on CPU, "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
  # Sampled outputs must not depend on how a key array is split.
  jax.config.update("jax_threefry_partitionable", True)
  return Mesh(np.asarray(devices[:n], dtype=object).reshape(shape), AXES)


def mesh_of(spec: Optional[str]) -> Optional[Mesh]:
  """The mesh a run's `mesh` setting names ('data,model'; '' or None: none)."""
  # this process's devices (in a multi-process job each process decodes its own share)
  return None if parse_mesh_shape(spec) is None else make_mesh(spec, jax.local_devices())


def _name(path) -> Optional[str]:
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey):
      return str(entry.key)
    if isinstance(entry, jax.tree_util.GetAttrKey):
      return entry.name
  return None


def param_spec(name: Optional[str], shape: Tuple[int, ...], model_size: int) -> P:
  """The PartitionSpec of one parameter (module docstring's table)."""
  for axis in MODEL_AXES.get(name, ()):
    if axis < len(shape) and shape[axis] % model_size == 0:
      spec = [None] * len(shape)
      spec[axis] = MODEL
      return P(*spec)
  return P()


def param_shardings(params, mesh: Mesh):
  """NamedShardings of a params pytree (target or drafter) by `param_spec`."""
  m = mesh.shape[MODEL]

  def one(path, x):
    return NamedSharding(mesh, param_spec(_name(path), np.shape(x), m))

  return jax.tree_util.tree_map_with_path(one, params)


def place_params(params, mesh: Mesh):
  """Params on the mesh (a no-op for arrays already placed there). None stays None."""
  if params is None:
    return None
  return jax.device_put(params, param_shardings(params, mesh))


def batch_shardings(tree, batch_size: int, mesh: Mesh):
  """Leaves whose leading axis is the batch: split over `data`; others replicated."""
  d = mesh.shape[DATA]

  def one(x):
    shape = np.shape(x)
    if shape and shape[0] == batch_size and batch_size % d == 0:
      return NamedSharding(mesh, P(DATA))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree)


def place_batch(tree, batch_size: int, mesh: Mesh):
  """Per-request arrays or a loop state on the mesh, batch over `data`."""
  return jax.device_put(tree, batch_shardings(tree, batch_size, mesh))


def pad_requests(prompts: Sequence[Sequence[int]], max_new_tokens, request_ids,
                 mesh: Mesh):
  """Pad a batch to a multiple of the `data` axis with inert rows.

  Padding rows repeat the first prompt with a token limit of 1: prefill
  emits their only token and marks them done, so the loop never runs them
  and they count in no metric. Their request ids are unused ones, so no
  real row's keys change. Per-row draft params (Replay's references) must
  then cover the padded rows too. -> (prompts, max_new_tokens (per row), request_ids).
  """
  from specjax.decoding import batch as batch_lib  # pylint: disable=import-outside-toplevel
  b, d = len(prompts), mesh.shape[DATA]
  extra = -b % d
  if not extra:
    return prompts, max_new_tokens, request_ids
  limits = batch_lib.row_limits(max_new_tokens, b)
  ids = np.arange(b, dtype=np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
  pad_ids = int(ids.max()) + 1 + np.arange(extra, dtype=np.int32)
  return (list(prompts) + [prompts[0]] * extra,
          np.concatenate([limits, np.ones(extra, np.int32)]).tolist(),
          np.concatenate([ids, pad_ids]))
