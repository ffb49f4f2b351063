"""EAGLE / EAGLE-3 heads: training (tiny target, seconds), exact resume,
checkpoints, greedy identity, the training-time unroll against real drafting,
and the state-equivalence of the head after rejections and all-accept rounds."""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import chain, eagle, eagle_tree
from specjax.drafters.base import Context, Target
from specjax.drafters.replay import Replay, replay_params
from specjax.drafters.union import Union
from specjax.models import cache as cache_lib
from specjax.io import checkpoints
from specjax.training import eagle_train, features, loop, run
from specjax.training.settings import TrainSettings

pytestmark = pytest.mark.slow  # tiny EAGLE / EAGLE-3 training runs (~3 min): the full suite, not the fast tier

T1 = sampling_lib.SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_config):
  """Tiny-trained heads: EAGLE (full vocabulary), EAGLE-3 (reduced vocabulary)
  and EAGLE-3 with a 2-layer head."""
  root = tmp_path_factory.mktemp("eagle")
  out = {}
  for name, cfg_file, variant in (("eagle", "eagle.py", "tiny"),
                                  ("eagle3", "eagle3.py", "tiny_reduced"),
                                  ("eagle3_l2", "eagle3.py", "tiny_reduced_l2")):
    c = TrainSettings.of(load_config(cfg_file, variant, workdir=root / name,
                                     export=root / name / "export"))
    out[name] = (c, run.run(c, progress=lambda s: None))
  return out, root


@pytest.fixture(scope="module")
def tiny_target(trained):
  (c, _), = [trained[0]["eagle"]]
  return run._target(c)  # pylint: disable=protected-access


def _method(name):
  """'eagle3_l2' -> 'eagle3' (the trained variants' method)."""
  return name.split("_")[0]


def _load(trained, name, model):
  c, _ = trained[0][name]
  params, card = checkpoints.load_drafter(c.export, model.params, model.cfg,
                                          method=_method(name))
  assert params["vocab_rank"].shape == (model.cfg.vocab_size,)
  params = eagle.with_draft_vocab(params, None, model.cfg)
  return eagle.prepare(params, model.params, model.cfg), card


@pytest.mark.parametrize("name", ["eagle", "eagle3", "eagle3_l2"])
def test_tiny_training_lowers_the_loss_and_exports(trained, tiny_target, name):
  c, out = trained[0][name]
  hist = [json.loads(x) for x in open(os.path.join(c.workdir, "metrics.jsonl"))]
  losses = [h["loss"] for h in hist if "loss" in h]
  assert len(losses) >= 3 and losses[-1] < losses[0] - 0.02, losses
  accs = [h["acc0"] for h in hist if "acc0" in h]
  assert accs[-1] > accs[0], accs
  assert out["estimate"]["tau"] >= 1.0 and 1.0 <= out["estimate"]["tau_t1"] <= 1 + c.eval_k
  assert 1.0 <= out["estimate"]["tau_rounds"] <= 1 + c.eval_k
  params, card = _load(trained, name, tiny_target)
  assert card["method"] == _method(name) and card["best_step"] == out["best_step"]
  assert ("fuse" in params) == (_method(name) == "eagle3")
  assert len(eagle.head_layers(params)) == card["head_layers"] == (2 if name == "eagle3_l2" else 1)
  if _method(name) == "eagle3":  # reduced vocabulary: stored ids, EOS-independent here (eos -1)
    assert params["vocab"].shape == (c.draft_vocab,)
    assert params["lm_rows"].shape == (c.draft_vocab, tiny_target.cfg.dim)
    assert card["draft_vocab"] == c.draft_vocab


