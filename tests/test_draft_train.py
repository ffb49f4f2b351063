"""The distilled independent draft model: divergences, tiny training (seconds),
exact resume, checkpoint loading through the registry, reduced draft
vocabulary, greedy identity, and the HF export with the full embedding."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.base import Context, Target
from specjax.drafters.draft_model import DraftModel, with_draft_vocab
from specjax.io import hf
from specjax.io.load import load_model
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.io import checkpoints
from specjax.training import draft_train, loop, run
from specjax.training.settings import TrainSettings

pytestmark = pytest.mark.slow  # tiny distillation runs (~1 min): the full suite, not the fast tier


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_config):
  """Tiny distilled draft models: full vocabulary and a 32-token draft vocabulary."""
  root = tmp_path_factory.mktemp("draft_model")
  out = {}
  for variant in ("tiny", "tiny_reduced"):
    c = TrainSettings.of(load_config("draft_model.py", variant, workdir=root / variant,
                                     export=root / variant / "export"))
    out[variant] = (c, run.run(c, progress=lambda s: None))
  return out, root


@pytest.fixture(scope="module")
def tiny_target(trained):
  c, _ = trained[0]["tiny"]
  return run._target(c)  # pylint: disable=protected-access


def test_divergences_on_hand_made_distributions():
  p = jnp.asarray([[0.5, 0.25, 0.25, 0.0]])
  q = jnp.asarray([[0.25, 0.25, 0.25, 0.25]])
  kl, tv, overlap = draft_train.divergences(p, jnp.log(q))
  np.testing.assert_allclose(kl, [0.5 * np.log(2)], rtol=1e-6)
  np.testing.assert_allclose(tv, [0.25], rtol=1e-6)
  np.testing.assert_allclose(overlap, [0.75], rtol=1e-6)
  # q on a sub-vocabulary {0, 1}: p's mass outside it counts as lost for TV
  kl, tv, _ = draft_train.divergences(p, jnp.log(jnp.asarray([[0.5, 0.5]])), jnp.asarray([0, 1]))
  np.testing.assert_allclose(tv, [1 - (0.5 + 0.25)], rtol=1e-6)
  np.testing.assert_allclose(kl, [0.25 * np.log(0.5)], rtol=1e-5)  # -sum_sub p log(q/p)


def test_init_layer_choice():
  assert draft_train.default_init_layers(30, 4) == (0, 1, 2, 3)
  assert draft_train.parse_init_layers("3,7", 30, 2) == (3, 7)
  with pytest.raises(ValueError, match="names 1 layers; the draft model has 2"):
    draft_train.parse_init_layers("3", 30, 2)
  with pytest.raises(ValueError, match="outside"):
    draft_train.parse_init_layers("0,30", 30, 2)
  with pytest.raises(ValueError, match="1..30 layers"):
    draft_train.default_init_layers(30, 0)


@pytest.mark.parametrize("variant", ["tiny", "tiny_reduced"])
def test_tiny_distillation_lowers_the_divergence_and_exports(trained, tiny_target, variant):
  c, out = trained[0][variant]
  hist = [json.loads(x) for x in open(os.path.join(c.workdir, "metrics.jsonl"))]
  kls = [h["kl"] for h in hist if "kl" in h]
  assert len(kls) >= 3 and kls[-1] < kls[0] - 0.05, kls
  params, card = checkpoints.load_drafter(c.export, tiny_target.params, tiny_target.cfg,
                                          method="draft_model")
  assert card["num_layers"] == c.draft_layers == len(params["layers"])
  assert "embed" not in params  # the target's embedding is referenced, not copied
  assert params["vocab_rank"].shape == (tiny_target.cfg.vocab_size,)
  assert ("vocab" in params) == (variant == "tiny_reduced")
  assert 1.0 <= out["estimate"]["tau"] <= 1 + c.eval_k
  assert 1.0 <= out["estimate"]["tau_rounds"] <= 1 + c.eval_k


def test_killed_run_resumes_to_identical_parameters(trained, load_config):
  (c, _), root = trained[0]["tiny"], trained[1]
  cut = TrainSettings.of(load_config("draft_model.py", "tiny", workdir=root / "cut",
                                     export=""))
  assert run.run(cut, progress=lambda s: None, stop_after=15)["step"] == 15
  assert run.run(cut, progress=lambda s: None)["step"] == c.steps
  a, step_a = loop.latest_params(c.workdir)
  b, step_b = loop.latest_params(cut.workdir)
  assert step_a == step_b == c.steps
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("variant", ["tiny", "tiny_reduced"])
def test_greedy_distilled_draft_model_equals_ar(trained, tiny_target, variant):
  c, _ = trained[0][variant]
  m = tiny_target
  drafter, dparams = registry.make_drafter(
      "draft_model", {"k": 3, "draft_model": str(c.export)}, m)
  assert isinstance(drafter, DraftModel) and drafter.cfg.num_layers == c.draft_layers
  assert ("lm_rows" in dparams) == (variant == "tiny_reduced")
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30]]
  ref = ar.generate(m.params, m.cfg, prompts, max_new_tokens=20).tokens
  res = sp.generate(m.params, m.cfg, drafter, prompts, draft_params=dparams, max_new_tokens=20)
  assert res.tokens == ref
  assert res.stats["accepted"] > 0
  assert registry.drafter_id("draft_model", {"draft_model": str(c.export)}).endswith("export")


def test_reduced_vocabulary_q_is_zero_off_the_draft_vocabulary(trained, tiny_target):
  """Sampled drafting over the 32-token vocabulary: every guess and all of q's
  mass lie on it, and q is exactly what the guess was drawn from (it sums to 1)."""
  c, _ = trained[0]["tiny_reduced"]
  m = tiny_target
  drafter, dparams = registry.make_drafter(
      "draft_model", {"k": 3, "draft_model": str(c.export)}, m,
      sampling=sampling_lib.SamplingConfig(temperature=1.0))
  vocab = np.asarray(dparams["vocab"])
  prompts = jnp.asarray([[5, 9, 3, 17], [8, 8, 30, 2]], jnp.int32)
  lengths = jnp.asarray([4, 3], jnp.int32)
  target = Target(m.params, m.cfg)
  state = drafter.init(dparams, target, prompts, lengths, 32)
  hist = jnp.zeros((2, 32), jnp.int32).at[:, :4].set(prompts)
  ctx = Context(history=hist, length=lengths, prompt_len=lengths,
                active=jnp.asarray([True, True]))
  keys = jax.random.split(jax.random.key(3), 2)
  prop, _ = drafter.draft(dparams, target, state, ctx, keys)
  q = np.asarray(prop.q)
  off = np.setdiff1d(np.arange(m.cfg.vocab_size), vocab)
  assert np.all(q[..., off] == 0)
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
  assert np.isin(np.asarray(prop.tokens), vocab).all()
  tok = np.asarray(prop.tokens)
  assert np.all(np.take_along_axis(q, tok[..., None], -1) > 0)


def test_draft_vocabulary_chosen_at_load(trained, tiny_target):
  c, _ = trained[0]["tiny"]
  m = tiny_target
  _, full = registry.make_drafter("draft_model", {"draft_model": str(c.export)}, m)
  assert "vocab" not in full
  _, narrow = registry.make_drafter("draft_model", {"draft_model": str(c.export),
                                                    "draft_vocab": "8"}, m)
  assert narrow["vocab"].shape == (8,) and narrow["lm_rows"].shape == (8, m.cfg.dim)
  with pytest.raises(ValueError, match="draft_vocab must be 'full' or a number"):
    registry.make_drafter("draft_model", {"draft_model": str(c.export), "draft_vocab": "x"}, m)
  with pytest.raises(ValueError, match="only a distilled draft model"):
    registry.make_drafter("draft_model", {"draft_model": "self:1", "draft_vocab": "8"}, m)
  params = dict(m.params)
  with pytest.raises(ValueError, match="needs a token ranking"):
    with_draft_vocab(params, m.cfg, 8)


def test_checkpoint_for_another_target_or_method_is_refused(trained, tiny_target):
  c, _ = trained[0]["tiny"]
  other = dict(tiny_target.params, final_norm=tiny_target.params["final_norm"] * 2)
  other_model = dataclasses.replace(tiny_target, params=other)
  with pytest.raises(checkpoints.CheckpointError, match="trained for another target"):
    registry.make_drafter("draft_model", {"draft_model": str(c.export)}, other_model)
  with pytest.raises(checkpoints.CheckpointError, match="not 'medusa'"):
    checkpoints.load_drafter(c.export, method="medusa")


def test_hf_export_writes_the_full_model_and_runs_the_same(trained, tiny_target, tmp_path):
  c, _ = trained[0]["tiny_reduced"]
  m = tiny_target
  out = tmp_path / "draft-hf"
  summary = draft_train.export_hf(str(c.export), m, str(out))
  assert summary["vocab_size"] == m.cfg.vocab_size
  params, cfg = hf.load_hf(str(out))
  assert cfg.num_layers == c.draft_layers and params["embed"].shape == m.params["embed"].shape
  np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(m.params["embed"]))
  # the exported model computes what the distilled drafter computes over the full vocabulary
  _, dparams = registry.make_drafter("draft_model", {"draft_model": str(c.export),
                                                     "draft_vocab": "full"}, m)
  toks = jnp.asarray([[5, 9, 3, 17, 4, 8]], jnp.int32)
  pos = jnp.arange(6, dtype=jnp.int32)[None]
  a, _, _ = transformer.forward(dparams, cfg, toks, pos, cache_lib.init_cache(cfg, 1, 8))
  b, _, _ = transformer.forward(params, cfg, toks, pos, cache_lib.init_cache(cfg, 1, 8))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # ... and serves as a draft model by path
  drafter, hparams = registry.make_drafter("draft_model", {"k": 2, "draft_model": str(out)}, m)
  prompts = [[5, 9, 3, 17, 4]]
  ref = ar.generate(m.params, m.cfg, prompts, max_new_tokens=12).tokens
  assert sp.generate(m.params, m.cfg, drafter, prompts, draft_params=hparams,
                     max_new_tokens=12).tokens == ref
  with pytest.raises(FileExistsError, match="non-empty directory"):
    draft_train.export_hf(str(c.export), m, str(out))
  assert load_model(str(out)).cfg.num_layers == c.draft_layers


def test_estimate_checkpoints_reproduces_the_exported_estimate(trained):
  """experiments/estimate.py's function on a draft model: the estimate of
  the exported checkpoints (full and reduced vocabulary) on their run's
  validation records equals the one their cards hold."""
  for c, _ in trained[0].values():
    [(_, est)] = run.estimate_checkpoints(c, [c.export], progress=lambda s: None)
    _, card = checkpoints.load_drafter(c.export, method="draft_model")
    for name, value in card["estimated"].items():
      assert est[name] == pytest.approx(value, abs=1e-6), name
