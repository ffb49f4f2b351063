"""The Spec-Bench protocol end to end on SmolLM2's first 4 layers (its
tokenizer, chat template, vocabulary and head; `smollm2_short`), with a tiny
fixture file (two categories, one two-turn question), plus the drafter
registry's errors.

One benchmark run (AR, prompt lookup, replay; 8 new tokens; every prompt in
one shape bucket so each method compiles once) is shared by the tests; a
second run over the same `out` must resume without generating anything.
"""

import dataclasses
import importlib.util
import json
import os
import re

import pytest

from specjax.benchmarks import questions
from specjax.benchmarks import specbench
from specjax.drafters import registry
from specjax.drafters import settings as drafter_settings
from specjax.errors import ConfigValueError

pytestmark = pytest.mark.slow

# Short prompts: every turn (the second one with the first answer) fits the
# 64-token bucket, so each method compiles once.
QUESTIONS = [
    {"question_id": 2, "category": "copy", "turns": ["Name a color.", "Name another one."]},
    {"question_id": 3, "category": "count", "turns": ["Count from one to five."]},
]
# 'name@field=value': a method with its own settings beside the run's (k = 4)
METHODS = ("prompt_lookup", "replay", "prompt_lookup@k=2")
FIELDS = ("method", "category", "speedup", "tau", "alpha", "tokens_per_s", "ar_tokens_per_s",
          "greedy_identical", "num_prompts", "temperature", "batch_size", "k", "top_k", "top_p",
          "precision", "seed", "max_new_tokens", "checkpoint", "speedup_iqr", "speedup_median",
          "commit", "hardware")


CONFIG_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "benchmark.py")
TABLES_CONFIG_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "configs",
                                  "paper_tables.py")


def _config_module(path=CONFIG_FILE):
  spec = importlib.util.spec_from_file_location("benchmark_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _config(tmp_path, config_file=CONFIG_FILE, settings=specbench.BenchmarkSettings,
            **overrides):
  path = tmp_path / "questions.jsonl"
  path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
  c = _config_module(config_file).get_config()
  c.prompts = str(path)
  c.methods = ",".join(METHODS)
  c.max_new_tokens = 8
  c.repeats = 1
  c.out = str(tmp_path / "out")
  for k, v in overrides.items():
    setattr(c, k, v)
  return settings.of(c)  # what experiments/benchmark.py does


@pytest.fixture(scope="module")
def bench(smollm2_short, tmp_path_factory):
  c = _config(tmp_path_factory.mktemp("bench"))
  first = specbench.run_benchmark(c, model=smollm2_short, progress=lambda line: None)
  with open(os.path.join(c.out, specbench.LOG)) as f:
    log_after_first = f.read()
  second = specbench.run_benchmark(c, model=smollm2_short, progress=lambda line: None)
  return c, first, second, log_after_first


def test_results_files_and_schema(bench):
  c, first, _, _ = bench
  with open(os.path.join(c.out, "results.json")) as f:
    results = json.load(f)
  assert results == json.loads(json.dumps(first["results"]))
  assert {(r["method"], r["category"]) for r in results} == {
      (m, cat) for m in METHODS for cat in ("copy", "count", specbench.ALL)}
  for r in results:
    assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
    assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0
    q1, q3 = r["speedup_iqr"]
    assert q1 <= r["speedup_median"] <= q3
    assert r["checkpoint"] is None and r["precision"] == "float32"
    k = 2 if r["method"].endswith("@k=2") else 4
    assert (r["k"], r["max_new_tokens"], r["batch_size"], r["temperature"]) == (k, 8, 1, 0.0)
    assert r["verify_width"] == k + 1 and r["tree"] is False
    assert r["hardware"]["cpu_count"] == os.cpu_count()
    # the calibrated prediction: from round counts and measured costs
    assert r["predicted_speedup"] > 0 and r["theorem_3_8"] > 0 and 0 <= r["draft_frac"] < 1
    assert r["ms_per_round"] > 0 and 0 <= r["narrow_frac"] <= 1
  calib = json.load(open(os.path.join(c.out, "calibration.json")))
  assert set(calib) == set(METHODS)
  for m in METHODS:
    widths = {"1", "2", "3"} if m.endswith("@k=2") else {"1", "2", "3", "5"}
    assert calib[m]["k"] == int(max(widths)) - 1 and set(calib[m]["t_verify"]) == widths
    assert calib[m]["t_draft"] < calib[m]["t_verify"]["1"]  # n-gram search / replay: cheap
    assert calib[m]["batch_size"] == 1
  by = {(r["method"], r["category"]): r for r in results}
  # the cost-optimal chain length, read off replay's acceptance histogram
  rep = by[("replay", "all")]
  assert 1 <= rep["best_k"] <= 4 and rep["best_k_predicted"] > 0
  assert by[("replay", "all")]["num_prompts"] == 2 and by[("replay", "copy")]["num_prompts"] == 1
  md = open(os.path.join(c.out, "results.md")).read()
  assert "| prompt_lookup | count | 1 | k=4 |" in md
  assert "| prompt_lookup@k=2 | count | 1 | k=2 |" in md
  assert os.path.getsize(os.path.join(c.out, "speedup.png")) > 1000


