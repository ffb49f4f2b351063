"""GGUF loading on a tiny llama file written in the session (conftest `tiny_gguf`):
config and params round trip through every quantization type, llama.cpp's Q/K
row permutation is undone, the loaded model computes the original's logits; and
every kind of bad file fails with a GGUFError that names the problem, never a
crash or a hang.
"""

import contextlib
import os
import signal
import struct

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.io import gguf as gguf_io
from specjax.errors import ConfigValueError
from specjax.io.gguf import GGUFError
from specjax.io.load import load_model
from specjax.models import transformer
from specjax.models.cache import init_cache

_QTYPE = gguf.GGMLQuantizationType
_F16_EPS = 2.0 ** -11  # relative rounding of the float16 block scales

# Worst-case |dequantized - original| per type, as a function of the blocks
# (..., 32) a row is quantized in. Blocks share a scale (and a minimum for the
# *_1 types): half a quantization step, plus the float16 rounding of the scale
# (times the largest code) and of the minimum.


def _step_bound(levels):
  def bound(b):
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    return (hi - lo) / levels / 2 + (hi - lo) * _F16_EPS + np.abs(lo) * _F16_EPS
  return bound


def _symmetric_bound(codes):
  # Q4_0 / Q5_0 map the block's signed extreme to code -codes; the opposite end
  # clips at codes - 1, up to one full step (amax / codes) away.
  def bound(b):
    amax = np.abs(b).max(-1, keepdims=True)
    return amax / codes + amax * 2 * _F16_EPS
  return bound


QUANT_ERROR = {
    "F32": lambda b: np.zeros_like(b),
    "F16": lambda b: np.abs(b) * _F16_EPS + 2.0 ** -24,
    "BF16": lambda b: np.abs(b) * 2.0 ** -8,
    "Q8_0": lambda b: np.abs(b).max(-1, keepdims=True) * (1 / 254 + _F16_EPS),
    "Q4_1": _step_bound(15),
    "Q5_1": _step_bound(31),
    "Q4_0": _symmetric_bound(8),
    "Q5_0": _symmetric_bound(16),
}


def quant_roundtrip(x, qtype):
  """What a GGUF of that type stores for x: the gguf package's own round trip."""
  return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(x, _QTYPE[qtype]), _QTYPE[qtype]),
                    np.float32).reshape(x.shape)


def check_close(loaded, original, qtype, name):
  """loaded == the quantization round trip of original, which is within the
  type's error bound of original."""
  loaded, original = np.asarray(loaded), np.asarray(original)
  assert loaded.shape == original.shape, name
  if qtype == "F32":
    np.testing.assert_array_equal(loaded, original, err_msg=name)
    return
  np.testing.assert_array_equal(loaded, quant_roundtrip(original, qtype), err_msg=name)
  blocks = original.reshape(original.shape[:-1] + (-1, 32))
  bound = np.broadcast_to(QUANT_ERROR[qtype](blocks), blocks.shape).reshape(original.shape)
  err = np.abs(loaded - original)
  assert np.all(err <= bound * 1.001 + 1e-7), (
      f"{name} ({qtype}): error {err.max():.3g} exceeds its quantization bound "
      f"(worst ratio {np.max(err / (bound + 1e-12)):.3g})")


def gguf_rows(name, x):
  """x as GGUF quantizes it, along rows of the input dim: specjax stores
  matrices (out, in) like GGUF, so rows are rows."""
  del name
  return x


