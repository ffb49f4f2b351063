"""One training run from its settings (`TrainSettings`, read from configs/medusa.py,
configs/eagle.py, configs/eagle3.py or configs/draft_model.py): self-distillation data ->
target features -> optax training with orbax checkpoints -> exported, fingerprinted drafter
checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.drafters import draft_model as draft_model_lib
from specjax.drafters import eagle, medusa
from specjax.io.load import Model, load_model
from specjax.models import transformer
from specjax.models.config import tiny_config
from specjax.io import checkpoints
from specjax.settings import require
from specjax.training import distill_data, draft_train, eagle_train, loop, medusa_train
from specjax.training.settings import TrainSettings

TINY = "tiny"  # a small random target (tests): token prompts, no tokenizer


def _target(c: TrainSettings) -> Model:
  if c.model == TINY:
    cfg = tiny_config(vocab_size=64, dim=64, num_layers=2, eos_id=-1, max_seq_len=256)
    params = transformer.init(jax.random.key(7), cfg)
    # Soften the tied embedding: a random init's logits are so peaked that its
    # answers repeat one token, leaving the heads nothing to learn.
    params["embed"] = params["embed"] * 0.2
    return Model(params=params, cfg=cfg, tokenizer=None, source=TINY)
  # the default forward: features come from whole sequences (prefill-sized blocks)
  return load_model(c.model, c.dtype, batch_invariant=False)


def _tiny_records(model: Model, c: TrainSettings) -> list:
  """The tiny target's own sampled (T = 1) answers to random token prompts
  (its greedy answers collapse into one repeated token)."""
  rng = np.random.default_rng(c.seed)
  prompts = [rng.integers(3, model.cfg.vocab_size, size=int(rng.integers(4, 12))).tolist()
             for _ in range(c.num_examples)]
  res = ar.generate(model.params, model.cfg, prompts, max_new_tokens=c.max_new_tokens,
                    key=c.seed, sampling=sampling_lib.SamplingConfig(temperature=1.0))
  return [{"id": f"tiny/{i}", "split": distill_data.split_of(f"tiny/{i}", c.valid_fraction),
           "prompt": p, "answer": a} for i, (p, a) in enumerate(zip(prompts, res.tokens))]


def run(c: TrainSettings, progress: Optional[Callable[[str], None]] = None,
        stop_after: Optional[int] = None):
  """Trains (or resumes) and exports the drafter `c` describes (a TrainSettings;
  `TrainSettings.of(config)` reads a training config)."""
  require(c, TrainSettings, "training.run.run")
  _check(c)
  progress = progress or (lambda s: print(s, flush=True))
  t_start = time.perf_counter()
  model = _target(c)
  # read only after the data and its features (minutes to hours): checked first
  if c.init_from:
    checkpoints.load_drafter(c.init_from, model.params, model.cfg, method=c.method)
  os.makedirs(c.workdir, exist_ok=True)
  train_seqs, valid_seqs, grown_seqs, _ = _data(c, model, progress)
  if c.method in ("eagle", "eagle3"):
    return _run_eagle(c, model, train_seqs, valid_seqs, progress, stop_after, t_start,
                      grown_seqs)
  if c.method == "draft_model":
    return _run_draft_model(c, model, train_seqs, valid_seqs, progress, stop_after, t_start)
  return _run_medusa(c, model, train_seqs, valid_seqs, progress, stop_after, t_start)


def _check(c: TrainSettings) -> None:
  """Settings a run reads late, refused before any work: a field out of
  range, an unknown method or train_order, a missing validation-ids file."""
  c.check()
  distill_data.check_selection(valid_sequences=c.valid_sequences,
                               train_positions=c.train_positions, train_order=c.train_order)
  if c.valid_ids_path and not os.path.isfile(c.valid_ids_path):
    raise FileNotFoundError(f"valid_ids_path={c.valid_ids_path!r}: no such file (a JSON list "
                            "of the held-out records' ids)")


def _data(c: TrainSettings, model: Model, progress):
  """1. data: (training sequences, validation sequences, grown training
  sequences, validation records) of the run `c` describes."""
  if c.model == TINY:
    records = _tiny_records(model, c)
  else:
    data_path = c.data_path or os.path.join(c.workdir, "distill.jsonl")
    # Several processes: process 0 generates (or finishes) the data file, the
    # others then read it.
    records = distributed.primary_first("data", lambda: distill_data.generate_dataset(
        model, data_path, sources=_names(c.sources),
        num_examples=c.num_examples, seed=c.seed, max_new_tokens=c.max_new_tokens,
        max_prompt_tokens=c.max_prompt_tokens, batch_size=c.gen_batch_size,
        sample_fraction=c.sample_fraction, valid_fraction=c.valid_fraction,
        model_name=c.model, progress=progress))
  valid_ids = None
  if c.valid_ids_path:
    with open(c.valid_ids_path) as f:
      valid_ids = json.load(f)
  train_recs, valid_recs = distill_data.select(records, valid_sequences=c.valid_sequences,
                                               train_positions=c.train_positions,
                                               valid_ids=valid_ids,
                                               train_sources=_names(c.train_sources),
                                               train_order=c.train_order)
  if c.reference_examples and model.tokenizer is not None:
    train_recs = with_references(c, model.tokenizer, records, train_recs, progress)
  grown = []
  if c.grow_records or c.long_reference_examples:
    if c.method not in ("eagle", "eagle3"):
      raise ValueError(f"grow_records / long_reference_examples are implemented for eagle / "
                       f"eagle3 runs, not {c.method!r}")
    grown = _grown_records(c, model, records, train_recs, valid_ids, progress)
  train_seqs = distill_data.sequences(train_recs)
  valid_seqs = distill_data.sequences(valid_recs) or train_seqs[:2]
  grown_seqs = distill_data.sequences(grown)
  progress(f"data: {len(train_seqs) + len(grown_seqs)} train / {len(valid_seqs)} valid "
           "sequences")
  return train_seqs, valid_seqs, grown_seqs, valid_recs


def estimate_checkpoints(c: TrainSettings, paths, *, skip_records: int = 0,
                         progress: Optional[Callable[[str], None]] = None):
  """The teacher-forced acceptance estimate of exported checkpoints of
  `c.method` on the validation records of the run `c` describes (the same
  estimate its training keeps the best by; EAGLE: `valid_max_windows`
  sequences, the draft model: `valid_max_seqs`, Medusa: `valid_max_positions`), so
  checkpoints trained on different data compare on one set.

  skip_records > 0: leave out the validation records whose ids are among the
  data file's first `skip_records` records (e.g. a checkpoint trained on that
  prefix before the validation ids were fixed). The data file is read as
  training reads it (a config with num_examples > 0 would first generate
  what the file lacks). -> [(path, estimate)]"""
  require(c, TrainSettings, "training.run.estimate_checkpoints")
  _check(c)
  progress = progress or (lambda s: print(s, flush=True))
  model = _target(c)
  cfg = model.cfg
  _, valid_seqs, _, valid_recs = _data(c, model, progress)
  if skip_records:
    if c.model == TINY:
      raise ValueError("skip_records reads the data file: not for the tiny target")
    data_path = c.data_path or os.path.join(c.workdir, "distill.jsonl")
    first = {q["id"] for q in distill_data.read_records(data_path)[:skip_records]}
    valid_recs = [q for q in valid_recs if q["id"] not in first]
    valid_seqs = distill_data.sequences(valid_recs)
    progress(f"validation: {len(valid_recs)} records not among the file's first {skip_records}")
    if not valid_recs:
      raise ValueError(f"skip_records={skip_records}: no validation record is left to estimate on")
  if c.method == "medusa":
    vpool = _medusa_valid(c, _medusa_pool(c, model, valid_seqs))
  else:
    taps = eagle.eagle3_layers(cfg) if c.method == "eagle3" else ()
    vpool = eagle_train.SeqPool.build(model.params, cfg, valid_seqs, seq_len=c.seq_len, taps=taps,
                                      top_k=c.teacher_top_k, batch_size=c.feature_batch,
                                      cache_dir=_feature_cache(c),
                                      reuse_taps=() if taps else (eagle.eagle3_layers(cfg),))
  out = []
  for path in paths:
    params, _ = checkpoints.load_drafter(path, model.params, cfg, method=c.method)
    vocab = params.get("vocab")
    if c.method == "medusa":
      est = medusa_train.estimate({"w": params["w"], "b": params["b"]}, model.params, cfg,
                                  vpool, int(params["w"].shape[0]), vocab=vocab)
    elif c.method == "draft_model":
      student = {"layers": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params["layers"]),
                 "final_norm": jnp.asarray(params["final_norm"], jnp.float32)}
      scfg = draft_model_lib.student_config(cfg, len(student["layers"]))
      est = draft_train.estimate(student, model.params, cfg, scfg, vpool, c.eval_k, vocab,
                                 batch_seqs=c.batch_seqs, max_len=c.seq_len,
                                 max_seqs=c.valid_max_seqs or None)
    else:
      head = {k: v for k, v in params.items() if k not in ("vocab", "vocab_rank")}
      windows = (vpool.eval_sequences(c.valid_max_windows or None) if c.context == "sequence"
                 else vpool.eval_windows(c.window, c.valid_max_windows or None))
      est = eagle_train.estimate(head, model.params, cfg, windows, c.eval_k, vocab)
    progress(f"{path}: " + json.dumps({k: round(float(v), 4) for k, v in est.items()}))
    out.append((path, est))
  return out


def _medusa_pool(c: TrainSettings, model: Model, seqs, progress=None):
  """Medusa's flat feature pool of `seqs` (the shard cache; an EAGLE-3 run's
  shards of the same data and teacher top-K serve)."""
  return medusa_train.FeaturePool.build(model.params, model.cfg, seqs, seq_len=c.seq_len,
                                        batch_size=c.feature_batch, top_k=c.teacher_top_k,
                                        cache_dir=_feature_cache(c),
                                        reuse_taps=(eagle.eagle3_layers(model.cfg),),
                                        progress=progress)


def _medusa_valid(c: TrainSettings, vpool):
  """The validation positions Medusa's estimate reads: the first `valid_max_positions`."""
  if c.valid_max_positions and len(vpool) > c.valid_max_positions:
    return vpool.take(np.arange(c.valid_max_positions))
  return vpool


