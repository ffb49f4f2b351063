"""The batch-invariance identity run's table from its log (`parts=report`):
what a partial, resumable run holds so far, read without running anything;
and the run's settings (configs/invariance.py, InvarianceSettings)."""

import importlib.util
import json
import os
import types

import pytest

from specjax.benchmarks import invariance
from specjax.errors import ConfigValueError
from specjax.models import invariant as invariant_lib

CONFIG_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "invariance.py")


def _config(tmp_path, **kw):
  questions = tmp_path / "questions.jsonl"
  with open(questions, "w") as f:
    for qid, cat in ((1, "math"), (2, "math"), (3, "qa"), (4, "qa")):
      f.write(json.dumps({"question_id": qid, "category": cat, "turns": [f"q{qid}"]}) + "\n")
  base = dict(model="smollm2-135m", dtypes="float32,bfloat16", modes="on", k=4,
              max_new_tokens=8, prompts=str(questions), prompt_limit=10, batch_size=2,
              methods="prompt_lookup,eagle3", out=str(tmp_path), parts="report")
  base.update(kw)
  return invariance.InvarianceSettings.of(types.SimpleNamespace(**base))


def _record(c, method, ids, identical, first=None):
  return {"settings": {"model": c.model, "max_new_tokens": c.max_new_tokens, "k": c.drafter.k,
                       "batch_size": c.batch_size,
                       "invariant_forward": invariant_lib.formulation()},
          "dtype": "float32", "batch_invariant": True, "method": method, "question_ids": ids,
          "identical": identical, "first_divergence": first or [None] * len(ids)}


def test_report_counts_what_the_log_holds(tmp_path):
  c = _config(tmp_path)
  with open(tmp_path / "identity.jsonl", "w") as f:
    for rec in (_record(c, "prompt_lookup", [1, 2], [True, True]),
                _record(c, "prompt_lookup", [3, 4], [True, False], [None, 5]),
                _record(c, "eagle3", [1, 2], [True, True])):
      f.write(json.dumps(rec) + "\n")
  out = invariance.run(c, progress=lambda s: None)
  rows = {r["method"]: r for r in out["identity"]}
  assert set(rows) == {"prompt_lookup", "eagle3"}  # nothing logged for bfloat16
  assert (rows["prompt_lookup"]["identical"], rows["prompt_lookup"]["rows"]) == (3, 4)
  assert rows["prompt_lookup"]["first_divergence"] == [(4, 5)]
  assert (rows["eagle3"]["identical"], rows["eagle3"]["rows"]) == (2, 2)
  assert "| float32 | True | prompt_lookup | 3/4 | 4@5 |" in out["markdown"]


def test_report_refuses_a_log_of_other_settings_and_a_missing_out(tmp_path):
  c = _config(tmp_path)
  with open(tmp_path / "identity.jsonl", "w") as f:
    f.write(json.dumps(_record(_config(tmp_path, k=3), "eagle3", [1, 2], [True, True])) + "\n")
  with pytest.raises(ConfigValueError, match="other settings"):
    invariance.run(c, progress=lambda s: None)
  # a log of an earlier formulation of the invariant forward: its bits are another forward's
  earlier = _record(c, "eagle3", [1, 2], [True, True])
  del earlier["settings"]["invariant_forward"]
  with open(tmp_path / "identity.jsonl", "w") as f:
    f.write(json.dumps(earlier) + "\n")
  with pytest.raises(ConfigValueError, match="other settings"):
    invariance.run(c, progress=lambda s: None)
  with pytest.raises(ConfigValueError, match="set out"):
    invariance.run(_config(tmp_path, out=""), progress=lambda s: None)
  with pytest.raises(ConfigValueError, match="parts must be"):
    invariance.run(_config(tmp_path, parts="cost,magic"), progress=lambda s: None)
  # counts out of range are refused by name before any model loads (these ran)
  for field, value in (("max_new_tokens", 0), ("repeats", -1), ("batch_size", 0),
                       ("speedup_tokens", 0), ("prompt_limit", -1)):
    with pytest.raises(ConfigValueError, match=f"{field} must be a whole number >= "):
      invariance.run(_config(tmp_path, parts="cost", **{field: value}), progress=lambda s: None)