def test_greedy_outputs_identical_and_replay_accepts_everything(bench):
  _, first, _, _ = bench
  for r in first["results"]:
    assert r["greedy_identical"] is True, r
  replay = next(r for r in first["results"] if (r["method"], r["category"]) == ("replay", "all"))
  assert replay["alpha"] == 1.0  # the AR output itself, under greedy
  assert replay["tau"] > 1.0


def test_two_turn_prompt_contains_first_answer(bench, smollm2_short):
  c, _, _, log = bench
  recs = [json.loads(line) for line in log.splitlines()]
  ar = next(r for r in recs if (r["unit"], r["method"]) == ("2", "ar"))
  assert ar["turns"] == 2 and len(ar["answers"]) == 2 and len(ar["tokens"]) == 2
  first_answer = ar["answers"][0][0]
  assert first_answer.strip()
  prompt = smollm2_short.tokenizer.encode_chat(
      questions.chat_messages(QUESTIONS[0]["turns"], [first_answer]))
  assert len(prompt) == ar["prompt_tokens"][1][0] > ar["prompt_tokens"][0][0]
  text = smollm2_short.tokenizer.decode(prompt)
  assert text.index("Name a color.") < text.index(first_answer) < text.index("Name another one.")
  # Every method saw the same turn-2 prompt and produced tokens for both turns.
  for m in METHODS:
    rec = next(r for r in recs if (r["unit"], r["method"]) == ("2", m))
    assert rec["prompt_tokens"] == ar["prompt_tokens"] and len(rec["tokens"]) == 2


def test_resume_generates_nothing(bench):
  c, first, second, log = bench
  assert first["runs"] > 0
  assert second["runs"] == 0
  with open(os.path.join(c.out, specbench.LOG)) as f:
    assert f.read() == log
  units = {(json.loads(line)["unit"], json.loads(line)["method"]) for line in log.splitlines()}
  assert len(units) == len(log.splitlines()) == len(QUESTIONS) * (1 + len(METHODS))
  assert second["results"] == first["results"]


def test_method_settings_after_at(smollm2_short):
  assert registry.parse_method("eagle3_tree@tree_nodes=8@k=3") == (
      "eagle3_tree", {"tree_nodes": 8, "k": 3})
  assert registry.parse_method("medusa_tree@tree_mode=iid") == ("medusa_tree",
                                                                {"tree_mode": "iid"})
  with pytest.raises(ValueError, match="unknown field 'nodes'"):
    registry.parse_method("medusa_tree@nodes=8")
  with pytest.raises(ValueError, match="field=value"):
    registry.parse_method("medusa@8")
  d, _ = registry.make_drafter("prompt_lookup@k=2@max_ngram=2", {"k": 5, "max_ngram": 4},
                               smollm2_short)
  assert (d.k, d.max_ngram) == (2, 2)
  d, _ = registry.make_drafter("prompt_lookup", {"k": 5, "max_ngram": 4}, smollm2_short)
  assert (d.k, d.max_ngram) == (5, 4)  # the config itself is untouched