def _run_medusa(c: TrainSettings, model: Model, train_seqs, valid_seqs, progress, stop_after,
                t_start):
  """Medusa heads (also blockwise decoding's): a flat pool of answer positions."""
  # 2. features (once; reused by every epoch; an EAGLE-3 run's shards of the
  # same data and teacher top-K serve)
  t0 = time.perf_counter()
  pool, vpool = _pools("features", lambda: (_medusa_pool(c, model, train_seqs, progress),
                                            _medusa_pool(c, model, valid_seqs)))
  progress(f"features: {len(pool)} train / {len(vpool)} valid positions in "
           f"{time.perf_counter() - t0:.0f}s"
           + (f"; soft labels: the teacher's top-{c.teacher_top_k}" if c.teacher_top_k else ""))
  vocab = _reduced_vocab(c, model.cfg, train_seqs, progress)
  # 3. training
  heads0 = _warm_start(c, model, medusa.init_heads(jax.random.key(c.seed), c.num_heads,
                                                   model.cfg.dim), progress)

  def batch_fn(step):
    rng = np.random.default_rng([c.seed, step])
    idx = rng.integers(0, len(pool), size=c.batch_positions)
    return jax.tree.map(jnp.asarray, pool.batch(idx, c.num_heads, teacher=bool(c.teacher_top_k)))

  if c.epochs:
    c = dataclasses.replace(c, steps=max(int(np.ceil(c.epochs * len(pool) / c.batch_positions)),
                                         1))
    progress(f"{c.epochs} epochs over {len(pool)} answer positions: {c.steps} steps")
  opt = loop.make_optimizer(c.lr, c.steps, c.warmup, c.weight_decay, c.clip)
  step_target, dp = _data_parallel(model)
  step_fn = dp(medusa_train.make_step(opt, step_target, model.cfg, c.decay, vocab=vocab))

  vsub = _medusa_valid(c, vpool)

  def eval_fn(heads):
    return medusa_train.estimate(heads, model.params, model.cfg, vsub, c.num_heads, vocab=vocab)

  result = _train(c, heads0, opt, step_fn, batch_fn, eval_fn, progress, stop_after)
  out = {"step": result.step, "workdir": c.workdir, "train_positions": len(pool),
         "valid_positions": len(vsub), "wall_s": time.perf_counter() - t_start}
  if not _finished(c, result) or not distributed.is_primary():
    return out  # stopped early (killed / stop_after): nothing to export yet; or not process 0
  best, best_step = loop.best_params(c.workdir, heads0)
  best = best if best is not None else result.params
  final_eval = eval_fn(best)
  out.update(best_step=best_step, estimate=final_eval)
  if c.export:
    # the ranking always (draft_vocab=N at load time), the vocabulary when reduced
    best = dict(best, vocab_rank=_vocab_rank(model.cfg, train_seqs),
                **({} if vocab is None else {"vocab": vocab}))
    card = {"method": "medusa", "num_heads": c.num_heads,
            "draft_vocab": 0 if vocab is None else int(len(vocab)),
            "target": c.model, "target_fingerprint": checkpoints.target_fingerprint(
                model.params, model.cfg),
            "config": c.config(), "train_steps": c.steps, "best_step": best_step,
            "init_from": c.init_from or None,
            "train_positions": len(pool), "valid_positions": len(vsub),
            "estimated": final_eval, "wall_s": round(time.perf_counter() - t_start, 1)}
    checkpoints.save_drafter(c.export, best, card)
    out["export"] = c.export
    progress(f"exported {c.export}")
  return out


