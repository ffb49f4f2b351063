"""Medusa / blockwise: training (tiny target, seconds), exact resume,
checkpoints tied to their target, and the drafter's round-to-round state;
the training configs' settings (TrainSettings)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import medusa
from specjax.io import checkpoints
from specjax.training import loop, run
from specjax.training.settings import TrainSettings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "specjax", "checkpoints", "smollm2-135m")
# Each training config's choices over the dataclass's defaults (per method).
OVERRIDES = {
    "medusa.py": dict(method="medusa", export=os.path.join(SHIPPED, "medusa")),
    "eagle.py": dict(method="eagle", gen_batch_size=16, steps=2000, warmup=100, teacher_top_k=128,
                     workdir="/tmp/specjax_train/eagle",
                     export=os.path.join(SHIPPED, "eagle_full")),
    "eagle3.py": dict(method="eagle3", gen_batch_size=16, steps=2000, warmup=100, ttt_steps=3,
                      w_cls=1.0, teacher_top_k=128, workdir="/tmp/specjax_train/eagle3",
                      export=os.path.join(SHIPPED, "eagle3_full")),
    "draft_model.py": dict(method="draft_model", steps=1000, lr=5e-4, draft_vocab=8192,
                           workdir="/tmp/specjax_train/draft_model",
                           export=os.path.join(SHIPPED, "draft_model")),
}


@pytest.mark.parametrize("filename", sorted(OVERRIDES))
def test_training_configs_take_the_settings_defaults(load_config, filename):
  """A training config's settings are the dataclass's defaults but for its
  method's own choices; it carries the shared fields and its method's."""
  c = load_config(filename)
  settings = TrainSettings.of(c)
  assert settings == TrainSettings(**OVERRIDES[filename])
  assert sorted(c.keys()) == sorted(TrainSettings.config_fields(settings.method))
  assert settings.config() == c.to_dict()  # what an exported card records
  for variant in ("tiny", "tiny_reduced"):
    assert TrainSettings.of(load_config(filename, variant)).model == run.TINY


def test_run_takes_its_settings_dataclass(load_config, tmp_path):
  """A ConfigDict is refused (experiments/train.py reads it into TrainSettings
  once); an unknown method fails before any work."""
  c = load_config("medusa.py", "tiny", workdir=tmp_path / "w", export="")
  with pytest.raises(TypeError, match="TrainSettings"):
    run.run(c, progress=lambda s: None)
  with pytest.raises(ValueError, match="unknown drafter to train 'nope'"):
    run.run(TrainSettings.of(c, method="nope"), progress=lambda s: None)
  # a field out of its range is refused by name (these ran, silently, as something else)
  for fields, match in ((dict(steps=-3), "steps must be a whole number >= 1, got -3"),
                        (dict(lr=float("nan")), r"lr must be a finite number in \(0, inf\)"),
                        (dict(lr=-1.0), r"lr must be .*got -1.0"),
                        (dict(epochs=-1.0), r"epochs must be a finite number in \[0, inf\)"),
                        (dict(eval_every=0), "eval_every must be a whole number >= 1"),
                        (dict(seed=-1), "seed must be a whole number >= 0"),
                        (dict(draft_vocab=-5), "draft_vocab must be a whole number >= 0"),
                        (dict(warmup=2.5), "warmup must be a whole number"),
                        (dict(feature_dropout=1.0), r"feature_dropout must be .* \[0, 1\)"),
                        (dict(head_init_layer=1.5), "head_init_layer must be a layer index")):
    with pytest.raises(ValueError, match=match):
      run.run(TrainSettings.of(c, **fields), progress=lambda s: None)
  assert not os.path.exists(tmp_path / "w")
  TrainSettings.of(c, head_init_layer=-1, epochs=0.5, warmup=0).check()  # in range: accepted


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_config):
  root = tmp_path_factory.mktemp("medusa")
  c = TrainSettings.of(load_config("medusa.py", "tiny", workdir=root / "full",
                                   export=root / "export"))
  out = run.run(c, progress=lambda s: None)
  return c, out, root


def test_tiny_training_lowers_the_loss_and_exports(trained):
  c, out, _ = trained
  hist = [json.loads(x) for x in open(os.path.join(c.workdir, "metrics.jsonl"))]
  losses = [h["loss"] for h in hist if "loss" in h]
  assert len(losses) >= 3 and losses[-1] < losses[0] - 0.1, losses  # noise ~0.05
  assert out["estimate"]["tau"] >= 1.0
  assert os.path.getsize(os.path.join(c.workdir, "curves.png")) > 1000
  params, card = checkpoints.load_drafter(c.export, method="medusa")
  assert params["w"].shape == (c.num_heads, 64, 64)
  assert card["num_heads"] == c.num_heads and card["best_step"] == out["best_step"]


def test_killed_run_resumes_to_identical_parameters(trained, load_config):
  c, _, root = trained
  cut = TrainSettings.of(load_config("medusa.py", "tiny", workdir=root / "cut", export=""))
  first = run.run(cut, progress=lambda s: None, stop_after=15)  # "killed" after step 15
  assert first["step"] == 15 and "estimate" not in first
  resumed = run.run(cut, progress=lambda s: None)  # restarts from the step-10 checkpoint
  assert resumed["step"] == c.steps
  a, step_a = loop.latest_params(c.workdir)
  b, step_b = loop.latest_params(cut.workdir)
  assert step_a == step_b == c.steps
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  steps = [json.loads(x)["step"] for x in open(os.path.join(cut.workdir, "metrics.jsonl"))]
  assert steps == sorted(set(steps))  # no duplicated lines from the killed stretch


def test_checkpoint_errors(trained, tmp_path):
  c, _, _ = trained
  model = run._target(c)  # pylint: disable=protected-access
  with pytest.raises(checkpoints.CheckpointError, match="does not exist"):
    checkpoints.load_drafter(str(tmp_path / "nothing"))
  other = jax.tree.map(lambda x: x + 1e-2, model.params)
  with pytest.raises(checkpoints.CheckpointError, match="another target"):
    checkpoints.load_drafter(c.export, other, model.cfg)
  checkpoints.load_drafter(c.export, model.params, model.cfg, method="medusa")  # the right one
  with pytest.raises(checkpoints.CheckpointError, match="not 'eagle'"):
    checkpoints.load_drafter(c.export, method="eagle")
  broken = tmp_path / "broken"
  os.makedirs(broken)
  with open(broken / checkpoints.CARD, "w") as f:
    json.dump({"method": "medusa", "target_fingerprint": "x"}, f)
  with pytest.raises(checkpoints.CheckpointError, match="are missing"):  # no params/
    checkpoints.load_drafter(str(broken))
  os.makedirs(broken / checkpoints.PARAMS)
  with pytest.raises(checkpoints.CheckpointError, match="cannot restore|holds no parameters"):  # empty params/
    checkpoints.load_drafter(str(broken))
  with open(broken / checkpoints.CARD, "w") as f:
    f.write("{not json")
  with pytest.raises(checkpoints.CheckpointError, match="unreadable"):
    checkpoints.load_drafter(str(broken))


def test_greedy_medusa_and_blockwise_equal_ar(trained):
  c, _, _ = trained
  model = run._target(c)  # pylint: disable=protected-access
  heads, _ = checkpoints.load_drafter(c.export, model.params, model.cfg)
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30]]
  ref = ar.generate(model.params, model.cfg, prompts, max_new_tokens=20).tokens
  for cls in (medusa.Medusa, medusa.Blockwise):
    res = sp.generate(model.params, model.cfg, cls(k=3), prompts, draft_params=heads,
                      max_new_tokens=20)
    assert res.tokens == ref
    assert res.stats["narrow_rounds"] >= 1  # the first round: no feature yet
    assert res.stats["accepted"] > 0


def test_commit_keeps_the_feature_of_the_accepted_position():
  b, k, d = 3, 4, 5
  hidden = jnp.arange(b * (k + 1) * d, dtype=jnp.float32).reshape(b, k + 1, d)
  n = jnp.array([0, 2, 4])
  from specjax.drafters.base import Context, VerifyOutput  # pylint: disable=import-outside-toplevel
  st = medusa.MedusaState(feature=jnp.zeros((b, d)), valid=jnp.zeros((b,), bool))
  ctx = Context(history=jnp.zeros((b, 8), jnp.int32), length=jnp.ones((b,), jnp.int32),
                prompt_len=jnp.ones((b,), jnp.int32), active=jnp.array([True, True, False]))
  out = medusa.Medusa(k=k).commit(None, st, ctx, VerifyOutput(hidden=hidden, num_accepted=n))
  np.testing.assert_array_equal(out.feature[0], hidden[0, 0])
  np.testing.assert_array_equal(out.feature[1], hidden[1, 2])
  np.testing.assert_array_equal(out.feature[2], np.zeros(d))  # inactive row untouched
  assert out.valid.tolist() == [True, True, False]


def test_drafter_refuses_mismatched_heads(trained):
  c, _, _ = trained
  model = run._target(c)  # pylint: disable=protected-access
  heads = medusa.init_heads(None, 2, model.cfg.dim)
  with pytest.raises(ValueError, match="k=3 needs 3 heads"):
    medusa.Medusa(k=3).check(model.cfg, heads)
  with pytest.raises(ValueError, match="width"):
    medusa.Medusa(k=2).check(model.cfg, medusa.init_heads(None, 2, 16))
  with pytest.raises(ValueError, match="needs trained heads"):
    medusa.Medusa(k=2).check(model.cfg, None)


# ---- a reduced draft vocabulary and the top-K teacher ------------------------


@pytest.fixture(scope="module")
def trained_reduced(tmp_path_factory, load_config):
  """Heads trained on a 32-token draft vocabulary (of the tiny target's 64)
  with soft labels from the top-16 teacher."""
  root = tmp_path_factory.mktemp("medusa_reduced")
  c = TrainSettings.of(load_config("medusa.py", "tiny_reduced", workdir=root / "w",
                                   export=root / "export"))
  out = run.run(c, progress=lambda s: None)
  return c, out


def test_reduced_vocabulary_heads_export_and_decode_as_ar(trained_reduced):
  """The export carries the draft vocabulary and its ranking; loaded through
  the registry (the LM-head rows gathered once), greedy medusa / blockwise
  equal AR; draft_vocab=N narrows it at load time."""
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel
  c, out = trained_reduced
  hist = [json.loads(x) for x in open(os.path.join(c.workdir, "metrics.jsonl"))]
  losses = [h["loss"] for h in hist if "loss" in h]
  assert losses[-1] < losses[0] - 0.1, losses
  params, card = checkpoints.load_drafter(c.export, method="medusa")
  assert card["draft_vocab"] == 32 and params["vocab"].shape == (32,)
  assert sorted(np.asarray(params["vocab_rank"]).tolist()) == list(range(64))
  model = run._target(c)  # pylint: disable=protected-access
  if model.cfg.eos_id >= 0:
    assert model.cfg.eos_id in np.asarray(params["vocab"]).tolist()
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30]]
  ref = ar.generate(model.params, model.cfg, prompts, max_new_tokens=20).tokens
  for method in ("medusa", "blockwise"):
    drafter, heads = registry.make_drafter(method, {"k": 3, "checkpoint": c.export}, model)
    assert "lm_rows" in heads and heads["lm_rows"].shape == (32, model.cfg.dim)
    res = sp.generate(model.params, model.cfg, drafter, prompts, draft_params=heads,
                      max_new_tokens=20)
    assert res.tokens == ref and res.stats["accepted"] > 0
  # narrowed at load time to its 8 most frequent tokens (EOS kept), or refused
  _, narrow = registry.make_drafter("medusa", {"k": 3, "checkpoint": c.export,
                                               "draft_vocab": 8}, model)
  assert narrow["vocab"].shape == (8,)
  assert set(np.asarray(narrow["vocab"]).tolist()) <= set(np.asarray(params["vocab"]).tolist())


def test_full_range_vocabulary_drafts_as_the_full_head(trained):
  """A 'reduced' vocabulary holding every token drafts exactly what the
  full-vocabulary heads draft (chain samples, blockwise, a sampled tree:
  tokens and q); a true subset puts q only on its tokens."""
  from specjax import sampling as sampling_lib  # pylint: disable=import-outside-toplevel
  from specjax.drafters.base import Context  # pylint: disable=import-outside-toplevel
  c, _, _ = trained
  model = run._target(c)  # pylint: disable=protected-access
  heads, _ = checkpoints.load_drafter(c.export, model.params, model.cfg)
  heads = jax.tree.map(lambda x: x + 0.05, heads)  # away from the zero init
  v = model.cfg.vocab_size
  full_range = medusa.prepare(dict(heads, vocab=jnp.arange(v)), model.params, model.cfg)
  subset = medusa.prepare(dict(heads, vocab=jnp.arange(0, v, 3)), model.params, model.cfg)
  b = 2
  feat = jax.random.normal(jax.random.PRNGKey(0), (b, model.cfg.dim))
  state = medusa.MedusaState(feature=feat, valid=jnp.ones((b,), bool))
  ctx = Context(history=jnp.zeros((b, 8), jnp.int32), length=jnp.ones((b,), jnp.int32),
                prompt_len=jnp.ones((b,), jnp.int32), active=jnp.ones((b,), bool))
  keys = jax.random.split(jax.random.PRNGKey(1), b)
  t07 = sampling_lib.SamplingConfig(temperature=0.7)
  drafters = [medusa.Medusa(k=3, sampling=t07), medusa.Blockwise(k=3),
              medusa.MedusaTree(k=2, choices=((0,), (1,), (0, 0)), sampling=t07)]
  for d in drafters:
    draft = jax.jit(lambda p, d=d: d.draft(p, model, state, ctx, keys)[0])  # one program each
    a, f, s = draft(heads), draft(full_range), draft(subset)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(f.tokens))
    np.testing.assert_allclose(np.asarray(a.q), np.asarray(f.q), atol=1e-6)
    q = np.asarray(s.q)
    off = np.ones(v, bool)
    off[np.arange(0, v, 3)] = False
    assert np.all(q[..., off] == 0) and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.asarray(s.tokens) % 3 == 0)


def test_soft_labels_are_the_target_distribution_of_each_heads_token(trained):
  """Head i at pool position j is taught x_{t+2+i}: its soft labels (the
  stored top-K teacher, K = the whole vocabulary) equal the target's
  distribution at the feature that predicts that token, its hard label is
  that token; the loss from soft labels with a full-range vocabulary equals
  the full-vocabulary one, and the estimate with a full-range vocabulary
  equals the full one."""
  from specjax.training import medusa_train  # pylint: disable=import-outside-toplevel
  c, _, _ = trained
  model = run._target(c)  # pylint: disable=protected-access
  v = model.cfg.vocab_size
  seqs = [([1, 5, 9, 3, 17, 4, 22, 8, 8, 30, 2], 4), ([1, 7, 7, 12, 40, 2], 3)]
  pool = medusa_train.FeaturePool.build(model.params, model.cfg, seqs, seq_len=16, top_k=v)
  assert len(pool) == (11 - 4) + (6 - 3)
  assert pool.nxt.tolist() == seqs[0][0][4:] + seqs[1][0][3:]  # x_{t+1} of t = plen - 1 ..
  idx = np.arange(len(pool))
  batch = pool.batch(idx, 3, teacher=True)
  p_full = np.asarray(jax.jit(lambda h: jax.nn.softmax(transformer_lm_head(model, h), -1))(
      pool.hidden))
  for i in range(3):
    for j in idx:
      if not batch["valid"][j, i]:
        continue
      dense = np.zeros(v)
      np.add.at(dense, batch["p_ids"][j, i], batch["p_top"][j, i])
      np.testing.assert_allclose(dense, p_full[j + 1 + i], atol=1e-5)
      assert batch["labels"][j, i] == pool.nxt[j + 1 + i]
  assert batch["valid"][:, 0].sum() == len(pool) - 2  # the last position of each sequence
  heads, _ = checkpoints.load_drafter(c.export, model.params, model.cfg)
  heads = jax.tree.map(lambda x: x + 0.05, heads)
  jb = jax.tree.map(jnp.asarray, batch)
  loss = jax.jit(lambda b, vocab: medusa_train.loss_fn(heads, model.params, model.cfg, b, 0.8,
                                                       vocab)[0])
  soft_full, soft_range = loss(jb, None), loss(jb, jnp.arange(v))
  np.testing.assert_allclose(float(soft_full), float(soft_range), rtol=1e-5)
  hard = {k: x for k, x in jb.items() if not k.startswith("p_")}
  assert abs(float(loss(hard, None)) - float(soft_full)) > 1e-3  # the soft labels are used
  # hard labels: a full-range vocabulary changes nothing; a label outside a
  # true subset carries no weight
  np.testing.assert_allclose(float(loss(hard, None)), float(loss(hard, jnp.arange(v))),
                             rtol=1e-5)
  sub = jnp.arange(0, v, 2)
  one = {k: np.asarray(x[:1]) for k, x in hard.items()}
  one["valid"] = np.asarray([[1.0, 0.0, 0.0]], np.float32)
  even, odd = (dict(one, labels=np.asarray([[t, 0, 0]], np.int32)) for t in (4, 5))
  assert float(loss(even, sub)) > 0 and float(loss(odd, sub)) == 0.0
  est = medusa_train.estimate(heads, model.params, model.cfg, pool, 3)
  est_range = medusa_train.estimate(heads, model.params, model.cfg, pool, 3,
                                    vocab=jnp.arange(v))
  for name, value in est.items():
    assert est_range[name] == pytest.approx(value, abs=1e-5), name


def transformer_lm_head(model, hidden):
  from specjax.models import transformer  # pylint: disable=import-outside-toplevel
  return transformer.lm_head(model.params, model.cfg, jnp.asarray(hidden))


def test_estimate_checkpoints_reproduces_the_exported_estimate(trained, trained_reduced):
  """experiments/estimate.py's function: the estimate of an exported
  checkpoint on its run's validation records equals the one its card holds
  (full and reduced vocabulary)."""
  for c, _ in ((trained[0], None), trained_reduced):
    [(path, est)] = run.estimate_checkpoints(c, [c.export], progress=lambda s: None)
    _, card = checkpoints.load_drafter(c.export, method="medusa")
    assert path == c.export and est.keys() == card["estimated"].keys()
    for name, value in card["estimated"].items():
      assert est[name] == pytest.approx(value, abs=1e-6), name
  with pytest.raises(ValueError, match="skip_records"):
    run.estimate_checkpoints(trained[0], [trained[0].export], skip_records=3,
                             progress=lambda s: None)