def test_warm_start_reads_an_exported_head(trained, tiny_target):
  """init_from: a run continues from an exported head (grown data); a head of
  another method or shape is refused."""
  c, _ = trained[0]["eagle3"]
  init = eagle.init_head(jax.random.key(5), tiny_target.cfg, fused=True)
  warm = run._warm_start(dataclasses.replace(c, init_from=str(c.export)), tiny_target, init,  # pylint: disable=protected-access
                         lambda s: None)
  stored, _ = checkpoints.load_drafter(c.export, tiny_target.params, tiny_target.cfg,
                                       method="eagle3")
  for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves({k: stored[k] for k in init})):
    np.testing.assert_array_equal(a, b)
  assert run._warm_start(c, tiny_target, init, None) is init  # pylint: disable=protected-access
  with pytest.raises(checkpoints.CheckpointError, match="not 'eagle'"):
    run._warm_start(dataclasses.replace(c, method="eagle", init_from=str(c.export)),  # pylint: disable=protected-access
                    tiny_target, init, lambda s: None)
  other = eagle.init_head(jax.random.key(5), tiny_target.cfg, fused=False)
  with pytest.raises(ValueError, match="lacks|other shapes"):
    run._warm_start(dataclasses.replace(c, init_from=str(c.export)), tiny_target,  # pylint: disable=protected-access
                    dict(other, extra=jnp.zeros(3)), lambda s: None)


def test_bad_warm_start_or_data_selection_refused_before_the_data(trained, tmp_path):
  """A checkpoint of another method, a directory that is none, a missing
  validation-ids file or a negative count stops the run before any data is
  read or generated."""
  c, _ = trained[0]["eagle3"]
  said = []
  bad = [(dict(method="eagle", init_from=str(c.export)), checkpoints.CheckpointError,
          "not 'eagle'"),
         (dict(init_from=str(tmp_path)), checkpoints.CheckpointError, "not a drafter checkpoint"),
         (dict(valid_ids_path=str(tmp_path / "ids.json")), FileNotFoundError,
          "valid_ids_path=.*ids.json.*no such file"),
         (dict(train_positions=-5), ValueError, "train_positions must be a whole number")]
  for i, (fields, error, match) in enumerate(bad):
    wd = tmp_path / f"wd{i}"
    with pytest.raises(error, match=match):
      run.run(dataclasses.replace(c, workdir=str(wd), export="", **fields), progress=said.append)
    assert not wd.exists()
  assert not said, said  # nothing ran: no data, no features


class _PoolsBuilt(Exception):
  """Raised where a run would start the head: its feature pools are built."""


def test_eagle_training_reads_an_eagle3_runs_feature_shards(tmp_path, load_config, monkeypatch):
  """EAGLE reads no taps: an EAGLE-3 run's cached shards of the same data (they
  hold the final features and the teacher top-K too) serve its training and
  validation pools, none computed again."""
  monkeypatch.setattr(run, "_feature_cache", lambda c: str(tmp_path / "features"))  # tiny: none

  def stop(*args, **kwargs):
    raise _PoolsBuilt

  monkeypatch.setattr(eagle, "init_head", stop)
  said = {}
  for name in ("eagle3", "eagle"):
    c = TrainSettings.of(load_config(f"{name}.py", "tiny", workdir=tmp_path / name, export=""))
    said[name] = []
    with pytest.raises(_PoolsBuilt):
      run.run(c, progress=said[name].append)

  def counts(lines):
    """[(shards loaded, shards computed)] of each pool the run built."""
    return [tuple(int(x) for x in m.groups()) for m in
            (re.search(r"/(\d+) sequences \((\d+) shards loaded, (\d+) computed", l)
             for l in lines) if m]

  first, second = counts(said["eagle3"]), counts(said["eagle"])
  assert first and all(loaded == 0 and computed > 0 for _, loaded, computed in first), first
  assert ([n for n, _, _ in second] == [n for n, _, _ in first]
          and all(computed == 0 for _, _, computed in second)), (first, second)


def test_killed_eagle3_run_resumes_to_identical_parameters(trained, load_config):
  (c, _), root = trained[0]["eagle3"], trained[1]
  cut = TrainSettings.of(load_config("eagle3.py", "tiny_reduced", workdir=root / "cut",
                                     export=""))
  first = run.run(cut, progress=lambda s: None, stop_after=15)  # "killed" after step 15
  assert first["step"] == 15
  resumed = run.run(cut, progress=lambda s: None)  # from the step-10 checkpoint
  assert resumed["step"] == c.steps
  a, step_a = loop.latest_params(c.workdir)
  b, step_b = loop.latest_params(cut.workdir)
  assert step_a == step_b == c.steps
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checkpoint_kind_and_head_shape_are_checked(trained, tiny_target):
  c, _ = trained[0]["eagle"]
  with pytest.raises(checkpoints.CheckpointError, match="not 'eagle3'"):
    checkpoints.load_drafter(c.export, method="eagle3")
  params, _ = _load(trained, "eagle", tiny_target)
  with pytest.raises(ValueError, match="EAGLE head"):
    eagle.Eagle(k=2, fused=True).check(tiny_target.cfg, params)
  with pytest.raises(ValueError, match="cannot serve a target of width"):
    eagle.Eagle(k=2).check(tiny_target.cfg.replace(dim=32), params)
  with pytest.raises(ValueError, match="needs a trained head"):
    eagle.Eagle(k=2).check(tiny_target.cfg, None)


