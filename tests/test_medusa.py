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
  for variant in ("tiny", "tiny_reduced") if filename != "medusa.py" else ("tiny",):
    assert TrainSettings.of(load_config(filename, variant)).model == run.TINY


def test_run_takes_its_settings_dataclass(load_config, tmp_path):
  """A ConfigDict is refused (experiments/train.py reads it into TrainSettings
  once); an unknown method fails before any work."""
  c = load_config("medusa.py", "tiny", workdir=tmp_path / "w", export="")
  with pytest.raises(TypeError, match="TrainSettings"):
    run.run(c, progress=lambda s: None)
  with pytest.raises(ValueError, match="unknown drafter to train 'nope'"):
    run.run(TrainSettings.of(c, method="nope"), progress=lambda s: None)
  assert not os.path.exists(tmp_path / "w")


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