def _data_parallel(model: Model):
  """(target params for the training step, wrap(step_fn)). One process: the
  target's params and the step unchanged. Several (`distributed`): the step
  runs data-parallel over every device of every process (a (data, 1) mesh;
  each process supplies its devices' rows of the same global batch), so it
  needs the target's params replicated over that mesh."""
  if not distributed.multi_process():
    return model.params, lambda step: step
  mesh = distributed.global_mesh()
  return (distributed.replicate(model.params, mesh),
          lambda step: distributed.data_parallel_step(step, mesh,
                                                      replicated=eagle_train.REPLICATED))


def _pools(name: str, build):
  """build() once per job: process 0 first (it writes the feature cache), then the others."""
  return distributed.primary_first(name, build)


def _train(c: TrainSettings, init_params, opt, step_fn, batch_fn, eval_fn, progress,
           stop_after):
  """The training loop with the run's cadence (best checkpoint by tau)."""
  return loop.train(workdir=c.workdir, init_params=init_params, optimizer=opt, step_fn=step_fn,
                    batch_fn=batch_fn, num_steps=c.steps, eval_fn=eval_fn,
                    eval_every=c.eval_every, save_every=c.save_every, best_metric="tau",
                    log_every=c.log_every, progress=progress, stop_after=stop_after,
                    key=jax.random.key(c.seed), patience=c.patience)