def expected_layout(cfg, params, qtypes):
  """(name, getter of the loaded array, the original (a view into params), qtype)
  for every array of the specjax params layout."""
  h, g, dh, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  rows = [("embed", lambda p: p["embed"], params["embed"], "token_embd.weight"),
          ("final_norm", lambda p: p["final_norm"], params["final_norm"], "output_norm.weight")]
  if not cfg.tie_embeddings:
    rows.append(("lm_head", lambda p: p["lm_head"], params["lm_head"], "output.weight"))
  for i, lp in enumerate(params["layers"]):
    get = lambda key, lo=None, hi=None, i=i: (lambda p: p["layers"][i][key][lo:hi])
    rows += [
        (f"{i}.attn_norm", lambda p, i=i: p["layers"][i]["attn_norm"], lp["attn_norm"],
         f"blk.{i}.attn_norm.weight"),
        (f"{i}.mlp_norm", lambda p, i=i: p["layers"][i]["mlp_norm"], lp["mlp_norm"],
         f"blk.{i}.ffn_norm.weight"),
        (f"{i}.wq", get("wqkv", 0, h * dh), lp["wqkv"][:h * dh], f"blk.{i}.attn_q.weight"),
        (f"{i}.wk", get("wqkv", h * dh, (h + g) * dh), lp["wqkv"][h * dh:(h + g) * dh],
         f"blk.{i}.attn_k.weight"),
        (f"{i}.wv", get("wqkv", (h + g) * dh, None), lp["wqkv"][(h + g) * dh:],
         f"blk.{i}.attn_v.weight"),
        (f"{i}.wo", get("wo"), lp["wo"], f"blk.{i}.attn_output.weight"),
        (f"{i}.w_gate", get("w_gate_up", 0, f), lp["w_gate_up"][:f], f"blk.{i}.ffn_gate.weight"),
        (f"{i}.w_up", get("w_gate_up", f, None), lp["w_gate_up"][f:], f"blk.{i}.ffn_up.weight"),
        (f"{i}.w_down", get("w_down"), lp["w_down"], f"blk.{i}.ffn_down.weight"),
    ]
  return [(name, getter, orig, qtypes[tensor]) for name, getter, orig, tensor in rows]


def check_params(loaded, cfg, params, qtypes):
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for name, getter, original, qtype in expected_layout(cfg, params, qtypes):
    loaded_w = np.asarray(getter(loaded))
    assert loaded_w.dtype == np.float32, name
    check_close(gguf_rows(name, loaded_w), gguf_rows(name, original), qtype, name)


_forward = jax.jit(transformer.forward, static_argnums=1)


def logits(params, cfg, tokens):
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  out, _, _ = _forward(params, cfg, tokens, positions, init_cache(cfg, b, t))
  return np.asarray(out)


def quantized_originals(params, cfg, qtypes):
  """The original params after each tensor's quantization round trip, in specjax layout."""
  out = jax.tree.map(np.copy, params)
  for name, _, view, qtype in expected_layout(cfg, out, qtypes):  # views into `out`
    gguf_rows(name, view)[...] = quant_roundtrip(gguf_rows(name, view), qtype)
  return out


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
  return load_model(tiny_gguf.path)


@pytest.fixture(scope="module")
def tiny_reader(tiny_gguf):
  return gguf_io.open_gguf(tiny_gguf.path)


# --- round trip ------------------------------------------------------------------------


def test_config_round_trip(tiny_gguf, tiny_model):
  assert tiny_model.cfg == tiny_gguf.cfg
  assert hash(tiny_model.cfg) == hash(tiny_gguf.cfg)


def test_batch_invariant_settings_reach_the_config(tiny_gguf):
  cfg = load_model(tiny_gguf.path, batch_invariant=True, invariant_tile=5).cfg
  assert (cfg.batch_invariant, cfg.invariant_tile) == (True, 5)
  # unset: the precision's default (bfloat16 on where the CPU kernels run; float32 off)
  assert not load_model(tiny_gguf.path).cfg.batch_invariant
  bf16 = load_model(tiny_gguf.path, "bfloat16").cfg.batch_invariant
  assert bf16 == (jax.default_backend() == "cpu" and kernels.available())
  assert not load_model(tiny_gguf.path, "bfloat16", batch_invariant=False).cfg.batch_invariant
  with pytest.raises(ConfigValueError, match="needs batch_invariant=True"):
    load_model(tiny_gguf.path, invariant_tile=5)
  with pytest.raises(ConfigValueError, match="invariant_tile must be 0"):
    load_model(tiny_gguf.path, batch_invariant=True, invariant_tile=-3)


