"""Several processes on one machine: `jax.distributed` over loopback, CPU
collectives through gloo, data-parallel drafter training and batch sweeps.

  distributed.initialize(num_processes=2, process_id=i, port=p, local_devices=4)
  mesh = distributed.global_mesh()                 # (data = all devices, model = 1)
  step = distributed.data_parallel_step(step, mesh)  # the same step, batch split

Training: every process computes the same global batch (batch_fn is a pure
function of the step) and contributes the rows of its own devices
(`global_batch`); params and optimizer state are replicated (`replicate`). The
jitted step then runs as one SPMD program over every device of every
process: the loss is a mean over the global batch, so the partitioner's
all-reduce of the gradients IS the data-parallel average -- the parameters
are those of one process training on the whole batch, up to float rounding.

Sweeps: `local_share` gives each process a contiguous share of the requests
(its rows keep their global request ids, so their keys, and with them
sampled outputs, are those of the one-process run); each decodes its share
on its own devices and `gather_rows` collects every process's rows.
"""

from __future__ import annotations

import os
import socket
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import sharding


def free_port() -> int:
  """A TCP port free on the loopback interface (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize(num_processes: int, process_id: int, port: int,
               local_devices: Optional[int] = None, timeout_s: int = 120) -> None:
  """Join a `num_processes`-process JAX job coordinated on 127.0.0.1:port
  (process 0 hosts the coordinator). Must run before JAX starts a backend.
  `local_devices`: host CPU devices of this process (forced device count)."""
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} outside [0, {num_processes})")
  if local_devices is not None:
    jax.config.update("jax_num_cpu_devices", int(local_devices))
  # Cross-process CPU collectives (the gradient all-reduce) need an implementation.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=timeout_s)


def from_env() -> bool:
  """`initialize` from SPECJAX_NUM_PROCESSES / SPECJAX_PROCESS_ID / SPECJAX_PORT
  (and SPECJAX_LOCAL_DEVICES) when set; -> whether it did."""
  n = os.environ.get("SPECJAX_NUM_PROCESSES")
  if not n or int(n) <= 1:
    return False
  local = os.environ.get("SPECJAX_LOCAL_DEVICES")
  initialize(int(n), int(os.environ["SPECJAX_PROCESS_ID"]), int(os.environ["SPECJAX_PORT"]),
             int(local) if local else None)
  return True


def global_mesh(model: int = 1) -> Mesh:
  """A (data, model) mesh over every process's devices, process-major on `data`
  (process p holds the p-th contiguous block of the batch)."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return sharding.make_mesh((len(devices) // model, model), devices)


def replicate(tree, mesh: Mesh):
  """Host values (identical on every process) as arrays replicated on the mesh."""
  spec = NamedSharding(mesh, P())

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, spec, lambda idx: x[idx])

  return jax.tree.map(one, tree)


def global_batch(batch, mesh: Mesh):
  """A host batch (the same global batch on every process) as arrays split
  over `data` on the leading axis; each process supplies its devices' rows."""
  spec = NamedSharding(mesh, P(sharding.DATA))

  def one(x):
    x = np.asarray(x)
    if x.shape[0] % mesh.shape[sharding.DATA]:
      raise ValueError(f"global batch of {x.shape[0]} rows does not split over "
                       f"{mesh.shape[sharding.DATA]} data devices")
    return jax.make_array_from_callback(x.shape, spec, lambda idx: x[idx])

  return jax.tree.map(one, batch)


def _placed(tree, mesh: Mesh) -> bool:
  return all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
             and x.sharding.mesh == mesh for x in jax.tree.leaves(tree))


def data_parallel_step(step, mesh: Mesh):
  """step(params, opt_state, batch) run over the mesh: params and optimizer
  state replicated (placed on the first call; what the step returns is
  already placed), the host batch split over `data`. Fits
  `specjax.training.loop.train`'s step_fn."""

  def wrapped(params, opt_state, batch):
    if not _placed(params, mesh):
      params = replicate(params, mesh)
    if not _placed(opt_state, mesh):
      opt_state = replicate(opt_state, mesh)
    return step(params, opt_state, global_batch(batch, mesh))

  return wrapped


def to_host(tree):
  """Replicated global arrays -> numpy (this process's copy)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))
                      if isinstance(x, jax.Array) else np.asarray(x), tree)


def local_share(num_items: int, process_id: Optional[int] = None,
                num_processes: Optional[int] = None) -> range:
  """The contiguous block of `num_items` this process handles (sizes differ by at most 1)."""
  pid = jax.process_index() if process_id is None else process_id
  n = jax.process_count() if num_processes is None else num_processes
  per, extra = divmod(num_items, n)
  start = pid * per + min(pid, extra)
  return range(start, start + per + (pid < extra))


def gather_rows(rows: Sequence[Sequence[int]], num_items: int, pad: int = -1) -> list:
  """Every process's token lists (its `local_share` of `num_items`) -> all rows
  in global order, on every process (through one all-gather)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  n = jax.process_count()
  width = int(multihost_utils.process_allgather(
      np.asarray(max((len(r) for r in rows), default=0), np.int32)).max())
  most = max(len(local_share(num_items, p, n)) for p in range(n))
  buf = np.full((most, max(width, 1)), pad, np.int32)
  lens = np.zeros((most,), np.int32)
  for i, r in enumerate(rows):
    buf[i, :len(r)], lens[i] = r, len(r)
  all_buf = multihost_utils.process_allgather(buf)  # (n, most, width)
  all_len = multihost_utils.process_allgather(lens)
  out = []
  for p in range(n):
    for i in range(len(local_share(num_items, p, n))):
      out.append(all_buf[p, i, :all_len[p, i]].tolist())
  return out


def decode_share(generate, prompts: Sequence[Sequence[int]], request_ids=None,
                 **kwargs) -> list:
  """Data-parallel decoding of one batch: this process runs
  `generate(its prompts, request_ids=their ids, **kwargs)` (a function
  returning a `GenerateResult`, e.g. `autoregressive.generate` with the
  model bound) on its `local_share`, and every process gets all rows back
  in order. Request ids default to 0..B-1: a row's keys, and so its sampled
  output, are those of the one-process batch."""
  ids = list(range(len(prompts))) if request_ids is None else [int(i) for i in request_ids]
  rows = local_share(len(prompts))
  mine = generate([prompts[i] for i in rows], request_ids=[ids[i] for i in rows],
                  **kwargs).tokens if len(rows) else []
  return gather_rows(mine, len(prompts))