def _finished(c: TrainSettings, result) -> bool:
  """Ran to the end (all steps, or an early stop); a killed run has not."""
  return result.step >= c.steps or result.early_stopped


def _warm_start(c: TrainSettings, model: Model, init, progress):
  """`init`, or the parameters of the checkpoint `c.init_from` (same method,
  same target; the entries `init` has, in its dtypes)."""
  if not c.init_from:
    return init
  params, card = checkpoints.load_drafter(c.init_from, model.params, model.cfg, method=c.method)
  missing = sorted(set(init) - set(params))
  if missing:
    raise ValueError(f"init_from={c.init_from!r} lacks {missing} of a {c.method} drafter")
  sub = {k: params[k] for k in init}
  if jax.tree.structure(sub) != jax.tree.structure(init) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(sub), jax.tree.leaves(init))):
    raise ValueError(f"init_from={c.init_from!r}: its {c.method} parameters have other "
                     "shapes than this run's (another head size or vocabulary?)")
  progress(f"warm start from {c.init_from} (trained {card.get('train_steps')} steps, "
           f"{card.get('train_positions')} positions)")
  return jax.tree.map(lambda a, b: jnp.asarray(b, a.dtype), init, sub)


def with_references(c: TrainSettings, tokenizer, records, train_recs, progress=None):
  """train_recs + `c.reference_examples` datasets' reference answers.

  Extra training data on top of the selected records (a train_positions
  prefix counts the target's answers only), from train_sources' sources (else
  `sources`); never validation, which measures the target's own answers, as
  drafting meets them. Examples the data already answers (validation's
  included) are left out."""
  ref = distill_data.reference_records(
      tokenizer, sources=_names(c.train_sources) or _names(c.sources),
      num_examples=c.reference_examples, seed=c.seed + 1,
      max_prompt_tokens=c.max_prompt_tokens, max_answer_tokens=c.max_new_tokens,
      valid_fraction=c.valid_fraction, skip_ids=[r["id"] for r in records])
  if progress:
    progress(f"data: + {len(ref)} reference answers of the datasets "
             f"({sum(len(r['answer']) for r in ref)} answer tokens), training only")
  return list(train_recs) + ref