def test_every_quant_type_is_exercised(tiny_gguf, tiny_reader):
  written = {t.name: t.tensor_type.name for t in tiny_reader.tensors}
  assert written == {k: v for k, v in tiny_gguf.qtypes.items() if k != "output.weight"}
  assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"} <= set(written.values())


def test_params_round_trip(tiny_gguf, tiny_model):
  check_params(tiny_model.params, tiny_gguf.cfg, tiny_gguf.params, tiny_gguf.qtypes)


def test_qk_rows_are_unpermuted(tiny_gguf, tiny_model, tiny_reader):
  """Layer 0 stores Q and K in F32: the file holds llama.cpp's permuted rows, and
  the loaded wqkv equals the original bit for bit."""
  cfg = tiny_gguf.cfg
  h, g, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  original = tiny_gguf.params["layers"][0]["wqkv"]
  loaded = np.asarray(tiny_model.params["layers"][0]["wqkv"])
  stored = {t.name: np.asarray(t.data) for t in tiny_reader.tensors}
  for part, heads, lo, hi in (("q", h, 0, h * dh), ("k", g, h * dh, (h + g) * dh)):
    name = f"blk.0.attn_{part}.weight"
    assert tiny_gguf.qtypes[name] == "F32"
    file_rows = stored[name].reshape(hi - lo, cfg.dim)
    assert not np.array_equal(file_rows, original[lo:hi]), f"{name} is not permuted"
    np.testing.assert_array_equal(gguf_io._unpermute_rotary(file_rows, heads), original[lo:hi])
    np.testing.assert_array_equal(loaded[lo:hi], original[lo:hi])


def test_logits_round_trip(tiny_gguf, tiny_model):
  cfg = tiny_gguf.cfg
  tokens = [tiny_model.tokenizer.encode("The tiny model reads 12 tokens of text, ok?")[:12],
            list(range(100, 112))]
  loaded = logits(tiny_model.params, cfg, tokens)
  # Exactly the model the file describes: the originals after quantization.
  expected = logits(jax.tree.map(jnp.asarray, quantized_originals(tiny_gguf.params, cfg,
                                                                  tiny_gguf.qtypes)), cfg, tokens)
  np.testing.assert_allclose(loaded, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())
  # And close to the unquantized originals (loose: Q4 on random weights).
  original = logits(jax.tree.map(jnp.asarray, tiny_gguf.params), cfg, tokens)
  scale = np.abs(original).max()
  assert np.abs(loaded - original).max() < 0.2 * scale
  assert np.corrcoef(loaded.ravel(), original.ravel())[0, 1] > 0.98


def test_untied_lm_head(tiny_gguf, tmp_path):
  cfg = tiny_gguf.cfg.replace(tie_embeddings=False)
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(1), cfg))
  path = write_weights_only(tiny_gguf, tmp_path / "untied.gguf", cfg=cfg, params=params)
  loaded, loaded_cfg, _ = gguf_io.load_gguf(path)
  assert loaded_cfg == cfg
  check_params(loaded, cfg, params, tiny_gguf.qtypes)