def test_method_fields_the_method_ignores_are_refused():
  # a field the method does not read was silently ignored: 'draft_model@checkpoint=DIR'
  # ran the shipped draft model (its directory is draft_model=DIR)
  with pytest.raises(ValueError, match="draft_model does not read 'checkpoint'"):
    registry.parse_method("draft_model@k=3@checkpoint=/tmp/x")
  with pytest.raises(ValueError, match="prompt_lookup does not read 'tree_nodes'"):
    registry.parse_method("prompt_lookup@tree_nodes=8")
  with pytest.raises(ValueError, match="lookahead_tree does not read 'k'"):
    registry.parse_method("lookahead_tree@k=3")
  assert registry.parse_method("draft_model@draft_model=/tmp/x") == (
      "draft_model", {"draft_model": "/tmp/x"})
  # one row per built-in method, naming fields that exist
  fields = {f.name for f in dataclasses.fields(drafter_settings.DrafterSettings)}
  assert set(drafter_settings.METHOD_FIELDS) <= set(registry.BUILDERS)
  assert set(registry.available_methods()) - set(drafter_settings.METHOD_FIELDS) <= {
      "repeat_ngram"}  # tests/test_new_drafter.py registers it
  for method, reads in drafter_settings.METHOD_FIELDS.items():
    assert "k" in reads or method == "lookahead_tree", method
    assert reads <= fields, (method, reads - fields)


def test_benchmark_refuses_repeated_or_unknown_methods(smollm2_short, tmp_path):
  for methods, match in (("prompt_lookup,prompt_lookup", "repeat"),
                         ("prompt_lookup@k=0", "k must be an integer >= 1"),
                         ("ngram@k=2", "unknown method")):
    c = _config(tmp_path, methods=methods)
    with pytest.raises(ValueError, match=match):
      specbench.run_benchmark(c, model=smollm2_short, progress=lambda line: None)
  for field, value in (("processes", 0), ("local_devices", -1)):  # these ran
    c = dataclasses.replace(_config(tmp_path, methods="prompt_lookup"), **{field: value})
    with pytest.raises(ValueError, match=f"{field} must be a whole number >= "):
      specbench.run_benchmark(c, model=smollm2_short, progress=lambda line: None)


def test_benchmark_takes_its_settings_dataclass(tmp_path):
  """The configs' defaults are the dataclass's; a ConfigDict is refused (the
  experiment main reads it into BenchmarkSettings once)."""
  module = _config_module()
  assert specbench.BenchmarkSettings.of(module.get_config()) == specbench.BenchmarkSettings()
  sample = specbench.BenchmarkSettings.of(module.get_config("sample"))
  assert (sample.sampling.temperature, sample.sampling.top_p) == (0.7, 0.9)
  with pytest.raises(TypeError, match="BenchmarkSettings"):
    specbench.run_benchmark(module.get_config(), progress=lambda line: None)


def test_resume_refuses_other_settings(bench, smollm2_short, tmp_path):
  c, _, _, _ = bench
  c2 = _config(tmp_path, out=c.out, max_new_tokens=9)
  with pytest.raises(ValueError, match="other settings"):
    specbench.run_benchmark(c2, model=smollm2_short, progress=lambda line: None)


def test_registry_errors(smollm2_short, tmp_path):
  with pytest.raises(ValueError, match="unknown drafting method 'nope'.*prompt_lookup"):
    registry.make_drafter("nope", {"k": 4}, smollm2_short)
  with pytest.raises(ValueError, match="k must be an integer >= 1"):
    registry.make_drafter("prompt_lookup", {"k": 0}, smollm2_short)
  with pytest.raises(ValueError, match="needs reference"):
    registry.make_drafter("replay", {"k": 4}, smollm2_short)
  with pytest.raises(ValueError, match="self:N"):
    registry.make_drafter("draft_model", {"draft_model": "self:99"}, smollm2_short)
  with pytest.raises(ValueError, match="unknown method 'nope'"):
    specbench.run_benchmark(_config(tmp_path, methods="prompt_lookup,nope"),
                            model=smollm2_short)
  with pytest.raises(ValueError, match="k must be an integer >= 1"):
    specbench.run_benchmark(_config(tmp_path, k=0), model=smollm2_short)


