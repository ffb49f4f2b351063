"""Bad input, fuzzed: GGUF files, safetensors files, HF config.json, drafter
checkpoint directories, Spec-Bench prompt files and run settings, mutated
(truncated, bytes flipped, length / count / offset fields set huge, NaN / inf
weights, JSON fields of the wrong type or range), either load sanely or raise
the library's error for them (`specjax.errors`) -- never another exception, a
hang, or an unbounded allocation. Hypothesis drives the mutators of
`specjax.testing.fuzz` (derandomized, so CI sees the same inputs every run);
experiments/fuzz.py runs the same mutators for as long as one likes.
"""

import datetime
import json
import os
import struct
import time

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from specjax import errors
from specjax import sampling as sampling_lib
from specjax.testing import fuzz
from specjax.testing import fuzz_inputs
from specjax.benchmarks import questions
from specjax.drafters import registry
from specjax.io import gguf as gguf_io
from specjax.io import hf
from specjax.io.load import load_model
from specjax.io import checkpoints

# orbax leaves a coroutine un-awaited when it refuses a damaged checkpoint
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Examples per kind (~1,600 inputs), sized for ~60 s in all on a 2-core CPU.
EXAMPLES = {"gguf": 300, "safetensors": 300, "hf_config": 250, "checkpoint": 120,
            "prompts": 300, "config": 300}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
  return fuzz.make_seeds(str(tmp_path_factory.mktemp("fuzz")))


def _fuzz(kind, seeds, data):
  draw = lambda lo, hi: data.draw(st.integers(lo, hi))
  outcome, mutation, detail = fuzz.try_one(kind, seeds, draw)
  assert outcome != "crash", f"{kind} {mutation}: {detail}"


def _fuzz_test(kind):
  @hypothesis.settings(max_examples=EXAMPLES[kind], derandomize=True, database=None,
                       deadline=datetime.timedelta(seconds=20),
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(data=st.data())
  def test(seeds, data):
    _fuzz(kind, seeds, data)

  test.__name__ = f"test_fuzz_{kind}"
  test.__doc__ = f"Mutated {kind} inputs load sanely or raise the library's error."
  return test


for _kind in fuzz.KINDS:
  globals()[f"test_fuzz_{_kind}"] = _fuzz_test(_kind)


# --- the properties the fuzzer relies on, one input each ------------------------------


def test_error_family():
  for cls in (gguf_io.GGUFError, hf.HFFormatError, checkpoints.CheckpointError,
              errors.PromptFileError):
    assert issubclass(cls, errors.MalformedFileError)
  assert issubclass(errors.MalformedFileError, errors.BadInputError)
  assert issubclass(errors.ConfigValueError, errors.BadInputError)
  assert issubclass(errors.BadInputError, ValueError)


def test_seeds_load(seeds):
  model = load_model(seeds.gguf)
  assert model.cfg.replace(dtype="float32") == seeds.cfg.replace(
      rope_theta=model.cfg.rope_theta, norm_eps=model.cfg.norm_eps)
  assert model.tokenizer.decode(model.tokenizer.encode("the cat")) == "the cat"
  params, cfg = hf.load_hf(seeds.hf_dir)
  assert cfg.vocab_size == seeds.cfg.vocab_size
  params, card = checkpoints.load_drafter(seeds.checkpoint)
  assert card["method"] == "medusa"
  assert len(questions.load_questions(seeds.prompts)) == len(fuzz.PROMPTS)


def _gguf_header(n_tensors, n_kv):
  return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _key(name):
  return struct.pack("<Q", len(name)) + name


@pytest.mark.parametrize("content, match", [
    # a uint8 array declaring 2^62 elements: gguf's reader would loop (and grow
    # a list) once per declared element
    (_gguf_header(0, 1) + _key(b"a") + struct.pack("<IIQ", 9, 0, 2 ** 62), "elements of a"),
    (_gguf_header(0, 1) + _key(b"a") + struct.pack("<IIQ", 9, 8, 2 ** 62), "declares"),
    (_gguf_header(0, 1) + struct.pack("<Q", 2 ** 63) + b"a" * 16, r"metadata key 0 \("),
    (_gguf_header(2 ** 60, 2 ** 60) + b"\x00" * 64, "more than the"),
    (_gguf_header(0, 1) + _key(b"a") + struct.pack("<IIQ", 9, 9, 1), "array of arrays"),
    (_gguf_header(0, 1) + _key(b"a") + struct.pack("<I", 77) + b"\x00" * 8, "unknown value type"),
    (_gguf_header(1, 0) + _key(b"t") + struct.pack("<IQIQ", 1, 2 ** 40, 0, 0),
     "tensor t declares"),
    (_gguf_header(1, 0) + _key(b"t") + struct.pack("<IQIQ", 9, 4, 0, 0), "9 dimensions"),
    (_gguf_header(1, 0) + _key(b"t") + struct.pack("<IQIQ", 1, 4, 1234, 0), "unknown type 1234"),
], ids=["u8_array_2^62", "string_array_2^62", "key_length_2^63", "counts_2^60",
        "nested_array", "value_type_77", "tensor_past_end", "tensor_9_dims", "tensor_type_1234"])
def test_gguf_declared_sizes_are_checked_before_use(tmp_path, content, match):
  path = tmp_path / "bad.gguf"
  path.write_bytes(content + b"\x00" * 32)
  t0 = time.perf_counter()
  with pytest.raises(gguf_io.GGUFError, match=match) as e:
    gguf_io.open_gguf(str(path))
  assert str(path) in str(e.value)
  assert time.perf_counter() - t0 < 2.0


def test_gguf_wrong_metadata_type(seeds, tmp_path):
  """A hyper-parameter of the wrong type or an id outside the vocabulary."""
  from specjax.models import transformer  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(0), seeds.cfg))
  path = fuzz.write_tiny_gguf(str(tmp_path / "eos.gguf"), seeds.cfg.replace(eos_id=63), params)
  data = bytearray(open(path, "rb").read())
  reader = gguf_io.open_gguf(path)
  field = reader.fields["tokenizer.ggml.eos_token_id"]
  off = field.parts[-1].ctypes.data - reader.data.ctypes.data
  del reader, field
  data[off:off + 4] = struct.pack("<I", 64)
  open(path, "wb").write(bytes(data))
  with pytest.raises(gguf_io.GGUFError, match=r"eos_token_id=64 is out of range \[0, 63\]"):
    load_model(path)