def test_tokenizer_from_tiny_file(tiny_model):
  tok = tiny_model.tokenizer
  assert tok.vocab_size == 49152 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
  assert tok.decode(tok.encode("Hello, world! 123")) == "Hello, world! 123"
  assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]  # 'smollm' splits digits
  assert tok.render_chat([{"role": "user", "content": "hi"}]).endswith(
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- bad input -------------------------------------------------------------------------


@contextlib.contextmanager
def deadline(seconds):
  """Fail (instead of hanging the suite) if the body runs longer than `seconds`."""

  def expired(signum, frame):
    raise TimeoutError(f"still running after {seconds} s")

  previous = signal.signal(signal.SIGALRM, expired)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def load_fails(path, match, load=load_model):
  with deadline(60), pytest.raises(GGUFError, match=match) as info:
    load(str(path))
  return str(info.value)


def write_weights_only(tiny_gguf, path, **options):
  """A variant of the tiny file without the vocabulary (fast to write and parse),
  for specjax.io.gguf.load_gguf."""
  return tiny_gguf.write(path, tokenizer=False, **options)


def test_missing_file(tmp_path):
  path = tmp_path / "nowhere.gguf"
  assert str(path) in load_fails(path, "not found")


def test_unknown_model_name_lists_known_names():
  message = load_fails("no-such-model", r"unknown model 'no-such-model'")
  for name in gguf_io.KNOWN_MODELS:
    assert name in message


@pytest.mark.parametrize("content", [b"", b"GG", b"hello, this is a text file\n" * 10,
                                     b"\x00" * 64, b"PK\x03\x04" + b"\x00" * 100])
def test_not_a_gguf_file(tmp_path, content):
  path = tmp_path / "model.gguf"
  path.write_bytes(content)
  load_fails(path, "not a GGUF file")


def _cut_points(path, reader):
  """Offsets across every region of the file: header, metadata, tensor infos, data."""
  size = os.path.getsize(path)
  fields = reader.fields
  tokens = fields["tokenizer.ggml.tokens"].offset
  template = fields["tokenizer.chat_template"].offset
  info = reader.tensors[0].field.offset
  data = reader.data_offset
  return [4, 7, 16, 23, 30, tokens + 1000, template + 20, info + 10, data, size // 2,
          size - 1]


def test_truncated_file(tiny_gguf, tiny_reader, tmp_path):
  content = open(tiny_gguf.path, "rb").read()
  cuts = _cut_points(tiny_gguf.path, tiny_reader)
  assert sorted(cuts) == cuts and cuts[-1] < len(content)
  for cut in cuts:
    path = tmp_path / f"cut_{cut}.gguf"
    path.write_bytes(content[:cut])
    message = load_fails(path, "malformed or truncated")
    assert str(path) in message
    path.unlink()


@pytest.mark.parametrize("offset, value, match", [
    (4, struct.pack("<I", 99), "version 99"),  # unsupported GGUF version
    (24, struct.pack("<Q", 2 ** 62), "malformed"),  # absurd length of the first key
])
def test_corrupt_header(tiny_gguf, tmp_path, offset, value, match):
  content = bytearray(open(tiny_gguf.path, "rb").read())
  content[offset:offset + len(value)] = value
  path = tmp_path / "corrupt.gguf"
  path.write_bytes(bytes(content))
  load_fails(path, match)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("tensor", ["blk.1.ffn_norm.weight", "blk.0.ffn_gate.weight",
                                    "token_embd.weight"])
def test_nan_weight(tiny_gguf, tmp_path, tensor):
  path = write_weights_only(tiny_gguf, tmp_path / "nan.gguf", nan_in=tensor)
  load_fails(path, rf"tensor {tensor} contains NaN", load=gguf_io.load_gguf)


def test_unsupported_architecture(tiny_gguf, tmp_path):
  path = write_weights_only(tiny_gguf, tmp_path / "mamba.gguf", arch="mamba")
  load_fails(path, "architecture 'mamba' is not supported")


@pytest.mark.parametrize("tensor", ["blk.1.attn_v.weight", "output_norm.weight",
                                    "token_embd.weight"])
def test_missing_tensor(tiny_gguf, tmp_path, tensor):
  path = write_weights_only(tiny_gguf, tmp_path / "missing.gguf", skip=(tensor,))
  load_fails(path, rf"tensor {tensor} is missing", load=gguf_io.load_gguf)


def test_missing_vocabulary(tiny_gguf, tmp_path):
  """Weights without a tokenizer load with load_gguf; load_model, which also
  builds the tokenizer, names what is missing."""
  path = write_weights_only(tiny_gguf, tmp_path / "no_vocab.gguf")
  params, cfg, _ = gguf_io.load_gguf(path)
  assert cfg == tiny_gguf.cfg
  load_fails(path, "no tokenizer metadata")