def _grown_records(c: TrainSettings, model: Model, records, train_recs, valid_ids, progress):
  """The records grown on top of the selection (TrainSettings: grow_records,
  long_reference_examples), in order."""
  out = []
  if c.grow_records:
    every, _ = distill_data.select(records, valid_sequences=c.valid_sequences,
                                   valid_ids=valid_ids, train_sources=_names(c.train_sources),
                                   train_order=c.train_order)
    have = {r["id"] for r in train_recs}
    out = [r for r in every if r["id"] not in have]
    progress(f"data: + {len(out)} more training records after the train_positions prefix "
             f"({sum(len(r['answer']) for r in out)} answer tokens)")
  if c.long_reference_examples and model.tokenizer is not None:
    out += long_references(c, model.tokenizer, list(records) + list(train_recs), progress)
  return out


def long_references(c: TrainSettings, tokenizer, taken, progress=None):
  """Up to `c.long_reference_examples` reference answers of `c.long_sources`
  whose prompts are longer than max_prompt_tokens and at most
  long_prompt_tokens (whole documents; training only). Examples in `taken`
  (the records, validation's included, and the references already added) are
  left out."""
  if c.long_seq_len < c.long_prompt_tokens + 16:
    raise ValueError(f"long_seq_len={c.long_seq_len} cannot hold a {c.long_prompt_tokens}-token "
                     "prompt and its answer")
  done = {r["id"][len("ref:"):] if r["id"].startswith("ref:") else r["id"] for r in taken}
  ref = distill_data.reference_records(
      tokenizer, sources=_names(c.long_sources), num_examples=c.long_reference_examples,
      seed=c.seed + 2, min_prompt_tokens=c.max_prompt_tokens,
      max_prompt_tokens=c.long_prompt_tokens,
      max_answer_tokens=min(c.max_new_tokens, c.long_seq_len - c.long_prompt_tokens),
      valid_fraction=c.valid_fraction, skip_ids=sorted(done))
  if progress:
    progress(f"data: + {len(ref)} long reference answers ({', '.join(_names(c.long_sources))}: "
             f"{sum(len(r['prompt']) for r in ref)} prompt tokens, "
             f"{sum(len(r['answer']) for r in ref)} answer tokens), training only")
  return ref


LOSS_POSITIONS = ("answer", "sequence")


def check_loss_positions(c: TrainSettings) -> None:
  """A ValueError naming the problem, before any feature is computed."""
  if c.loss_positions not in LOSS_POSITIONS:
    raise ValueError(f"unknown loss_positions {c.loss_positions!r} (known: "
                     f"{', '.join(LOSS_POSITIONS)})")
  if c.bucket_weight not in ("answer", "loss"):
    raise ValueError(f"unknown bucket_weight {c.bucket_weight!r} (known: answer, loss)")
  if c.loss_positions == "sequence" and c.context != "sequence":
    raise ValueError("loss_positions='sequence' needs context='sequence' (windows start "
                     "near the answer and hold little of the prompt)")