def test_registry_builds_every_method(smollm2_short):
  cfg = smollm2_short.cfg
  d, p = registry.make_drafter("layer_skip", {"k": 3}, smollm2_short)
  assert d.layers == tuple(range(cfg.num_layers // 3)) and p is None
  d, p = registry.make_drafter("draft_model", {"k": 2, "draft_model": "self:2"}, smollm2_short)
  assert d.cfg.num_layers == 2 and len(p["layers"]) == 2
  assert p["layers"][0] is smollm2_short.params["layers"][0]  # shared, not copied
  d, p = registry.make_drafter("replay", {"k": 2}, smollm2_short, reference=[[5, 6, 7]],
                               reference_width=8)
  assert p.tokens.shape == (1, 8) and int(p.length[0]) == 3
  d, _ = registry.make_drafter("prompt_lookup", {"k": 5, "max_ngram": 2}, smollm2_short)
  assert (d.k, d.max_ngram, d.min_ngram) == (5, 2, 1)
  d, _ = registry.make_drafter("always_reject", {"k": 1}, smollm2_short)
  assert d.k == 1
  sampled, _ = registry.make_drafter("layer_skip", {"temperature": 0.7, "top_p": 0.9}, smollm2_short)
  assert sampled.sampling.temperature == 0.7 and sampled.sampling.top_p == 0.9
  if "lookahead" in registry.available_methods():
    d, _ = registry.make_drafter("lookahead", {"k": 3}, smollm2_short)
    assert d.name == "lookahead" and d.k == 3


def test_paper_tables_end_to_end(smollm2_short, tmp_path):
  """Every table on the fixture prompts (prompt lookup; 8 tokens): files written,
  rows consistent with the runs behind them."""
  from specjax.benchmarks import paper_tables  # pylint: disable=import-outside-toplevel
  c = _config(tmp_path, TABLES_CONFIG_FILE, paper_tables.PaperTablesSettings,
              methods="prompt_lookup", tables="all", ks="1,2", batch_sizes="1,2")
  out = paper_tables.run(c, model=smollm2_short, progress=lambda line: None)
  for name in paper_tables.TABLES:
    for ext in ("md", "json", "png"):
      assert os.path.getsize(os.path.join(c.out, name, f"{name}.{ext}")) > 0, (name, ext)
  lev = out["leviathan"]["rows"][0]
  assert 0 <= lev["alpha_greedy"] <= 1 and 0 <= lev["alpha_T=1"] <= 1
  # the Spec-Bench form reads the leviathan greedy run: the same figures
  sb = {(r["method"], r["category"]): r for r in out["specbench"]["rows"]}
  assert set(sb) == {("prompt_lookup", cat) for cat in ("copy", "count", specbench.ALL)}
  assert sb["prompt_lookup", specbench.ALL]["tau"] == lev["tau_greedy"]
  assert "| prompt_lookup |" in out["specbench"]["markdown"]
  assert [r["k"] for r in out["gamma"]["rows"]] == [1, 2]
  assert all(r["speedup"] > 0 and r["theorem_3_8"] > 0 for r in out["gamma"]["rows"])
  assert [r["batch_size"] for r in out["batch"]["rows"]] == [1, 2]
  assert all(r["predicted_speedup"] > 0 for r in out["batch"]["rows"])
  for b in (1, 2):  # each B's prediction prices forwards of B rows
    calib = json.load(open(os.path.join(c.out, "batch", f"B{b}", "calibration.json")))
    assert calib["prompt_lookup"]["batch_size"] == b
    # with the batches' own counts: a batch runs until its slowest row is done
    for r in specbench.read_log(os.path.join(c.out, "batch", f"B{b}", specbench.LOG)):
      if r["method"] != "ar":
        st = r["stats"]
        assert st["rounds"] / b <= st["batch_rounds"] <= st["rounds"], st
        assert r["ar_decode_tokens"] / b <= r["ar_batch_steps"] <= r["ar_decode_tokens"], r
  exp = out["expected"]["rows"]
  assert [r["k"] for r in exp] == [1, 2, 3, 4]
  # k' = k: the histogram's own mean tokens per round
  assert exp[-1]["measured_tokens"] >= exp[0]["measured_tokens"] >= 1.0
  with pytest.raises(ValueError, match="unknown table"):
    paper_tables.run(dataclasses.replace(c, tables="nope"), model=smollm2_short)
  # a malformed list is refused by name before any table runs (model=None: none could)
  for field, bad in (("ks", "1,x"), ("ks", "0"), ("ks", ""), ("batch_sizes", "1,-2"),
                     ("batch_sizes", "2.5")):
    with pytest.raises(ConfigValueError, match=f"{field}="):
      paper_tables.run(dataclasses.replace(c, **{field: bad}), model=None)


def _as_bfloat16(model):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                        model.params),
                             cfg=model.cfg.replace(dtype="bfloat16"))