@pytest.mark.parametrize("name", ["eagle", "eagle3", "eagle3_l2"])
def test_greedy_eagle_equals_ar(trained, tiny_target, name):
  m = tiny_target
  params, _ = _load(trained, name, m)
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30]]
  ref = ar.generate(m.params, m.cfg, prompts, max_new_tokens=20).tokens
  fused = _method(name) == "eagle3"
  res = sp.generate(m.params, m.cfg, eagle.Eagle(k=3, fused=fused), prompts,
                    draft_params=params, max_new_tokens=20)
  assert res.tokens == ref
  assert res.stats["accepted"] > 0
  # dynamic draft length: rows stop drafting when the head is unsure
  dyn = sp.generate(m.params, m.cfg, eagle.Eagle(k=3, fused=fused, draft_stop=0.5),
                    prompts, draft_params=params, max_new_tokens=20)
  assert dyn.tokens == ref
  width = lambda r: r.stats["verified_tokens"] / r.stats["rounds"]  # pylint: disable=unnecessary-lambda-assignment
  assert width(dyn) < width(res) == 4


@pytest.mark.parametrize("name", ["eagle3", "eagle3_l2"])
def test_training_unroll_is_what_drafting_computes(trained, tiny_target, name):
  """Step s of the training-time unroll at position c + s equals the head's
  (s+1)-th drafted output after a cache of true-feature pairs up to c (every
  head layer's cache)."""
  m = tiny_target
  params, _ = _load(trained, name, m)
  cfg, t, c0, steps = m.cfg, 12, 5, 3
  rng = np.random.default_rng(0)
  toks = rng.integers(3, cfg.vocab_size, size=(1, t + 1)).astype(np.int32)
  taps = eagle.eagle3_layers(cfg)
  feats, _, _ = features._forward(  # pylint: disable=protected-access
      m.params, cfg, jnp.asarray(toks), taps, 0)
  d = cfg.dim
  batch = {"g": feats[:, :t, :-d], "tokens": jnp.asarray(toks[:, 1:t + 1]),
           "positions": jnp.arange(t, dtype=jnp.int32)[None]}
  outs = eagle_train.unroll(params, m.params, cfg, batch, steps)
  # drafting: pairs 0..c0 from true features, then the head's own outputs
  cache = cache_lib.init_cache(eagle.head_config(cfg, len(eagle.head_layers(params))), 1, 32,
                               dtype=jnp.float32)
  g = eagle.fuse(params, cfg, batch["g"][:, :c0 + 1])
  a, cache = eagle.head_step(params, m.params, cfg, g, batch["tokens"][:, :c0 + 1],
                             batch["positions"][:, :c0 + 1], cache)
  a_prev = a[:, -1]
  np.testing.assert_allclose(a_prev, outs[0][:, c0], atol=2e-5, rtol=1e-5)
  for s in range(1, steps):
    j = c0 + s
    a, cache = eagle.head_step(params, m.params, cfg, a_prev[:, None],
                               batch["tokens"][:, j:j + 1], batch["positions"][:, j:j + 1],
                               cache)
    a_prev = a[:, 0]
    np.testing.assert_allclose(a_prev, outs[s][:, j], atol=2e-5, rtol=1e-5)


# --- state equivalence --------------------------------------------------------------


def _forced_rule(n_forced):
  """Accept exactly min(n_forced, proposed) guesses; the next token is the
  target's argmax there (a greedy correction, or the bonus after all-accept)."""
  def rule(keys, tokens, q, p, num_proposed, logits):
    n = jnp.minimum(jnp.asarray(n_forced, jnp.int32), num_proposed)
    nxt = jnp.argmax(jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0], -1)
    return n, nxt.astype(jnp.int32)
  rule.exact = True
  return rule


