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

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import sharding

ENV_PROCESSES, ENV_PROCESS_ID, ENV_PORT, ENV_LOCAL_DEVICES = (
    "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID", "SPECJAX_PORT", "SPECJAX_LOCAL_DEVICES")
T = TypeVar("T")

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
  n = os.environ.get(ENV_PROCESSES)
  if not n or int(n) <= 1:
    return False
  local = os.environ.get(ENV_LOCAL_DEVICES)
  initialize(int(n), int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_PORT]),
             int(local) if local else None)
  _exit_hard_on_error()
  return True


def _exit_hard_on_error() -> None:
  """A process of a job that fails must exit at once: JAX's exit handler
  would wait in the job's shutdown barrier for processes that are waiting
  for this one (the launcher then stops the rest)."""
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # pylint: disable=protected-access

  sys.excepthook = hook


def multi_process() -> bool:
  """Whether this process is one of several in a JAX job."""
  return jax.process_count() > 1


def is_primary() -> bool:
  """Process 0: the one that writes files (data, checkpoints, logs, exports)."""
  return jax.process_index() == 0


_BARRIERS = itertools.count()


def barrier(name: str, timeout_s: float = 6 * 3600) -> None:
  """Every process waits here until all have arrived (the coordination
  service's barrier: no device collective, so a long wait -- process 0
  generating the training data -- does not time out a collective). A no-op
  in a one-process job. Every process must call the same barriers in order."""
  if not multi_process():
    return
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  jax_distributed.global_state.client.wait_at_barrier(
      f"specjax/{next(_BARRIERS)}/{name}", int(timeout_s * 1000))


def primary_first(name: str, fn: Callable[[], T]) -> T:
  """fn() on process 0, then on the others: work that writes a file (training
  data, a feature cache) that the others then only read. -> fn()'s value."""
  if not multi_process():
    return fn()
  if is_primary():
    out = fn()
    barrier(name)
    return out
  barrier(name)
  return fn()


def child_env(extra_paths=()) -> dict:
  """This process's environment for a child JAX process that sets its own
  device count: XLA_FLAGS without --xla_force_host_platform_device_count
  (other flags kept), `extra_paths` put first on PYTHONPATH."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  if extra_paths:
    env["PYTHONPATH"] = os.pathsep.join([*extra_paths, env.get("PYTHONPATH", "")])
  return env


def launch(argv: Sequence[str], num_processes: int, local_devices: Optional[int] = None,
           log_dir: Optional[str] = None, poll_s: float = 0.2) -> int:
  """Run `argv` as `num_processes` processes of one JAX job on this machine
  (loopback coordinator on a free port; each child reads its place from the
  environment with `from_env`). Process 0's output goes to this process's
  stdout; the others' to log_dir/process_<i>.log (or are dropped). When one
  child fails, the others are killed (a collective would wait for it
  forever); rerunning the same command resumes from process 0's
  checkpoints. -> 0, or the first failing child's exit status."""
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  env = child_env()  # the children force their own device counts
  env[ENV_PROCESSES], env[ENV_PORT] = str(num_processes), str(free_port())
  if local_devices:
    env[ENV_LOCAL_DEVICES] = str(int(local_devices))
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  procs, files = [], []
  try:
    for i in range(num_processes):
      out = None
      if i:
        out = (open(os.path.join(log_dir, f"process_{i}.log"), "w") if log_dir
               else subprocess.DEVNULL)
        if log_dir:
          files.append(out)
      procs.append(subprocess.Popen(list(argv), env={**env, ENV_PROCESS_ID: str(i)},
                                    stdout=out, stderr=subprocess.STDOUT if i else None))
    while True:
      codes = [p.poll() for p in procs]
      failed = [c for c in codes if c not in (None, 0)]
      if failed:
        return failed[0]
      if all(c == 0 for c in codes):
        return 0
      time.sleep(poll_s)
  finally:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait()
    for f in files:
      f.close()


def child_argv() -> list:
  """This process's own command line (python + script + flags), to `launch`."""
  return [sys.executable] + list(sys.argv)


def run_as_job(processes: int = 1, local_devices: int = 0,
               log_dir: Optional[str] = None) -> Optional[int]:
  """For an experiment's main(), with its run's `processes` and
  `local_devices` settings: when processes > 1 and this is not yet one of a
  job's processes, start the job (this same command, `launch`) and return its
  exit status; in one of a job's processes, join the job (`from_env`) and
  return None; in a plain one-process run, None."""
  processes = int(processes or 1)
  if processes < 1:
    from specjax.errors import ConfigValueError  # pylint: disable=import-outside-toplevel
    raise ConfigValueError(f"processes must be >= 1, got {processes}")
  if processes > 1 and not os.environ.get(ENV_PROCESSES):
    return launch(child_argv(), processes, int(local_devices or 0) or None, log_dir=log_dir)
  from_env()
  return None


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


def global_batch(batch, mesh: Mesh, replicated: Sequence[str] = ()):
  """A host batch (the same global batch on every process) as arrays split
  over `data` on the leading axis; each process supplies its devices' rows.
  Top-level entries of a dict batch named in `replicated` (a step's PRNG
  key) are replicated instead."""
  if replicated and isinstance(batch, dict):
    rest = {k: v for k, v in batch.items() if k not in replicated}
    return {**global_batch(rest, mesh),
            **replicate({k: v for k, v in batch.items() if k in replicated}, mesh)}
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


def data_parallel_step(step, mesh: Mesh, replicated: Sequence[str] = ("key",)):
  """step(params, opt_state, batch) run over the mesh: params and optimizer
  state replicated (placed on the first call; what the step returns is
  already placed), the host batch split over `data` (but its `replicated`
  entries). Fits `specjax.training.loop.train`'s step_fn."""

  def wrapped(params, opt_state, batch):
    if not _placed(params, mesh):
      params = replicate(params, mesh)
    if not _placed(opt_state, mesh):
      opt_state = replicate(opt_state, mesh)
    return step(params, opt_state, global_batch(batch, mesh, replicated))

  return wrapped


def to_host(tree):
  """Replicated global arrays -> numpy (this process's copy); PRNG key
  arrays stay keys."""

  def one(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x if x.is_fully_addressable else x.addressable_data(0)
    return np.asarray(x.addressable_data(0))

  return jax.tree.map(one, tree)


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