def test_reference_precision_ar_measured_beside_and_the_table_over_the_fastest(
    smollm2_short, tmp_path):
  """reference_dtype: AR also runs in that precision, interleaved; each row is
  also measured against the faster of the two ARs, and the Spec-Bench table
  shows that speedup with both ARs' tokens/s."""
  from specjax.benchmarks import paper_tables  # pylint: disable=import-outside-toplevel
  c = _config(tmp_path, TABLES_CONFIG_FILE, paper_tables.PaperTablesSettings,
              methods="prompt_lookup", tables="specbench", reference_dtype="bfloat16")
  sub = paper_tables._sub(c, os.path.join(c.out, "leviathan", "greedy"))  # pylint: disable=protected-access
  ref_model = _as_bfloat16(smollm2_short)
  lines = []
  first = specbench.run_benchmark(sub, model=smollm2_short, progress=lines.append,
                                  reference_model=ref_model)
  recs = specbench.read_log(os.path.join(sub.out, specbench.LOG))
  assert {r["method"] for r in recs} == {"ar", "prompt_lookup"}
  # the two ARs run back to back, the reference first where question + turn + repeat is odd
  ars = [m.groups() for m in (re.search(r"q(\d+) turn (\d+) (ar(?: \(bfloat16\))?) repeat (\d+)/", l)
                              for l in lines) if m]
  firsts = {}
  for q, t, name, r in ars:
    firsts.setdefault((int(q), int(t) - 1, int(r) - 1), name)
  assert firsts == {(2, 0, 0): "ar", (2, 1, 0): "ar (bfloat16)", (3, 0, 0): "ar (bfloat16)"}
  assert len(ars) == 2 * len(firsts)
  for r in recs:  # the reference AR ran in every unit, for every record
    assert r["ref_ar_decode_tokens"] > 0 and all(s > 0 for s in r["ref_ar_decode_s"]), r
  rows = {r["category"]: r for r in first["results"]}
  overall = rows[specbench.ALL]
  own_faster = overall["ar_tokens_per_s"] >= overall["reference_ar_tokens_per_s"]
  for r in rows.values():
    assert r["reference_dtype"] == "bfloat16" and r["reference_ar_tokens_per_s"] > 0
    assert r["fastest_ar"] == ("float32" if own_faster else "bfloat16")
    base = r["ar_tokens_per_s"] if own_faster else r["reference_ar_tokens_per_s"]
    assert r["speedup_vs_fastest_ar"] == pytest.approx(r["tokens_per_s"] / base)
    q1, q3 = r["speedup_vs_fastest_ar_iqr"]
    assert q1 <= r["speedup_vs_fastest_ar_median"] <= q3
  md = open(os.path.join(sub.out, "results.md")).read()
  assert f"| bfloat16 AR tok/s | vs fastest AR ({overall['fastest_ar']}) | IQR |" in md
  # the table resumes the run (nothing generated again) and shows the speedups over the fastest
  with open(os.path.join(sub.out, specbench.LOG)) as f:
    log = f.read()
  table = paper_tables.specbench_table(c, model=smollm2_short, progress=lambda line: None)
  with open(os.path.join(sub.out, specbench.LOG)) as f:
    assert f.read() == log
  assert f"Speedup over the fastest AR ({overall['fastest_ar']};" in table["markdown"]
  assert "| AR tok/s (float32) |" in table["markdown"]
  assert "| AR tok/s (bfloat16) |" in table["markdown"]
  med = overall["speedup_vs_fastest_ar_median"]
  assert "| prompt_lookup | " in table["markdown"] and f"{med:.2f}x [" in table["markdown"]
  # the setting keys the log: unset, a run's settings are those before it existed, and a
  # log written with it refuses a run without it (and the reverse)
  assert "reference_dtype" not in specbench._settings(dataclasses.replace(sub, reference_dtype=""))  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="other settings"):
    specbench.run_benchmark(dataclasses.replace(sub, reference_dtype=""), model=smollm2_short)
  # refusals: the run's own precision, an unknown one, a model of another precision, a
  # given bfloat16 model beside a float32 reference (its weights cast up are not float32's)
  for bad, match in (("float32", "'float32' is the run's own precision"),
                     ("float16", "unknown reference_dtype 'float16'")):
    with pytest.raises(ValueError, match=match):
      specbench.run_benchmark(dataclasses.replace(sub, reference_dtype=bad, out=str(tmp_path / bad)),
                              model=smollm2_short)
  with pytest.raises(ValueError, match="reference_model is float32"):
    specbench.run_benchmark(dataclasses.replace(sub, out=str(tmp_path / "m")),
                            model=smollm2_short, reference_model=smollm2_short)
  with pytest.raises(ValueError, match="pass reference_model"):
    specbench.run_benchmark(dataclasses.replace(sub, dtype="bfloat16", reference_dtype="float32",
                                                out=str(tmp_path / "up")), model=ref_model)
  # without reference_model, the given model itself is cast (not c.model reloaded)
  cast = specbench._cast_model(smollm2_short, "bfloat16", True)  # pylint: disable=protected-access
  assert cast.cfg.num_layers == smollm2_short.cfg.num_layers and cast.cfg.dtype == "bfloat16"
  assert cast.cfg.batch_invariant  # as the run resolves it for the reference's precision
  import jax  # pylint: disable=import-outside-toplevel
  assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(cast.params),
                                                  jax.tree.leaves(ref_model.params)))


