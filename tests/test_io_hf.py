"""HF-format directories: round trips, parity with transformers' logits in both
directions (which pins the layout convention), and a clear error for each bad
input. transformers is a test requirement: its absence fails these tests."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers  # noqa: F401  (a failed import must fail, not skip)

from specjax.errors import ConfigValueError
from specjax.io import hf
from specjax.io.hf import HFFormatError, load_hf, save_hf
from specjax.io.load import load_model
from specjax.models import transformer
from specjax.models.cache import init_cache
from specjax.models.config import tiny_config

# Two shapes: the default tiny model (GQA 4/2), and one with head_dim != D/H,
# a single kv head and odd sizes, so a transposed or mis-split tensor fails.
SHAPES = {
    "tiny": dict(),
    "odd": dict(vocab_size=50, dim=24, num_heads=4, num_kv_heads=1, head_dim=10,
                ffn_dim=40, rope_theta=5e5, norm_eps=1e-6, bos_id=3, eos_id=4, pad_id=5),
}
TOKENS = np.array([[1, 5, 9, 2, 17, 33, 8, 40, 3, 11]], np.int32)


@functools.lru_cache(maxsize=None)
def _untied_model(shape):
  """Random untied params of SHAPES[shape], in `transformer.init`'s structure.

  Values come from numpy (scaled normal; norm scales 1 +- 0.3, since all-ones
  norms would hide a swap of the input / post-attention / final norms): the
  structure is traced with `jax.eval_shape`, which compiles nothing, where a
  real `init` costs seconds of XLA compiles per new shape on a small CPU.
  """
  cfg = tiny_config(tie_embeddings=False, **SHAPES[shape])
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      w = 1.0 + 0.3 * rng.standard_normal(leaf.shape)
    else:
      w = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0] if "embed" not in name else 1)
    return jnp.asarray(w, leaf.dtype)

  shapes = jax.eval_shape(functools.partial(transformer.init, cfg=cfg), jax.random.key(0))
  return jax.tree_util.tree_map_with_path(fill, shapes), cfg


def random_model(shape="tiny", tie=True, dtype="float32"):
  params, cfg = _untied_model(shape)
  params = dict(params)
  if tie:
    del params["lm_head"]
  # Cast on the host: no per-shape convert compiles.
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x).astype(dtype)), params)
  return params, cfg.replace(tie_embeddings=tie, dtype=dtype)


_forward = jax.jit(transformer.forward, static_argnums=1)


def specjax_logits(params, cfg, tokens=TOKENS):
  tokens = jnp.asarray(tokens)
  b, t = tokens.shape
  cache = init_cache(cfg, b, t, dtype=jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  logits, _, _ = _forward(params, cfg, tokens, positions, cache)
  return np.asarray(logits)


def hf_logits(model, tokens=TOKENS):
  with torch.inference_mode():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def assert_params_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def saved(tmp_path, tie=True, shape="tiny"):
  params, cfg = random_model(shape, tie)
  path = str(tmp_path / "model")
  save_hf(path, params, cfg)
  return path, params, cfg


def edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  with open(file) as f:
    raw = json.load(f)
  for k, v in changes.items():
    if v is None:
      raw.pop(k, None)
    else:
      raw[k] = v
  with open(file, "w") as f:
    json.dump(raw, f)


def rewrite_weights(path, fn):
  """Apply fn to the {name: array} dict of model.safetensors and write it back."""
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  fn(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


# ---------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_identical(tmp_path, shape, tie):
  path, params, cfg = saved(tmp_path, tie=tie, shape=shape)
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  assert raw["tie_word_embeddings"] is tie
  with safetensors.safe_open(os.path.join(path, "model.safetensors"), "np") as f:
    assert ("lm_head.weight" in f.keys()) is (not tie)
  loaded, cfg2 = load_hf(path)
  assert cfg2 == cfg
  assert_params_equal(loaded, params)


def test_round_trip_bfloat16(tmp_path):
  params, cfg = random_model("odd", tie=False, dtype="bfloat16")
  path = str(tmp_path / "m")
  save_hf(path, params, cfg)
  loaded, cfg2 = load_hf(path)
  assert cfg2 == cfg and loaded["embed"].dtype == jnp.bfloat16
  assert_params_equal(loaded, params)
  # Widening to float32 on load is exact.
  wide, cfg3 = load_hf(path, dtype="float32")
  assert cfg3.dtype == "float32"
  assert_params_equal(wide, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params))


def test_sharded_index(tmp_path):
  path, params, _ = saved(tmp_path, tie=False)
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  os.remove(file)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  weight_map = {}
  for shard, keys in shards.items():
    safetensors.numpy.save_file({k: tensors[k] for k in keys}, os.path.join(path, shard),
                                metadata={"format": "pt"})
    weight_map.update({k: shard for k in keys})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  loaded, _ = load_hf(path)
  assert_params_equal(loaded, params)

  os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
  with pytest.raises(HFFormatError, match="model-00002-of-00002.safetensors is missing"):
    load_hf(path)


def test_config_fields(tmp_path):
  path, _, cfg = saved(tmp_path, shape="odd")
  # transformers 4.x spellings, a list of EOS ids, no pad id, mistral without a window.
  edit_config(path, rope_parameters=None, dtype=None, rope_theta=1234.0, torch_dtype="float16",
              eos_token_id=[7, 8], pad_token_id=None, model_type="mistral",
              architectures=["MistralForCausalLM"], sliding_window=None, head_dim=None)
  with pytest.raises(HFFormatError, match=r"q_proj.weight has shape \(40, 24\)"):  # head_dim 6
    load_hf(path)
  edit_config(path, head_dim=10)
  _, got = load_hf(path)
  assert got == cfg.replace(rope_theta=1234.0, eos_id=7, pad_id=7, dtype="float32")


# ---------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_saved_model(tmp_path, shape, tie):
  path, params, cfg = saved(tmp_path, tie=tie, shape=shape)
  model = transformers.LlamaForCausalLM.from_pretrained(path).float().eval()
  np.testing.assert_allclose(hf_logits(model), specjax_logits(params, cfg), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_loads_transformers_model(tmp_path, tie):
  torch.manual_seed(0)
  # The "odd" shape, so the jitted specjax forward is reused.
  config = transformers.LlamaConfig(
      vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=1, head_dim=10, intermediate_size=40, rope_theta=5e5,
      rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=256,
      bos_token_id=3, eos_token_id=4, pad_token_id=5)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # HF initializes norms to ones and std 0.02: make them matter.
    for name, w in model.named_parameters():
      w.copy_(1.0 + 0.3 * torch.randn_like(w) if "norm" in name else 0.2 * torch.randn_like(w))
  path = str(tmp_path / "hf")
  model.save_pretrained(path, safe_serialization=True)
  params, cfg = load_hf(path)
  assert cfg == random_model("odd", tie)[1]
  np.testing.assert_allclose(specjax_logits(params, cfg), hf_logits(model), atol=1e-4, rtol=0)

  # A bf16 checkpoint written by torch loads bit-exactly as bfloat16.
  bf_path = str(tmp_path / "hf_bf16")
  model.to(torch.bfloat16).save_pretrained(bf_path, safe_serialization=True)
  bf_params, bf_cfg = load_hf(bf_path)
  assert bf_cfg.dtype == "bfloat16"
  want = model.model.layers[1].mlp.down_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(bf_params["layers"][1]["w_down"], np.float32), want)


# ---------------------------------------------------------------------------
# Errors


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
  """load_model(HF dir, tokenizer_from=...) checks the pair: SmolLM2's 49,152
  tokens against a model of fewer rows would index past its embedding."""
  path, _, cfg = saved(tmp_path)
  assert cfg.vocab_size < 49152
  with pytest.raises(ConfigValueError, match=f"49152 tokens but the model's vocabulary has "
                     f"{cfg.vocab_size}"):
    load_model(path, tokenizer_from="smollm2-135m")


def test_missing_directory(tmp_path):
  with pytest.raises(HFFormatError, match="directory not found"):
    load_hf(str(tmp_path / "nope"))


def test_missing_config(tmp_path):
  path, _, _ = saved(tmp_path)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(HFFormatError, match="no config.json"):
    load_hf(path)


def test_missing_weights(tmp_path):
  path, _, _ = saved(tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  open(os.path.join(path, "pytorch_model.bin"), "wb").close()
  with pytest.raises(HFFormatError, match="no model.safetensors.*pytorch_model.bin"):
    load_hf(path)


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "RoPE scaling type 'llama3'"),
    (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
     "RoPE scaling type 'linear'"),
    (dict(model_type="mistral", sliding_window=64), "sliding_window=64"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
])
def test_bad_config(tmp_path, changes, match):
  path, _, _ = saved(tmp_path)
  edit_config(path, **changes)
  with pytest.raises(HFFormatError, match=match):
    load_hf(path)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"])
def test_missing_tensor(tmp_path, name):
  path, _, _ = saved(tmp_path, tie=False)
  rewrite_weights(path, lambda t: t.pop(name))
  with pytest.raises(HFFormatError, match=f"tensor {name} is missing"):
    load_hf(path)


def test_wrong_shape(tmp_path):
  path, _, _ = saved(tmp_path)

  def transpose_k(t):
    name = "model.layers.0.self_attn.k_proj.weight"
    t[name] = np.ascontiguousarray(t[name].T)

  rewrite_weights(path, transpose_k)
  with pytest.raises(HFFormatError, match=r"k_proj.weight has shape \(32, 16\), "
                     r"expected \(16, 32\)"):
    load_hf(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite(tmp_path, bad):
  path, _, _ = saved(tmp_path)

  def poison(t):
    t["model.layers.1.self_attn.o_proj.weight"][3, 4] = bad

  rewrite_weights(path, poison)
  with pytest.raises(HFFormatError, match="o_proj.weight contains NaN or inf"):
    load_hf(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
  path, _, _ = saved(tmp_path)
  file = os.path.join(path, "model.safetensors")
  with open(file, "rb") as f:
    data = f.read()
  with open(file, "wb") as f:
    f.write(data[: len(data) - 100] if damage == "truncate" else b"\x07" * 64)
  with pytest.raises(HFFormatError, match="model.safetensors is a corrupt or truncated"):
    load_hf(path)


def test_bad_shard_index(tmp_path):
  path, _, _ = saved(tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(HFFormatError, match="malformed shard index"):
    load_hf(path)


# ---------------------------------------------------------------------------
# Saving


def test_save_refuses_existing_and_overwrites(tmp_path):
  path, _, _ = saved(tmp_path)
  params, cfg = random_model(tie=False)
  with pytest.raises(FileExistsError):
    save_hf(path, params, cfg)
  save_hf(path, params, cfg, overwrite=True)
  assert_params_equal(load_hf(path)[0], params)
  assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary directories left


def test_save_is_atomic(tmp_path, monkeypatch):
  params, cfg = random_model()
  path = str(tmp_path / "model")

  def crash(*args, **kwargs):
    raise RuntimeError("disk full")

  monkeypatch.setattr(hf.safetensors.numpy, "save_file", crash)
  with pytest.raises(RuntimeError, match="disk full"):
    save_hf(path, params, cfg)
  assert os.listdir(tmp_path) == []  # neither a half-written model nor a temp dir


def test_save_extra_config_and_validation(tmp_path):
  params, cfg = random_model()
  path = str(tmp_path / "m")
  save_hf(path, params, cfg, extra_config={"chat_template_name": "chatml"})
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["chat_template_name"] == "chatml"
  with pytest.raises(ValueError, match="conflicts"):
    save_hf(str(tmp_path / "m2"), params, cfg, extra_config={"vocab_size": 3})
  with pytest.raises(ValueError, match="params do not match"):
    save_hf(str(tmp_path / "m3"), params, cfg.replace(ffn_dim=16))