def _get_config(arg=None):
  spec = importlib.util.spec_from_file_location("invariance_config", CONFIG_FILE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_invariance_takes_its_settings_dataclass(tmp_path):
  """The config's defaults are the dataclass's; a ConfigDict is refused (the
  experiment main reads it into InvarianceSettings once); the records' settings
  are the same five fields (the invariant forward's formulation among them)
  unless a drafter field is set."""
  settings = invariance.InvarianceSettings.of(_get_config())
  assert settings == invariance.InvarianceSettings()
  assert invariance._log_settings(settings) == {  # pylint: disable=protected-access
      "model": "smollm2-135m", "max_new_tokens": 64, "k": 4, "batch_size": 10,
      "invariant_forward": invariant_lib.formulation()}
  small = invariance.InvarianceSettings.of(_get_config("small"))
  assert (small.parts, small.prompt_limit, small.batch_size) == ("identity", 1, 1)
  with pytest.raises(TypeError, match="InvarianceSettings"):
    invariance.run(_get_config("small"), progress=lambda s: None)
  c = _config(tmp_path, tree_nodes=8)
  assert invariance._log_settings(c)["tree_nodes"] == 8  # pylint: disable=protected-access


def test_speedup_table_states_each_mode_against_the_default():
  """The speedup part's table: median [IQR] per mode against its precision's
  AR and against the fastest AR, with both drops."""
  c = invariance.InvarianceSettings()
  rows = [{"dtype": "float32", "batch_invariant": inv, "invariant_tile": tile,
           "method": "prompt_lookup@k=3", "questions": 4, "speedup_median": med,
           "speedup_iqr": [med - 0.1, med + 0.1], "drop_vs_default": drop, "speedups": [],
           "ar_tok_s_median": 40.0, "fastest_ar": "float32", "vs_fastest_ar_median": med,
           "vs_fastest_ar_iqr": [med - 0.1, med + 0.1], "drop_vs_best_default": drop,
           "categories": {"math": med + 0.5, "qa": med}}
          for inv, tile, med, drop in ((False, None, 1.2, 0.0), (True, 5, 1.08, 0.1))]
  rows.append({"dtype": "float32", "batch_invariant": True, "invariant_tile": 8, "method": "ar",
               "questions": 4, "ar_tok_s_median": 24.0, "fastest_ar": "float32",
               "vs_fastest_ar_median": 0.6, "vs_fastest_ar_iqr": [0.55, 0.65]})
  md = invariance.markdown(None, None, c, speedup_rows=rows)
  assert ("| prompt_lookup@k=3 | float32 | False | - | 4 | 40.0 | 1.20x [1.10-1.30] | 0.0% | "
          "1.20x [1.10-1.30] | 0.0% | 1.70x | 1.20x |") in md
  assert ("| prompt_lookup@k=3 | float32 | True | 5 | 4 | 40.0 | 1.08x [0.98-1.18] | 10.0% | "
          "1.08x [0.98-1.18] | 10.0% | 1.58x | 1.08x |") in md
  assert "drop vs best default | math | qa |" in md
  assert "fastest AR of any mode (float32;" in md
  assert "| float32 | True | 8 | 24.0 | 0.60x [0.55-0.65] |" in md  # the AR modes


def test_cost_table_states_verify_times_by_context_length(tmp_path):
  """The cost part's second table: B = 1 t_verify(1) and t_verify(k + 1) after
  each context length of `verify_contexts`, each against the default forward's;
  a malformed list is refused before any model loads."""
  c = _config(tmp_path, parts="cost", verify_batches="1", verify_contexts="512,1280")
  rows = [{"dtype": "bfloat16", "batch_invariant": inv, "invariant_tile": tile,
           "ar_tokens_per_s": 40.0, "ar_ratio": 1.0, "t_verify_B1_ms": 30.0,
           "t_verify_B1_ratio": 1.0,
           **{f"t_L{x}_w{w}_ms": t * x / 512 for x in (512, 1280) for w, t in ((1, t1), (5, t5))},
           **{f"t_L{x}_w{w}_ratio": r for x in (512, 1280) for w, r in ((1, r1), (5, r5))}}
          for inv, tile, t1, t5, r1, r5 in ((False, None, 36.0, 48.0, 1.0, 1.0),
                                            (True, 5, 42.0, 52.0, 1.17, 1.08))]
  md = invariance.markdown(rows, None, c)
  assert "| L = 512: t(1) | vs default | t(5) | vs default | L = 1280: t(1) |" in md
  assert "| bfloat16 | True | 5 | 42.0 | 1.17x | 52.0 | 1.08x | 105.0 | 1.17x | 130.0 | 1.08x |" in md
  assert "| bfloat16 | False | - | 36.0 | 1.00x | 48.0 | 1.00x | 90.0 | 1.00x |" in md
  assert "after L context" not in invariance.markdown(rows, None, _config(
      tmp_path, parts="cost", verify_batches="1", verify_contexts=""))
  assert invariance._contexts(_config(tmp_path, verify_contexts="512, 512,64")) == [512, 64]  # pylint: disable=protected-access
  for bad in ("512,x", "0", "-3"):
    with pytest.raises(ConfigValueError, match="verify_contexts"):
      invariance.run(_config(tmp_path, parts="cost", verify_contexts=bad), progress=lambda s: None)
  assert invariance._batches(_config(tmp_path, verify_batches="4, 1,4")) == [4, 1]  # pylint: disable=protected-access
  for bad in ("1,x", "0", "", "1,-4"):  # refused by name before any model loads
    with pytest.raises(ConfigValueError, match="verify_batches="):
      invariance.run(_config(tmp_path, parts="cost", verify_batches=bad), progress=lambda s: None)


@pytest.mark.slow
def test_speedup_part_runs_every_mode_on_every_question(tmp_path):
  """SmolLM2, two questions, 8 tokens, two methods in bfloat16 with AR in both
  precisions and in bfloat16's invariant mode, interleaved: a ratio per
  question for the default forward and the invariant one against the
  precision's AR and the fastest AR of any mode; each drop zero for its
  reference row; each AR mode against the fastest."""
  methods = ("prompt_lookup@k=3", "prompt_lookup@k=2")
  # tiles 0 and 5 are both bfloat16's 5 rows: one mode
  c = _config(tmp_path, parts="speedup", dtypes="float32,bfloat16", tiles="0,5", speedup_limit=1,
              speedup_tokens=8, speedup_methods=",".join(methods),
              speedup_method_dtypes="bfloat16", out="")
  out = invariance.run(c, progress=lambda s: None)
  rows = {(r["method"], r["dtype"], r["invariant_tile"]): r for r in out["speedup"]}
  ar_modes = {("ar", "float32", None), ("ar", "bfloat16", None), ("ar", "bfloat16", 5)}
  assert set(rows) == {(m, "bfloat16", t) for m in methods for t in (None, 5)} | ar_modes
  fastest = rows[(methods[0], "bfloat16", None)]["fastest_ar"]
  assert fastest in ("float32", "bfloat16", "bfloat16 invariant 5")
  assert all(r["fastest_ar"] == fastest for r in rows.values())
  # the fastest AR mode is the one with the highest median tokens/s, 1.00x itself
  ars = {key: rows[key] for key in ar_modes}
  top = max(ars.values(), key=lambda r: r["ar_tok_s_median"])
  assert top["vs_fastest_ar"] == [1.0, 1.0]
  assert fastest == top["dtype"] + (f" invariant {top['invariant_tile']}"
                                    if top["batch_invariant"] else "")
  assert {k: r["ar_tok_s_median"] > 0 for k, r in ars.items()} == {k: True for k in ar_modes}
  for key in (k for k in rows if k[0] != "ar"):
    r = rows[key]
    assert r["questions"] == 2 and len(r["speedups"]) == 2 and len(r["vs_fastest_ar"]) == 2
    assert all(0 < x < 100 for x in r["speedups"] + r["vs_fastest_ar"])
    assert r["speedup_median"] == pytest.approx(sorted(r["speedups"])[0] / 2 +
                                                sorted(r["speedups"])[1] / 2)
    # one question per category here: each category's median is its question's ratio
    assert sorted(r["categories"].values()) == sorted(r["vs_fastest_ar"])
    # against the fastest AR: the same ratios when it is bfloat16's default AR
    assert (r["vs_fastest_ar"] == r["speedups"]) == (fastest == "bfloat16")
  for m in methods:
    assert rows[(m, "bfloat16", None)]["drop_vs_default"] == 0.0
    assert rows[(m, "bfloat16", 5)]["drop_vs_default"] == pytest.approx(
        1 - rows[(m, "bfloat16", 5)]["speedup_median"]
        / rows[(m, "bfloat16", None)]["speedup_median"])
  best = max(rows[(m, "bfloat16", None)]["vs_fastest_ar_median"] for m in methods)
  for key in (k for k in rows if k[0] != "ar"):
    r = rows[key]
    assert r["drop_vs_best_default"] == pytest.approx(1 - r["vs_fastest_ar_median"] / best)
  assert min(rows[(m, "bfloat16", None)]["drop_vs_best_default"] for m in methods) == 0.0
  assert "| prompt_lookup@k=2 | bfloat16 | True | 5 | 2 |" in out["markdown"]
  assert "| bfloat16 | True | 5 | " in out["markdown"]  # the AR modes' table


def test_speedup_part_refuses_bad_method_settings_before_loading(tmp_path):
  for bad, match in ((dict(speedup_method_dtypes="float16"), "must be among dtypes"),
                     (dict(speedup_methods=" , "), "speedup_methods is empty")):
    with pytest.raises(ConfigValueError, match=match):
      invariance.run(_config(tmp_path, parts="speedup", out="", **bad), progress=lambda s: None)