def test_fastest_ar_is_the_precision_with_more_tokens_per_second():
  """The pure choice behind speedup_vs_fastest_ar, both ways (and None without a reference)."""
  def rec(method, own_s, ref_s):
    return {"method": method, "ar_decode_tokens": 100, "ar_decode_s": [own_s],
            "ref_ar_decode_tokens": 100, "ref_ar_decode_s": [ref_s]}
  meta = {"precision": "bfloat16", "reference_dtype": "float32"}
  assert specbench._fastest_ar([rec("m", 2.0, 1.0)], meta) == "float32"  # pylint: disable=protected-access
  assert specbench._fastest_ar([rec("m", 1.0, 2.0)], meta) == "bfloat16"  # pylint: disable=protected-access
  # the first method's records decide (every method carries the same AR runs)
  both = [rec("m", 1.0, 2.0), rec("n", 9.0, 1.0)]
  assert specbench._fastest_ar(both, meta) == "bfloat16"  # pylint: disable=protected-access
  assert specbench._fastest_ar(both, meta, ["n", "m"]) == "float32"  # pylint: disable=protected-access
  assert specbench._fastest_ar(both, meta, ["absent", "n"]) == "float32"  # pylint: disable=protected-access
  assert specbench._fastest_ar([rec("m", 2.0, 1.0)], {"precision": "bfloat16",  # pylint: disable=protected-access
                                                      "reference_dtype": None}) is None
  assert specbench._fastest_ar([rec("m", 0.0, 1.0)], meta) is None  # pylint: disable=protected-access