@functools.partial(jax.jit, static_argnames=("cfg", "drafter"))
def _forced_round(params, cfg, drafter, dparams, state, n_forced):
  """One greedy round keeping min(n_forced, proposed) guesses. `n_forced` is
  traced: one program serves every kind of round."""
  spec = sp.SpecConfig(sampling=sampling_lib.GREEDY, rule=_forced_rule(n_forced))
  return sp.spec_round(params, cfg, drafter, dparams, spec, state)


class _OffByOne(eagle.Eagle):
  """Negative control: commits the verify features shifted by one position."""

  def commit(self, params, state, ctx, verify):
    shifted = jnp.concatenate([verify.hidden[:, 1:], verify.hidden[:, -1:]], axis=1)
    return super().commit(params, state, ctx, verify.replace(hidden=shifted))


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "num_slots"))
def _fresh_proposal_jit(params, cfg, drafter, dparams, toks, plen, num_slots, ctx, cache, keys):
  b, width = toks.shape
  tcache = cache_lib.init_cache(cfg, b, num_slots)
  pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
  from specjax.models import transformer  # pylint: disable=import-outside-toplevel
  _, hidden, _ = transformer.forward(params, cfg, toks, pos, tcache,
                                     hidden_layers=drafter.layers_for(cfg))
  target = Target(params, cfg)
  fresh = drafter.init(dparams, target, toks, plen, num_slots, hidden=hidden)
  return drafter.propose(dparams, target, fresh, ctx, cache, keys)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "drafter"))
def _live_proposal_jit(params, cfg, drafter, dparams, dstate, ctx, cache, keys):
  return drafter.propose(dparams, Target(params, cfg), dstate, ctx, cache, keys)[0]


def _fresh_proposal(m, drafter, dparams, state, ctx, keys):
  """The drafter freshly prefilled on each row's committed prefix, and its proposal."""
  hist, length = np.asarray(state.history), np.asarray(state.length)
  b = hist.shape[0]
  plen = length - 1  # the newest committed token is the "first generated" one
  # Right-padded to a width of 16 or 32, as a ragged prompt batch is: two
  # programs for every round instead of one per prefix length.
  width = cache_lib.round_up(int(plen.max()), 16)
  toks = np.zeros((b, width), np.int32)
  for i in range(b):
    toks[i, :plen[i]] = hist[i, :plen[i]]
  return _fresh_proposal_jit(m.params, m.cfg, drafter, dparams, jnp.asarray(toks),
                             jnp.asarray(plen), state.cache.num_slots, ctx, state.cache, keys)


def _live_and_fresh(m, drafter, dparams, state, seed):
  """The next proposal from the live drafter state and from a fresh prefill."""
  keys = jax.random.split(jax.random.key(seed), 2)
  ctx = Context(history=state.history, length=state.length, prompt_len=state.prompt_len,
                active=~state.done)
  live = _live_proposal_jit(m.params, m.cfg, drafter, dparams, state.drafter, ctx, state.cache,
                            keys)
  return live, _fresh_proposal(m, drafter, dparams, state, ctx, keys)


def _live_matches_fresh(m, drafter, dparams, state, seed, must_match, label) -> bool:
  """Whether the live state's next proposal (tokens and q) is a fresh
  prefill's; asserted when `must_match` (a negative control only records it)."""
  live, fresh = _live_and_fresh(m, drafter, dparams, state, seed)
  if must_match:
    np.testing.assert_array_equal(live.tokens, fresh.tokens, err_msg=label)
    np.testing.assert_allclose(live.q, fresh.q, atol=1e-5, err_msg=label)
  return (np.array_equal(np.asarray(live.tokens), np.asarray(fresh.tokens)) and
          np.allclose(np.asarray(live.q), np.asarray(fresh.q), atol=1e-5))


