"""One of the processes tests/test_multiprocess.py starts (2 processes x 4 CPU devices).

  python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Joins the job over loopback (`specjax.distributed`), then

1. trains a tiny draft model (distillation steps of `specjax.training.draft_train`)
   data-parallel over the 8 devices of both processes, and the same steps on
   the whole global batch on one local device: the parameters must agree;
   the same for EAGLE-3 steps on batches of gathered loss positions (which
   every device gets whole);
2. runs a batch-size sweep data-parallel (each process decodes its share of
   each batch on a local (2, 2) mesh; rows gathered) for AR and prompt
   lookup, greedy and sampled, against the one-process batch.

Writes OUT_DIR/result_<PROCESS_ID>.json.
"""

import json
import os
import sys


def main(argv):
  pid, nproc, port, out = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  import specjax  # pylint: disable=import-outside-toplevel  (XLA_FLAGS first)
  from specjax import distributed  # pylint: disable=import-outside-toplevel
  distributed.initialize(nproc, pid, port, local_devices=4)

  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from specjax import sampling as sampling_lib  # pylint: disable=import-outside-toplevel
  from specjax import sharding  # pylint: disable=import-outside-toplevel
  from specjax.analysis import sharded_identity  # pylint: disable=import-outside-toplevel
  from specjax.decoding import autoregressive as ar  # pylint: disable=import-outside-toplevel
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel
  from specjax.drafters import draft_model as draft_model_lib  # pylint: disable=import-outside-toplevel
  from specjax.drafters.prompt_lookup import PromptLookup  # pylint: disable=import-outside-toplevel
  from specjax.models import transformer  # pylint: disable=import-outside-toplevel
  from specjax.models.config import tiny_config  # pylint: disable=import-outside-toplevel
  from specjax.training import draft_train, loop  # pylint: disable=import-outside-toplevel

  specjax.use_compilation_cache()
  result = {"process_id": pid, "process_count": jax.process_count(),
            "devices": jax.device_count(), "local_devices": jax.local_device_count()}

  # --- 1. data-parallel drafter training -----------------------------------------
  cfg = tiny_config()
  scfg = draft_model_lib.student_config(cfg, 1)
  target = jax.tree.map(np.asarray, transformer.init(jax.random.key(1), cfg))
  student = jax.tree.map(np.asarray, draft_train.init_student(target, cfg, (0,)))
  opt = loop.make_optimizer(3e-2, steps=4, warmup=1, weight_decay=0.01, clip=1.0)

  def batch_fn(step, rows=16, width=16):  # the same global batch on every process
    rng = np.random.default_rng(step)
    return {"tokens": rng.integers(0, cfg.vocab_size, (rows, width)).astype(np.int32),
            "f": rng.standard_normal((rows, width, cfg.dim)).astype(np.float32),
            "answer": (rng.random((rows, width)) < 0.8).astype(np.float32)}

  def train(step, params):
    opt_state, losses = opt.init(params), []
    for s in range(1, 4):
      params, opt_state, m = step(params, opt_state, batch_fn(s))
      losses.append(float(np.asarray(m["loss"])))
    return distributed.to_host(params), losses

  mesh = distributed.global_mesh()
  dp_step = distributed.data_parallel_step(
      draft_train.make_step(opt, distributed.replicate(target, mesh), cfg, scfg), mesh)
  dp_params, dp_losses = train(dp_step, student)
  one_step = draft_train.make_step(opt, target, cfg, scfg)  # one local device, whole batch
  ref_params, ref_losses = train(one_step, student)
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                       dp_params, ref_params))
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                       dp_params, student))
  result["train"] = {"mesh": dict(mesh.shape), "max_param_diff": max(diffs),
                     "max_param_update": max(moved), "dp_losses": dp_losses,
                     "ref_losses": ref_losses}

  # --- 1b. data-parallel EAGLE-3 steps on gathered loss positions ----------------
  from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
  from specjax.training import eagle_train  # pylint: disable=import-outside-toplevel
  seqs = [(np.random.default_rng(10 + i).integers(1, cfg.vocab_size, 20 + i).tolist(), 6 + i)
          for i in range(8)]
  pool = eagle_train.SeqPool.build(target, cfg, seqs, seq_len=32, top_k=4, batch_size=8,
                                   taps=eagle.eagle3_layers(cfg))
  head = jax.tree.map(np.asarray, eagle.init_head(jax.random.key(2), cfg, fused=True))

  def eagle_batch(step):
    b = pool.sequence_batch(np.random.default_rng(step), 512)  # 8 rows of 64
    for name in ("loss_rows", "loss_rows_on"):  # a length 8 devices do not divide
      b[name] = np.pad(b[name], (0, 4))
    b["key"] = np.asarray(jax.random.key_data(jax.random.key(step)))
    return b

  def eagle_train_steps(step):
    params, opt_state, losses = head, opt.init(head), []
    for s in range(1, 4):
      params, opt_state, m = step(params, opt_state, eagle_batch(s))
      losses.append(float(np.asarray(m["loss"])))
    return distributed.to_host(params), losses

  def eagle_step(tgt):
    return eagle_train.make_step(opt, tgt, cfg, steps=2, w_reg=0.0, w_cls=1.0)

  dp_head, dp_eagle = eagle_train_steps(distributed.data_parallel_step(
      eagle_step(distributed.replicate(target, mesh)), mesh, eagle_train.REPLICATED))
  ref_head, ref_eagle = eagle_train_steps(eagle_step(target))
  result["eagle"] = {
      "gathered": bool("loss_rows" in pool.sequence_batch(np.random.default_rng(1), 512)),
      "max_param_diff": max(jax.tree.leaves(jax.tree.map(
          lambda a, b: float(np.max(np.abs(a - b))), dp_head, ref_head))),
      "dp_losses": dp_eagle, "ref_losses": ref_eagle}

  # --- 2. data-parallel batch-size sweep ------------------------------------------
  dcfg = tiny_config(eos_id=2, pad_id=0)
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x,
                        transformer.init(jax.random.key(4), dcfg))
  prompts = [[5, 9, 13], [7, 11, 3, 20, 31, 8, 4], [17], [3, 4, 3, 4, 3]]
  local_mesh = sharding.make_mesh((2, 2), jax.local_devices())
  sweep = []
  for sampling in (sampling_lib.GREEDY, sampling_lib.SamplingConfig(temperature=1.0)):
    methods = {
        "ar": functools.partial(ar.generate, params, dcfg, sampling=sampling),
        "prompt_lookup": functools.partial(sp.generate, params, dcfg, PromptLookup(k=3),
                                           spec=sp.SpecConfig(sampling=sampling)),
    }
    for name, gen in methods.items():
      whole = gen(prompts, key=7, max_new_tokens=12).tokens  # one process, one device
      for b in (2, 4):
        got = []
        for start in range(0, len(prompts), b):  # units of b consecutive requests
          got += distributed.decode_share(gen, prompts[start:start + b],
                                          request_ids=range(start, start + b), key=7,
                                          max_new_tokens=12, mesh=local_mesh)
        verdict = sharded_identity.compare_rows(params, dcfg, prompts, whole, got,
                                                sampling.greedy, 1e-3)
        sweep.append({"method": name, "batch_size": b,
                      "sampling": "greedy" if sampling.greedy else "sampled", **verdict})
  result["sweep"] = sweep
  with open(os.path.join(out, f"result_{pid}.json"), "w") as f:
    json.dump(result, f)
  print("DONE", pid, flush=True)


if __name__ == "__main__":
  main(sys.argv)