def test_safetensors_huge_header(seeds, tmp_path):
  out = tmp_path / "hf"
  os.makedirs(out)
  for name in (hf.CONFIG_FILE, hf.WEIGHTS_FILE):
    data = open(os.path.join(seeds.hf_dir, name), "rb").read()
    if name == hf.WEIGHTS_FILE:
      data = struct.pack("<Q", 2 ** 62) + data[8:]
    (out / name).write_bytes(data)
  with pytest.raises(hf.HFFormatError, match="corrupt or truncated") as e:
    hf.load_hf(str(out))
  assert hf.WEIGHTS_FILE in str(e.value)


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("num_hidden_layers", -2, r"num_hidden_layers=-2 is out of range"),
    ("vocab_size", 2 ** 40, "vocab_size=.* is out of range"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan must be positive"),
    ("eos_token_id", 64, r"eos_token_id=64 is out of range \[-1, 63\]"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("architectures", "LlamaForCausalLM", "architectures must be a list"),
])
def test_hf_config_values(seeds, tmp_path, key, value, match):
  raw = json.load(open(os.path.join(seeds.hf_dir, hf.CONFIG_FILE)))
  raw[key] = value
  with pytest.raises(hf.HFFormatError, match=match):
    hf.config_from_dict(raw)


def test_checkpoint_nan_and_damage(seeds, tmp_path):
  with pytest.raises(checkpoints.CheckpointError, match=r"\['layers'\]\[0\]\['a'\].*NaN"):
    checkpoints.load_drafter(seeds.checkpoint_nan)
  bad = tmp_path / "ckpt"
  bad.mkdir()
  (bad / checkpoints.CARD).write_text("[1, 2]")
  with pytest.raises(checkpoints.CheckpointError, match="expected a JSON object"):
    checkpoints.load_drafter(str(bad))
  (bad / checkpoints.CARD).write_text('{"method": "medusa"}')
  with pytest.raises(checkpoints.CheckpointError, match="parameters .* are missing"):
    checkpoints.load_drafter(str(bad))