@pytest.mark.parametrize("name", ["eagle", "eagle3", "eagle3_l2"])
def test_state_equals_a_fresh_prefill_after_every_kind_of_round(trained, tiny_target, name):
  m = tiny_target
  dparams, _ = _load(trained, name, m)
  k = 3
  fused = _method(name) == "eagle3"
  prompts = [[5, 9, 3, 17, 4, 22, 7], [8, 8, 30]]  # ragged rows
  cases = [("reject at 0", 0), ("mid-chain", 1), ("all-accept", k), ("all-accept", k),
           ("reject at 0", 0)]
  for cls, must_match in ((eagle.Eagle, True), (_OffByOne, False)):
    drafter = cls(k=k, sampling=T1, fused=fused)
    state = sp.start(m.params, m.cfg, drafter, prompts, draft_params=dparams, key=3,
                     max_new_tokens=40, spec=sp.SpecConfig(sampling=sampling_lib.GREEDY))
    mismatches = []
    for i, (label, n) in enumerate(cases):
      before = np.asarray(state.length)
      state = _forced_round(m.params, m.cfg, drafter, dparams, state, n)
      assert (np.asarray(state.length) - before).tolist() == [n + 1] * 2, label
      mismatches.append(not _live_matches_fresh(m, drafter, dparams, state, 100 + i,
                                                must_match, label))
    if not must_match:  # the control is caught once a round accepted guesses
      assert any(mismatches[1:]), mismatches


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "spec"))
def _tree_round(params, cfg, drafter, dparams, spec, state):
  return sp.spec_round(params, cfg, drafter, dparams, spec, state)


@pytest.mark.parametrize("name", ["eagle3", "eagle3_l2"])
def test_tree_state_equals_a_fresh_prefill_after_each_round(trained, tiny_target, name):
  """After a tree round (the accepted path's verify features committed as a
  chain, whatever nodes it took), the head's state and so its next tree are
  those of a head freshly prefilled on the committed prefix."""
  m = tiny_target
  dparams, _ = _load(trained, name, m)
  drafter = eagle_tree.EagleTree(k=3, tree_topk=2, tree_width=2, tree_nodes=6, fused=True)
  spec = sp.SpecConfig(sampling=sampling_lib.GREEDY)
  state = sp.start(m.params, m.cfg, drafter, [[5, 9, 3, 17, 4, 22, 7], [8, 8, 30]],
                   draft_params=dparams, key=3, max_new_tokens=40, spec=spec)
  accepted = set()
  for i in range(5):
    before = np.asarray(state.length)
    state = _tree_round(m.params, m.cfg, drafter, dparams, spec, state)
    accepted |= set((np.asarray(state.length) - before - 1).tolist())
    live, fresh = _live_and_fresh(m, drafter, dparams, state, 100 + i)
    np.testing.assert_array_equal(live.tokens, fresh.tokens, err_msg=f"round {i}")
    np.testing.assert_array_equal(live.parent, fresh.parent, err_msg=f"round {i}")
  assert len(accepted) > 1, accepted  # rounds of different accepted lengths were covered


def test_union_part_state_equals_a_fresh_prefill_after_paths_another_part_drafted(
    trained, tiny_target):
  """In a union (`specjax/drafters/union.py`) the EAGLE-3 part is handed the
  tree's accepted path whichever part drafted it. A replay of AR's answer with
  every third token wrong drafts first, so rounds accept its paths of 0-2
  guesses (or the head's own); after each round the head's next proposal is
  that of a head freshly prefilled on the committed prefix. The off-by-one
  commit (the control) is caught."""
  m = tiny_target
  dparams, _ = _load(trained, "eagle3", m)
  prompts = [[5, 9, 3, 17, 4, 22, 7], [8, 8, 30]]
  ref = ar.generate(m.params, m.cfg, prompts, max_new_tokens=40).tokens
  wrong = [[(t + 1) % m.cfg.vocab_size if i % 3 == 2 else t for i, t in enumerate(r)]
           for r in ref]
  spec = sp.SpecConfig(sampling=sampling_lib.GREEDY)
  for cls, must_match in ((eagle.Eagle, True), (_OffByOne, False)):
    part = cls(k=3, sampling=T1, fused=True)
    union = Union(k=3, parts=(Replay(k=3), part))
    params = (replay_params(wrong), dparams)
    state = sp.start(m.params, m.cfg, union, prompts, draft_params=params, key=3,
                     max_new_tokens=40, spec=spec)
    accepted, mismatches = set(), []
    for i in range(5):
      before = np.asarray(state.length)
      state = _tree_round(m.params, m.cfg, union, params, spec, state)
      accepted |= set((np.asarray(state.length) - before - 1).tolist())
      mismatches.append(not _live_matches_fresh(
          m, part, dparams, state.replace(drafter=state.drafter[1]), 100 + i, must_match,
          f"round {i}"))
    if must_match:
      assert len(accepted - {0}) > 1, accepted  # paths of different lengths were followed
    else:
      assert any(mismatches), mismatches