def test_which_ar_runs_first_alternates_and_calibrations_are_of_the_runs_batch_size():
  """The reference AR runs first in every other unit (whatever the question
  ids, so at any batch size), turn and repeat; a calibration entry of another
  batch size, or one without it (of one row), is measured again."""
  first = specbench.reference_runs_first
  assert [first(i, 0, 0) for i in range(4)] == [False, True, False, True]
  assert [first(0, 0, r) for r in range(3)] == [False, True, False]
  assert first(0, 1, 0) and not first(1, 1, 0)
  calib = {"a": {"batch_size": 2}, "b": {"batch_size": 1}, "c": {}}
  assert specbench.uncalibrated(calib, ["a", "b", "c", "d"], 2) == ["b", "c", "d"]
  assert specbench.uncalibrated(calib, ["a", "b", "c", "d"], 1) == ["a", "d"]


def test_prediction_at_batch_size_prices_the_slowest_row():
  """At B > 1 the calibrated prediction prices the batches' own rounds and AR
  steps (a batch pays for its slowest row) with B-row costs; at B = 1, or
  without those counts, the per-row formula."""
  from specjax.benchmarks import calibrate  # pylint: disable=import-outside-toplevel
  stats = {"rounds": 10, "emitted": 30, "proposed": 30, "accepted": 20, "narrow_rounds": 0,
           "verified_tokens": 40}
  calib = {"k": 3, "t_verify": {1: 1.0, 2: 1.1, 4: 1.5}, "t_draft": 0.5, "verify_width": 4}
  per_row = 30 * 1.0 / (10 * 0.5 + 10 * 1.5)
  assert calibrate.predict(stats, calib)["predicted_speedup"] == pytest.approx(per_row)
  batch = dict(stats, batch_rounds=8, ar_batch_steps=20)
  assert calibrate.predict(batch, calib)["predicted_speedup"] == pytest.approx(per_row)  # B = 1
  b2 = dict(calib, batch_size=2)
  pred = calibrate.predict(batch, b2)
  assert pred["predicted_speedup"] == pytest.approx(20 * 1.0 / (8 * (0.5 + 1.5)))
  assert pred["draft_frac"] == pytest.approx(0.25)
  assert calibrate.predict(stats, b2)["predicted_speedup"] == pytest.approx(per_row)  # old logs


def test_paper_tables_take_their_settings_dataclass():
  """configs/paper_tables.py's defaults are PaperTablesSettings'; its runs are
  BenchmarkSettings of the same values (the same settings ids); a ConfigDict
  is refused."""
  from specjax.benchmarks import paper_tables  # pylint: disable=import-outside-toplevel
  module = _config_module(TABLES_CONFIG_FILE)
  settings = paper_tables.PaperTablesSettings.of(module.get_config())
  assert settings == paper_tables.PaperTablesSettings()
  assert (settings.methods, settings.prompt_limit, settings.out) == (
      "draft_model,eagle3,prompt_lookup", 1, "/tmp/specjax_tables")
  variant = paper_tables.PaperTablesSettings.of(module.get_config("sample+bf16"))
  assert (variant.dtype, variant.sampling.temperature, variant.sampling.top_p) == (
      "bfloat16", 0.7, 0.9)
  sub = paper_tables._sub(variant, "/tmp/x", batch_size=2)  # pylint: disable=protected-access
  assert type(sub) is specbench.BenchmarkSettings and (sub.out, sub.batch_size) == ("/tmp/x", 2)
  bench = _config_module().get_config("sample+bf16")
  bench.update(methods=variant.methods, prompt_limit=1, max_new_tokens=96, repeats=2,
               batch_size=2, out="/tmp/x")
  assert sub == specbench.BenchmarkSettings.of(bench)
  for fn in (paper_tables.run, paper_tables.leviathan, paper_tables.gamma):
    with pytest.raises(TypeError, match="PaperTablesSettings"):
      fn(module.get_config())