def test_a_failed_overwrite_keeps_the_checkpoint(tmp_path):
  """save_drafter writes the new parameters beside the old ones: a save that
  fails (here a leaf orbax cannot store) leaves the old checkpoint loadable and
  its other files in place; a save that succeeds replaces it."""
  card = {"method": "medusa", "target_fingerprint": "0123456789abcdef"}
  path = str(tmp_path / "ckpt")
  first = fuzz_inputs.tiny_drafter_params()
  checkpoints.save_drafter(path, first, card)
  (tmp_path / "ckpt" / "README.md").write_text("the card for readers")
  bad = fuzz_inputs.tiny_drafter_params()
  bad["layers"][0]["a"] = np.array([object()])
  with pytest.raises(checkpoints.CheckpointError, match="cannot save the parameters.*unchanged"):
    checkpoints.save_drafter(path, bad, dict(card, run=2))
  params, got = checkpoints.load_drafter(path)
  assert got == card and sorted(os.listdir(path)) == ["README.md", "card.json", "params"]
  np.testing.assert_array_equal(params["layers"][0]["a"], first["layers"][0]["a"])
  with pytest.raises(TypeError, match="int64"):  # a card JSON cannot hold: refused before any write
    checkpoints.save_drafter(path, first, dict(card, steps=np.int64(3)))
  assert sorted(os.listdir(path)) == ["README.md", "card.json", "params"]
  second = {**first, "layers": [{"a": first["layers"][0]["a"] + 1}]}
  checkpoints.save_drafter(path, second, dict(card, run=3))
  params, got = checkpoints.load_drafter(path)
  assert got["run"] == 3 and sorted(os.listdir(path)) == ["README.md", "card.json", "params"]
  np.testing.assert_array_equal(params["layers"][0]["a"], second["layers"][0]["a"])


@pytest.mark.parametrize("line, match", [
    ("{not json", "not a JSON line"),
    ('{"question_id": 4, "category": "qa"}', "record has no 'turns'"),
    ('{"question_id": "4", "category": "qa", "turns": ["x"]}', "'question_id' must be an integer"),
    ('{"question_id": 4, "category": 5, "turns": ["x"]}', "'category' must be a non-empty string"),
    ('{"question_id": 4, "category": "qa", "turns": "x"}', "'turns' must be a non-empty list"),
    ('{"question_id": 1, "category": "qa", "turns": ["x"]}', "question_id 1 repeats line 1"),
    ("[1, 2]", "expected a JSON object"),
])
def test_prompt_file_errors_name_file_and_line(tmp_path, line, match):
  path = tmp_path / "q.jsonl"
  path.write_text(json.dumps(fuzz.PROMPTS[0]) + "\n\n" + line + "\n")
  with pytest.raises(errors.PromptFileError, match=match) as e:
    questions.load_questions(str(path))
  assert f"{path}:3:" in str(e.value)
  path.write_bytes(json.dumps(fuzz.PROMPTS[0]).encode() + b"\n\xff\xfe\n")
  with pytest.raises(errors.PromptFileError, match=f"{path}:2: not UTF-8"):
    questions.load_questions(str(path))


def test_prompt_limit_is_a_count(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in fuzz.PROMPTS))
  with pytest.raises(errors.ConfigValueError, match="prompt_limit must be a whole number >= 0"):
    questions.load_questions(str(path), -1)  # was "no questions", blaming the file
  assert len(questions.load_questions(str(path), 0)) == len(fuzz.PROMPTS)  # 0: all


@pytest.mark.parametrize("config, match", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be a non-negative integer"),
    ({"top_k": 2.5}, "top_k must be a non-negative integer"),
    ({"method": "nope"}, "unknown drafting method 'nope'"),
    ({"k": -1}, "draft length k must be an integer >= 1"),
    ({"k": 0}, "draft length k must be an integer >= 1"),
    ({"k": "3"}, "draft length k must be an integer >= 1"),
    ({"k": True}, "draft length k must be an integer >= 1"),
    ({"method": "prompt_lookup@bogus=1"}, "unknown field 'bogus'"),
    ({"max_ngrams": 5, "kk": 2}, "^method 'prompt_lookup': unknown setting.*'kk', 'max_ngrams'"),
    ({"top_k": float("inf")}, "top_k must be a non-negative integer"),
    ({"top_k": float("nan")}, "top_k must be a non-negative integer"),
    ({"method": "draft_model", "draft_model": "self:0"}, "self:N"),
    ({"method": "layer_skip", "layers": "a-b"}, "layers='a-b': expected a layer string"),
    ({"method": "layer_skip", "layers": "abc"}, "layers='abc': expected a layer string"),
])
def test_bad_settings(seeds, config, match):
  config = {"method": "prompt_lookup", **config}
  with pytest.raises(errors.ConfigValueError, match=match):
    sampling = registry.sampling_of(config)
    registry.make_drafter(config["method"], config, seeds.target, sampling=sampling)


def test_sampling_config_rejects_nan():
  for kw in ({"temperature": float("nan")}, {"temperature": float("inf")},
             {"top_p": float("nan")}):
    with pytest.raises(errors.ConfigValueError):
      sampling_lib.SamplingConfig(**kw)