def test_reduced_vocabulary_helpers():
  counts = np.array([5, 0, 9, 9, 1, 7])
  assert eagle_train.reduced_vocab(counts, 3).tolist() == [2, 3, 5]
  assert eagle_train.reduced_vocab(counts, 3, always=(1,)).tolist() == [1, 2, 3]
  c = eagle_train.token_counts([([4, 4, 2, 2, 2], 2), ([1, 2], 1)], 6)
  assert c.tolist() == [0, 0, 4, 0, 0, 0]


def test_draft_vocabulary_is_chosen_at_load(trained, tiny_target):
  cfg = tiny_target.cfg
  for name in ("eagle", "eagle3"):
    c, _ = trained[0][name]
    raw, _ = checkpoints.load_drafter(c.export, method=name)
    rank = np.asarray(raw["vocab_rank"])
    assert sorted(rank.tolist()) == list(range(cfg.vocab_size))  # a permutation
    full = eagle.with_draft_vocab(raw, "full", cfg)
    assert "vocab" not in full and "vocab_rank" not in full
    small = eagle.with_draft_vocab(raw, "10", cfg)
    assert len(small["vocab"]) == 10
    allowed = np.asarray(raw["vocab"]) if "vocab" in raw else rank
    assert set(np.asarray(small["vocab"]).tolist()) <= set(allowed.tolist())
    with pytest.raises(ValueError, match="draft_vocab"):
      eagle.with_draft_vocab(raw, "lots", cfg)
    with pytest.raises(ValueError, match="must lie in"):
      eagle.with_draft_vocab(raw, cfg.vocab_size + 1, cfg)
  del raw["vocab_rank"]
  with pytest.raises(ValueError, match="token ranking"):
    eagle.with_draft_vocab(raw, 5, cfg)


def test_a_draft_vocabulary_cannot_grow_past_the_trained_one(tiny_target):
  """A head trained on 8 tokens asked for 24 would run with its 8 while the
  run's records said 24: refused by name; 8 or fewer narrow it."""
  cfg, rank, within = tiny_target.cfg, np.arange(32)[::-1], np.arange(8)
  assert chain.ranked_vocab(rank, 8, cfg, within).tolist() == list(range(8))
  assert len(chain.ranked_vocab(rank, 4, cfg, within)) == 4
  with pytest.raises(ValueError, match="draft_vocab=24: this drafter was trained on 8 tokens"):
    chain.ranked_vocab(rank, 24, cfg, within)


def test_head_initialised_from_a_target_layer(tiny_target):
  """head_init_layer: the head's layer is a float32 copy of the target's, the
  EAGLE-3 fusion passes the high tap through and the norm is the target's final
  norm; an index outside the target is refused by name."""
  params, cfg = tiny_target.params, tiny_target.cfg
  head = eagle.init_head_from_target(jax.random.key(0), cfg, params, -1, fused=True)
  for name, w in params["layers"][cfg.num_layers - 1].items():
    np.testing.assert_array_equal(np.asarray(head["layer"][name]),
                                  np.asarray(w, np.float32), err_msg=name)
    assert head["layer"][name].dtype == jnp.float32
  np.testing.assert_array_equal(head["norm"], np.asarray(params["final_norm"], np.float32))
  feats = jax.random.normal(jax.random.key(1), (2, 5, 3 * cfg.dim))
  high = eagle._unit_rms(feats[..., 2 * cfg.dim:], cfg.norm_eps)  # pylint: disable=protected-access
  np.testing.assert_allclose(eagle.fuse(head, cfg, feats), high, atol=0.1)
  random_head = eagle.init_head(jax.random.key(0), cfg, fused=True)
  assert not np.allclose(random_head["layer"]["wqkv"], head["layer"]["wqkv"])
  assert set(random_head) == set(head)  # the same pytree: checkpoints, warm starts
  with pytest.raises(ValueError, match="head_init_layer"):
    eagle.init_head_from_target(jax.random.key(0), cfg, params, cfg.num_layers, fused=True)