def _epoch_steps(c: TrainSettings, pool, batch_fn) -> TrainSettings:
  """c with `steps` set from `epochs`: epochs x the training answer positions /
  the mean answer positions of a batch (from the run's first 16 batches)."""
  if not c.epochs:
    return c
  per_batch = np.mean([float(np.sum(batch_fn(s)["answer"])) for s in range(1, 17)])
  steps = int(np.ceil(c.epochs * pool.num_positions / max(per_batch, 1.0)))
  return dataclasses.replace(c, steps=max(steps, 1))


def _feature_cache(c: TrainSettings) -> Optional[str]:
  """The feature cache directory (none for the tiny test target)."""
  if c.model == TINY:
    return None
  return c.feature_cache or None


def _names(csv: str):
  """'a, b,c' -> ['a', 'b', 'c'] ('' -> [])."""
  return [x.strip() for x in csv.split(",") if x.strip()]


def _run_eagle(c: TrainSettings, model: Model, train_seqs, valid_seqs, progress, stop_after,
               t_start, grown_seqs=()):
  """EAGLE (c.method == 'eagle') or EAGLE-3 ('eagle3') head training; the
  `grown_seqs` (`_grown_records`) join the training pool after `train_seqs`,
  those longer than seq_len whole, their features computed at long_seq_len in
  shards of their own."""
  cfg = model.cfg
  fused = c.method == "eagle3"
  taps = eagle.eagle3_layers(cfg) if fused else ()
  check_loss_positions(c)
  t0 = time.perf_counter()

  def seq_pool(seqs, seq_len, prog=None):
    # EAGLE reads no taps: an EAGLE-3 run's shards of the same sequences serve it
    return eagle_train.SeqPool.build(model.params, cfg, seqs, seq_len=seq_len, taps=taps,
                                     top_k=c.teacher_top_k, batch_size=c.feature_batch,
                                     progress=prog, cache_dir=_feature_cache(c),
                                     reuse_taps=() if taps else (eagle.eagle3_layers(cfg),))

  short = list(train_seqs) + [s for s in grown_seqs if len(s[0]) <= c.seq_len]
  long = [s for s in grown_seqs if len(s[0]) > c.seq_len]
  if long and c.long_seq_len < max(len(s[0]) for s in long):
    progress(f"{sum(len(s[0]) > c.long_seq_len for s in long)} grown sequences are cut to "
             f"long_seq_len={c.long_seq_len}")

  def pools():
    train = seq_pool(short, c.seq_len, progress)
    if long:
      train = eagle_train.SeqPool.concat([train, seq_pool(long, c.long_seq_len, progress)])
    return train, seq_pool(valid_seqs, c.seq_len)

  pool, vpool = _pools("features", pools)
  train_seqs = short + long
  pool.bucket_weight = c.bucket_weight
  covered = vpool.covered_mass()
  progress(f"features: {pool.num_positions} train / {vpool.num_positions} valid positions in "
           f"{time.perf_counter() - t0:.0f}s; teacher top-{c.teacher_top_k or 'all'} "
           f"covers {covered:.4f} of the validation labels' mass")
  vocab = _reduced_vocab(c, cfg, train_seqs, progress)
  if c.head_init_layer is None:
    init = eagle.init_head(jax.random.key(c.seed), cfg, fused=fused, num_layers=c.head_layers)
  else:
    init = eagle.init_head_from_target(jax.random.key(c.seed), cfg, model.params,
                                       c.head_init_layer, fused=fused,
                                       num_layers=c.head_layers)
    progress(f"head initialised from target layer {c.head_init_layer}")
  head0 = _warm_start(c, model, init, progress)
  if c.context not in ("sequence", "window"):
    raise ValueError(f"unknown context {c.context!r} for EAGLE training (known: sequence, "
                     "window)")
  if c.loss_positions == "sequence":
    shared = pool.train_on_sequence()
    progress(f"loss on every position after the {shared}-token shared head: "
             f"{pool.num_loss_positions} positions ({pool.num_positions} of them answers)")

  def batch_fn(step):
    rng = np.random.default_rng([c.seed, step])
    if c.context == "sequence":
      b = pool.sequence_batch(rng, c.batch_tokens)
    else:
      b = pool.batch(rng, c.batch_windows, c.window)
    b = jax.tree.map(jnp.asarray, b)
    # the step's key as raw key data: a batch is plain arrays (split or
    # replicated over processes); the step wraps it back
    b["key"] = jax.random.key_data(jax.random.fold_in(jax.random.key(c.seed), step))
    return b

  c = _epoch_steps(c, pool, batch_fn)
  if c.epochs:
    progress(f"{c.epochs} epochs over {pool.num_positions} answer positions: {c.steps} steps")
  opt = loop.make_optimizer(c.lr, c.steps, c.warmup, c.weight_decay, c.clip)
  step_target, dp = _data_parallel(model)
  step_fn = dp(eagle_train.make_step(opt, step_target, cfg, vocab=vocab, steps=c.ttt_steps,
                                     w_reg=0.0 if fused else c.w_reg, w_cls=c.w_cls,
                                     decay=c.decay, noise=0.0 if fused else c.noise,
                                     dropout=c.feature_dropout))

  if c.context == "sequence":
    windows = vpool.eval_sequences(c.valid_max_windows or None)
  else:
    windows = vpool.eval_windows(c.window, c.valid_max_windows or None)

  def eval_fn(head):
    return eagle_train.estimate(head, model.params, cfg, windows, c.eval_k, vocab)

  result = _train(c, head0, opt, step_fn, batch_fn, eval_fn, progress, stop_after)
  out = {"step": result.step, "workdir": c.workdir, "train_positions": pool.num_positions,
         "valid_windows": len(windows), "teacher_covered_mass": covered,
         "early_stopped": result.early_stopped, "wall_s": time.perf_counter() - t_start}
  if not _finished(c, result) or not distributed.is_primary():
    return out  # stopped early, or not the process that exports
  best, best_step = loop.best_params(c.workdir, head0)
  best = best if best is not None else result.params
  final_eval = eval_fn(best)
  out.update(best_step=best_step, estimate=final_eval)
  if c.train_eval_sequences:  # the same estimate on training data: the overfitting gap
    seen = (pool.eval_sequences(c.train_eval_sequences) if c.context == "sequence" else
            pool.eval_windows(c.window, c.train_eval_sequences))
    out["train_estimate"] = eagle_train.estimate(best, model.params, cfg, seen, c.eval_k, vocab)
  if c.export:
    params = dict(best, vocab_rank=_vocab_rank(cfg, train_seqs),
                  **({} if vocab is None else {"vocab": vocab}))
    card = {"method": c.method, "fused_layers": list(taps), "head_layers": c.head_layers,
            "draft_vocab": 0 if vocab is None else int(len(vocab)),
            "target": c.model, "target_fingerprint": checkpoints.target_fingerprint(
                model.params, cfg),
            "config": c.config(), "train_steps": result.step, "best_step": best_step,
            "init_from": c.init_from or None,
            "train_positions": pool.num_positions, "valid_windows": len(windows),
            "teacher_covered_mass": covered, "estimated": final_eval,
            "wall_s": round(time.perf_counter() - t_start, 1)}
    checkpoints.save_drafter(c.export, params, card)
    out["export"] = c.export
    progress(f"exported {c.export}")
  return out


