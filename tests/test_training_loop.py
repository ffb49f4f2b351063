"""The training loop's early stop (`patience`): it stops after that many
evaluations without a new best, saves its state there, and a resumed run stays
stopped; epochs set the step count from the data (`run._epoch_steps`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.training import loop, run
from specjax.training.settings import TrainSettings

# eval at steps 2, 4, ...: tau rises to its best at step 6, then falls
TAU = {2: 1.0, 4: 2.0, 6: 3.0, 8: 2.5, 10: 2.9, 12: 3.5, 14: 1.0}


def _run(workdir, patience, steps=14):
  opt = optax.sgd(0.1)

  @jax.jit
  def step_fn(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.sum((p["w"] - batch["x"]) ** 2))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": jnp.sum(params["w"])}

  evaluated = []

  def eval_fn(params):  # a fresh loop evaluates at steps 2, 4, ...
    evaluated.append(params)
    return {"tau": TAU[2 * len(evaluated)]}

  res = loop.train(workdir=str(workdir), init_params={"w": jnp.zeros(2)}, optimizer=opt,
                   step_fn=step_fn, batch_fn=lambda s: {"x": np.full(2, s, np.float32)},
                   num_steps=steps, eval_fn=eval_fn, eval_every=2, save_every=4, log_every=2,
                   progress=lambda s: None, patience=patience)
  return res


def test_patience_stops_after_evaluations_without_a_new_best_and_stays_stopped(tmp_path):
  res = _run(tmp_path / "a", patience=2)
  # best 3.0 at step 6; 2.5 (step 8) and 2.9 (step 10) are not better: stop at 10
  assert res.early_stopped and res.step == 10 and res.best_metric == 3.0
  again = _run(tmp_path / "a", patience=2)
  assert again.early_stopped and again.step == 10
  full = _run(tmp_path / "b", patience=0)  # no patience: every step, the later best
  assert not full.early_stopped and full.step == 14 and full.best_metric == 3.5
  more = _run(tmp_path / "c", patience=3)  # 3 evaluations of patience reach step 12's 3.5
  assert not more.early_stopped and more.step == 14 and more.best_metric == 3.5


def test_epochs_set_the_steps_from_the_answer_positions():
  from test_eagle_batches import _pool  # pylint: disable=import-outside-toplevel
  pool = _pool()
  c = TrainSettings(method="eagle3", epochs=2.0, steps=5)

  def batch_fn(step):
    return pool.sequence_batch(np.random.default_rng([0, step]), 256)

  per_batch = np.mean([batch_fn(s)["answer"].sum() for s in range(1, 17)])
  got = run._epoch_steps(c, pool, batch_fn)  # pylint: disable=protected-access
  assert got.steps == int(np.ceil(2.0 * pool.num_positions / per_batch)) and got.steps != 5
  assert run._epoch_steps(TrainSettings(steps=5), pool, batch_fn).steps == 5  # pylint: disable=protected-access