def test_a_deeper_head_extends_the_one_layer_head(tiny_target):
  """init_head(num_layers=2) is the one-layer head plus "layer_1" (the same
  draws for the rest: one-layer checkpoints and seeds are unchanged); its
  second layer changes what the head computes; fewer than one layer is refused."""
  params, cfg = tiny_target.params, tiny_target.cfg
  one = eagle.init_head(jax.random.key(0), cfg, fused=True)
  two = eagle.init_head(jax.random.key(0), cfg, fused=True, num_layers=2)
  assert set(two) - set(one) == {"layer_1"} and set(one) <= set(two)
  for key in one:
    for a, b in zip(jax.tree.leaves(one[key]), jax.tree.leaves(two[key])):
      np.testing.assert_array_equal(a, b, err_msg=key)
  assert len(eagle.head_layers(two)) == 2 and len(eagle.head_layers(one)) == 1
  g = jax.random.normal(jax.random.key(1), (1, 4, cfg.dim))
  toks = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
  pos = jnp.arange(4, dtype=jnp.int32)[None]
  outs = []
  for head in (one, two):
    cache = cache_lib.init_cache(eagle.head_config(cfg, len(eagle.head_layers(head))), 1, 8,
                                 dtype=jnp.float32)
    a, cache = eagle.head_step(head, params, cfg, g, toks, pos, cache)
    assert len(cache.k) == len(eagle.head_layers(head))
    outs.append(np.asarray(a))
  assert np.abs(outs[0] - outs[1]).max() > 1e-4
  with pytest.raises(ValueError, match="at least one layer"):
    eagle.init_head(jax.random.key(0), cfg, fused=True, num_layers=0)


def test_feature_dropout_zeroes_the_fused_features_in_training_steps_only(tiny_target):
  """feature_dropout: the unroll scaled by `keep` changes outputs only from
  the first dropped position on (causal), an all-ones keep changes nothing
  (to rounding: it is another program); a
  step with dropout is reproducible from its key and differs from one
  without; a rate outside [0, 1) is refused by name."""
  m = tiny_target
  cfg, t = m.cfg, 10
  head = eagle.init_head(jax.random.key(0), cfg, fused=True)
  rng = np.random.default_rng(1)
  batch = {"g": jnp.asarray(rng.standard_normal((1, t, 3 * cfg.dim)), jnp.float32),
           "tokens": jnp.asarray(rng.integers(3, cfg.vocab_size, (1, t)), jnp.int32),
           "positions": jnp.arange(t, dtype=jnp.int32)[None]}
  # One jitted unroll (two traces: without `keep` and with it), not op-by-op
  # dispatch: eager unrolls build ~90 small executables.
  unroll = jax.jit(lambda keep: eagle_train.unroll(head, m.params, cfg, batch, 2, keep=keep))
  base = unroll(jnp.ones((1, t, cfg.dim)))
  plain = unroll(None)  # another program: equal up to its fusion's rounding
  np.testing.assert_allclose(plain[1], base[1], rtol=1e-5, atol=1e-5)
  dropped = unroll(jnp.ones((1, t, cfg.dim)).at[:, 6].set(0.0))
  np.testing.assert_array_equal(dropped[0][:, :6], base[0][:, :6])
  assert not np.allclose(dropped[0][:, 6], base[0][:, 6])
  opt = loop.make_optimizer(1e-3, 10, 1, 0.0, 1.0)
  b = dict(batch, answer=jnp.ones((1, t), jnp.float32),
           f_next=jnp.asarray(rng.standard_normal((1, t, cfg.dim)), jnp.float32),
           key=jax.random.key_data(jax.random.key(3)))
  state = (head, opt.init(head))
  with_dropout = eagle_train.make_step(opt, m.params, cfg, steps=2, w_reg=0.0, w_cls=1.0,
                                       dropout=0.5)
  without = eagle_train.make_step(opt, m.params, cfg, steps=2, w_reg=0.0, w_cls=1.0,
                                  dropout=0.0)
  losses = [float(step(*state, b)[2]["loss"]) for step in (with_dropout, with_dropout, without)]
  assert losses[0] == losses[1] and losses[0] != losses[2]
  with pytest.raises(ValueError, match="dropout"):
    eagle_train.make_step(opt, m.params, cfg, dropout=1.0)