def _vocab_rank(cfg, train_seqs) -> jax.Array:
  """Every token id, most frequent in the training answers first (exported as
  "vocab_rank": draft_vocab=N chooses a vocabulary at load time)."""
  return jnp.asarray(eagle_train.token_rank(eagle_train.token_counts(train_seqs, cfg.vocab_size)),
                     jnp.int32)


def _reduced_vocab(c: TrainSettings, cfg, train_seqs, progress):
  if not c.draft_vocab:
    return None
  counts = eagle_train.token_counts(train_seqs, cfg.vocab_size)
  vocab = eagle_train.reduced_vocab(counts, c.draft_vocab, always=(cfg.eos_id,))
  covered = counts[vocab].sum() / max(counts.sum(), 1)
  progress(f"reduced draft vocabulary: {len(vocab)} tokens cover {covered:.1%} of the "
           "training answers' tokens")
  return jnp.asarray(vocab)


def _run_draft_model(c: TrainSettings, model: Model, train_seqs, valid_seqs, progress,
                     stop_after, t_start):
  """A small independent draft model distilled from the target (draft_train)."""
  cfg = model.cfg
  scfg = draft_model_lib.student_config(cfg, c.draft_layers)
  init_layers = draft_train.parse_init_layers(c.init_layers, cfg.num_layers, c.draft_layers)
  check_loss_positions(c)
  t0 = time.perf_counter()
  # shards an EAGLE-3 run of the same data and teacher top-K left serve here too
  reuse = (eagle.eagle3_layers(cfg),)
  pool, vpool = _pools("features", lambda: tuple(
      eagle_train.SeqPool.build(model.params, cfg, seqs, seq_len=c.seq_len,
                                top_k=c.teacher_top_k, batch_size=c.feature_batch,
                                progress=progress if seqs is train_seqs else None,
                                cache_dir=_feature_cache(c), reuse_taps=reuse)
      for seqs in (train_seqs, valid_seqs)))
  progress(f"features: {pool.num_positions} train / {vpool.num_positions} valid positions in "
           f"{time.perf_counter() - t0:.0f}s; teacher top-{c.teacher_top_k or 'all'} "
           f"covers {vpool.covered_mass():.4f} of the validation labels' mass")
  if c.loss_positions == "sequence":
    shared = pool.train_on_sequence()
    progress(f"loss on every position after the {shared}-token shared head: "
             f"{pool.num_loss_positions} positions ({pool.num_positions} of them answers)")
  vocab = _reduced_vocab(c, cfg, train_seqs, progress)
  student0 = _warm_start(c, model, draft_train.init_student(model.params, cfg, init_layers),
                         progress)
  step_target, dp = _data_parallel(model)
  order = draft_train.length_order(pool)

  def batch_fn(step):
    rng = np.random.default_rng([c.seed, step])
    return jax.tree.map(jnp.asarray,
                        draft_train.sequence_batch(pool, order, rng, c.batch_seqs, c.seq_len))

  c = _epoch_steps(c, pool, batch_fn)
  if c.epochs:
    progress(f"{c.epochs} epochs over {pool.num_positions} answer positions: {c.steps} steps")
  opt = loop.make_optimizer(c.lr, c.steps, c.warmup, c.weight_decay, c.clip)
  step_fn = dp(draft_train.make_step(opt, step_target, cfg, scfg, vocab=vocab, loss=c.loss))

  def eval_fn(student):
    return draft_train.estimate(student, model.params, cfg, scfg, vpool, c.eval_k, vocab,
                                batch_seqs=c.batch_seqs, max_len=c.seq_len,
                                max_seqs=c.valid_max_seqs or None)

  result = _train(c, student0, opt, step_fn, batch_fn, eval_fn, progress, stop_after)
  out = {"step": result.step, "workdir": c.workdir, "train_positions": pool.num_positions,
         "valid_positions": vpool.num_positions, "wall_s": time.perf_counter() - t_start}
  if not _finished(c, result) or not distributed.is_primary():
    return out  # stopped early, or not the process that exports
  best, best_step = loop.best_params(c.workdir, student0)
  best = best if best is not None else result.params
  final_eval = eval_fn(best)
  initial_eval = eval_fn(student0)
  out.update(best_step=best_step, estimate=final_eval, estimate_at_init=initial_eval)
  if c.export:
    store = jnp.dtype(c.store_dtype)
    params = dict(jax.tree.map(lambda x: x.astype(store), best),
                  vocab_rank=_vocab_rank(cfg, train_seqs),
                  **({} if vocab is None else {"vocab": vocab}))
    card = {"method": "draft_model", "num_layers": c.draft_layers,
            "init_layers": list(init_layers), "loss": c.loss, "store_dtype": c.store_dtype,
            "draft_vocab": 0 if vocab is None else int(len(vocab)),
            "target": c.model, "target_fingerprint": checkpoints.target_fingerprint(
                model.params, cfg),
            "config": c.config(), "train_steps": c.steps, "best_step": best_step,
            "train_positions": pool.num_positions, "valid_positions": vpool.num_positions,
            "estimated": final_eval, "estimated_at_init": initial_eval,
            "wall_s": round(time.perf_counter() - t_start, 1)}
    checkpoints.save_drafter(c.export, params, card)
    out["export"] = c.export
    progress(f"exported {c.export}")
  return out
