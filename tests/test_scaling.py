"""The data-scaling experiment's bookkeeping (specjax.benchmarks.scaling): the
points the data can hold, the log-linear fit, the table and plot, its
settings; the training and benchmark it drives are tested in their own modules."""

import json
import math
import os

import pytest

from specjax.benchmarks import scaling
from specjax.errors import ConfigValueError, PromptFileError
from specjax.training.settings import TrainSettings


def test_points_nest_sizes_the_data_holds_with_seeds_below_the_threshold():
  c = scaling.ScalingSettings(sizes="100000,300000,1000000", seeds=2, seeds_below=300000)
  assert scaling.points(c, 350_000) == [{"positions": 100000, "seed": 0},
                                        {"positions": 100000, "seed": 1},
                                        {"positions": 300000, "seed": 0}]
  assert scaling.points(c, 50_000) == []


def test_fit_recovers_a_log_linear_law_and_needs_two_sizes():
  rows = [{"positions": n, "bench_tau": 1.2 + 0.3 * math.log(n)} for n in (1e5, 3e5, 1e6)]
  f = scaling.fit(rows)
  assert abs(f["a"] - 1.2) < 1e-9 and abs(f["b"] - 0.3) < 1e-9
  assert abs(f["per_doubling"] - 0.3 * math.log(2)) < 1e-9
  assert scaling.fit(rows[:1]) is None


def test_report_writes_the_table_fit_and_plot(tmp_path):
  c = scaling.ScalingSettings(out=str(tmp_path), eval_k=2)
  rows = [{"positions": n, "seed": 0, "steps": 10, "best_step": 8, "early_stopped": True,
           "valid_tau": 1.5, "train_tau": 1.9, "top1_0": 0.4, "top1_1": 0.3,
           "bench": {"all": {"tau": t, "alpha": 0.3}, "qa": {"tau": t - 0.1, "alpha": 0.2}},
           "bench_tau": t} for n, t in ((100000, 1.4), (300000, 1.6))]
  rows[1]["valid_tau_rounds"] = 1.45  # points logged before tau_rounds show "-"
  rows[1]["train_positions"] = 278665  # a size above the data trains on all of it
  with open(tmp_path / "points.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  out = scaling.report(c)
  md = open(tmp_path / "scaling.md").read()
  assert "| 100,000 | - | 0 | 10 (8) | 1.500 | - | 1.900 | 0.400 | 0.300 | 1.400 | 1.300 |" in md
  assert "| 300,000 | 278,665 | 0 | 10 (8) | 1.500 | 1.450 | 1.900 |" in md
  # the fit runs on the positions trained on, the requested size where none is logged
  assert abs(out["fit"]["b"] - 0.2 / math.log(278665 / 100000)) < 1e-9
  assert "per doubling" in md
  assert os.path.getsize(tmp_path / "scaling.png") > 1000


def test_settings_and_inputs(load_config, tmp_path):
  c = load_config("scaling.py")
  assert scaling.ScalingSettings.of(c) == scaling.ScalingSettings()
  with pytest.raises(TypeError, match="ScalingSettings"):
    scaling.run_scaling(c, TrainSettings())
  with pytest.raises(FileNotFoundError, match="no self-distillation data"):
    scaling.run_scaling(scaling.ScalingSettings(data_path=str(tmp_path / "none.jsonl")),
                        TrainSettings())
  data = tmp_path / "data.jsonl"
  data.write_text("")
  # the benchmark's prompt file is read before the data and any training
  with pytest.raises(PromptFileError, match="questions.jsonl: cannot read the prompt file"):
    scaling.run_scaling(scaling.ScalingSettings(data_path=str(data), out=str(tmp_path / "out"),
                                                bench_prompts=str(tmp_path / "questions.jsonl")),
                        TrainSettings())
  assert not (tmp_path / "out").exists()
  # settings out of range are refused by name before anything is read
  for fields, match in ((dict(sizes="100000,abc"), "sizes='100000,abc': 'abc' is not a whole"),
                        (dict(sizes="-100"), "'-100' is not a whole number"),
                        (dict(sizes=" , "), "no sizes"),
                        (dict(seeds=0), "seeds must be a whole number >= 1, got 0"),
                        (dict(epochs=0.0), r"epochs must be a finite number in \(0, inf\)"),
                        (dict(bench_prompt_limit=-1), "bench_prompt_limit must be .* >= 0"),
                        (dict(eval_every=2.5), "eval_every must be a whole number >= 1")):
    with pytest.raises(ConfigValueError, match=match):
      scaling.run_scaling(scaling.ScalingSettings(data_path=str(data), **fields), TrainSettings())
  assert scaling.sizes(scaling.ScalingSettings(sizes="46_000, 100000,")) == [46000, 100000]