def test_loss_on_prompt_positions_reaches_the_gradient_only_when_asked(tiny_target):
  """The step's loss reads batch["loss"] when present (loss_positions =
  'sequence'), else the answer mask: a "loss" mask equal to the answer mask
  gives the same loss, a wider one another; bad settings are refused by name."""
  m = tiny_target
  cfg, t = m.cfg, 10
  head = eagle.init_head(jax.random.key(0), cfg, fused=True)
  rng = np.random.default_rng(2)
  answer = jnp.asarray((np.arange(t) >= 6)[None], jnp.float32)
  batch = {"g": jnp.asarray(rng.standard_normal((1, t, 3 * cfg.dim)), jnp.float32),
           "tokens": jnp.asarray(rng.integers(3, cfg.vocab_size, (1, t)), jnp.int32),
           "positions": jnp.arange(t, dtype=jnp.int32)[None], "answer": answer,
           "f_next": jnp.asarray(rng.standard_normal((1, t, cfg.dim)), jnp.float32)}
  loss = jax.jit(lambda b: eagle_train.loss_fn(head, m.params, cfg, b, None, None, steps=2,
                                               w_reg=0.0, w_cls=1.0, decay=0.8)[0])
  base = float(loss(batch))
  assert float(loss(dict(batch, loss=answer))) == base
  assert float(loss(dict(batch, loss=jnp.ones((1, t), jnp.float32)))) != base
  for bad, match in ((dict(loss_positions="prompt"), "unknown loss_positions"),
                     (dict(loss_positions="sequence", context="window"), "needs context")):
    with pytest.raises(ValueError, match=match):
      run.check_loss_positions(TrainSettings(method="eagle3", **bad))


def test_estimate_with_stored_target_stats_equals_the_full_lm_head(tiny_target):
  """With a reduced vocabulary the estimate keeps each window's target argmax
  and log-normaliser from its first call and computes p over the draft
  vocabulary from them: the same greedy agreement as the full LM head's
  softmax, the same overlap to rounding; a second estimate on the same
  windows reads the stored stats and repeats the first exactly."""
  m = tiny_target
  cfg, t, k = m.cfg, 12, 3
  head = eagle.init_head(jax.random.key(0), cfg, fused=True)
  vocab = jnp.arange(0, cfg.vocab_size, 2, dtype=jnp.int32)  # half the tokens
  rng = np.random.default_rng(4)
  windows = [{"g": rng.standard_normal((t, 3 * cfg.dim)).astype(np.float32),
              "tokens": rng.integers(3, cfg.vocab_size, t).astype(np.int32),
              "positions": np.arange(t, dtype=np.int32),
              "f_next": (3 * rng.standard_normal((t, cfg.dim))).astype(np.float32),
              "answer": (np.arange(t) >= 4).astype(np.float32)} for _ in range(4)]
  batch = {key: jnp.asarray(np.stack([w[key] for w in windows])) for key in windows[0]}
  full_c, full_o = eagle_train._eval_batch(head, m.params, cfg, batch, vocab, k)  # pylint: disable=protected-access
  first = eagle_train.estimate(head, m.params, cfg, windows, k, vocab, batch_size=4)
  assert all("lse" in w and "tgt" in w for w in windows)
  stored = dict(batch, tgt=jnp.asarray(np.stack([w["tgt"] for w in windows])),
                lse=jnp.asarray(np.stack([w["lse"] for w in windows])))
  c, o = eagle_train._eval_batch(head, m.params, cfg, stored, vocab, k)  # pylint: disable=protected-access
  np.testing.assert_array_equal(c, full_c)
  assert 0.0 < float(jnp.mean(full_o)) < 1.0  # a non-trivial overlap to compare
  np.testing.assert_allclose(o, full_o, rtol=1e-5, atol=1e-6)
  assert eagle_train.estimate(head, m.params, cfg, windows, k, vocab, batch_size=4) == first
