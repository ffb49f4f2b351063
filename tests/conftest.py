"""Session-wide fixtures: expensive things are built once per test session.

  smollm2      the real SmolLM2-135M-Instruct GGUF loaded by specjax (~10 s)
  hf_smollm2   the same file loaded by transformers (float32, eval) + its tokenizer
  tiny_gguf    a tiny llama GGUF written with gguf.GGUFWriter: known params, mixed
               quantization types, SmolLM2's tokenizer metadata

Add new fixtures at the end, one block each.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from typing import Callable, Dict, NamedTuple, Optional

import gguf
import jax
import numpy as np
import pytest

import specjax
from specjax.io import gguf as gguf_io
from specjax.io import gguf_writer
from specjax.io.load import load_model
from specjax.models import transformer
from specjax.models.config import ModelConfig

import compile_effort

jax.config.update("jax_enable_x64", False)
# Compiles dominate the suite's time on a 2-core CPU: keep XLA executables in a
# persistent cache, so that a program another module (or the other worker)
# already built is read back instead of compiled again (every program that
# took over 0.1 s is kept), and a second run on the same machine skips them.
# A cold cache only costs the compiles themselves; results never depend on it.
specjax.use_compilation_cache(min_compile_time_s=0.1)

SMOLLM2 = "smollm2-135m"


# --- the real model --------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
  """specjax.io.load.Model of SmolLM2-135M-Instruct (float32)."""
  return load_model(SMOLLM2)


SHORT_LAYERS = 4


@pytest.fixture(scope="session")
def smollm2_short(smollm2):
  """SmolLM2's first 4 of 30 layers with its own embedding, final norm, LM head
  and tokenizer (arrays shared, not copied). For tests of pipelines around
  the model (benchmark protocol, tables, files, resume): the real vocabulary,
  chat template and shapes at 1/5 of the compile time. What depends on the
  trained model's numerics (agreement with transformers, greedy identity, the
  PIT tests) runs on the whole model."""
  from specjax.drafters import draft_model  # pylint: disable=import-outside-toplevel
  params, cfg = draft_model.truncated_model(smollm2.params, smollm2.cfg, SHORT_LAYERS)
  return dataclasses.replace(smollm2, params=params, cfg=cfg)


class HFModel(NamedTuple):
  model: object  # transformers LlamaForCausalLM, float32, eval mode
  tokenizer: object  # transformers tokenizer built from the GGUF metadata


@pytest.fixture(scope="session")
def hf_smollm2() -> HFModel:
  """The same GGUF file, dequantized by transformers: an independent reference."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  folder, name = os.path.split(gguf_io.resolve_model_path(SMOLLM2))
  with pytest.MonkeyPatch.context() as mp:
    # Speed only (the same bytes and names come out): transformers parses the
    # file three times and rebuilds gguf's tensor-name map for each of ~400
    # modules (~15 s).
    mp.setattr(gguf, "GGUFReader", _plain_array_reader())
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(
        gguf.get_tensor_name_map))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return HFModel(model, tokenizer)


def _plain_array_reader():
  """gguf.GGUFReader parsing a plain-ndarray view of its np.memmap.

  transformers parses the file three times (config, weights, tokenizer), and each
  parse slices the memmap ~500k times, paying memmap.__array_finalize__ every time
  (~10 s per parse on this CPU). The view holds the same bytes: same fields, same
  tensors, ~3x faster. Written here rather than imported from specjax so the
  reference stays independent of the code under test.
  """

  class Reader(gguf.GGUFReader):

    @property
    def data(self):
      return self._data

    @data.setter
    def data(self, value):
      self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

  return Reader


# --- a tiny GGUF written in the session -------------------------------------------

# One quantization type per tensor, covering every type gguf.quants can write
# for 64-wide rows (the K-quants need rows of 256). Layer 0 keeps Q and K in F32
# so the rotary un-permutation can be checked bit for bit.
TINY_QTYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q8_0",  # written only when the LM head is not tied
    "output_norm.weight": "F32",
    "blk.0.attn_norm.weight": "F32",
    "blk.0.attn_q.weight": "F32",
    "blk.0.attn_k.weight": "F32",
    "blk.0.attn_v.weight": "F16",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_norm.weight": "F32",
    "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_1",
    "blk.1.attn_norm.weight": "F32",
    "blk.1.attn_q.weight": "Q4_1",
    "blk.1.attn_k.weight": "Q4_1",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "F32",
    "blk.1.ffn_norm.weight": "F32",
    "blk.1.ffn_gate.weight": "Q5_1",
    "blk.1.ffn_up.weight": "Q4_0",
    "blk.1.ffn_down.weight": "BF16",
}

_TOKENIZER_KEYS = gguf_writer.TOKENIZER_KEYS


def tiny_model_config(**overrides):
  """SmolLM2's vocabulary on a 2-layer, 64-wide llama (float32-exact hyper-parameters,
  so the config read back compares equal)."""
  base = dict(vocab_size=49152, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              ffn_dim=128, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True,
              max_seq_len=512, bos_id=1, eos_id=2, pad_id=2)
  base.update(overrides)
  return ModelConfig(**base)


def tiny_params(cfg, seed: int = 0) -> dict:
  """specjax params (numpy float32) with non-trivial norm scales: all-ones norms
  would hide a swap of the attention / MLP / final norms."""
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(seed), cfg))
  rng = np.random.default_rng(seed)
  scale = lambda: (1.0 + 0.3 * rng.standard_normal(cfg.dim)).astype(np.float32)
  for layer in params["layers"]:
    layer["attn_norm"], layer["mlp_norm"] = scale(), scale()
  params["final_norm"] = scale()
  return params


def write_llama_gguf(path, cfg, params: dict, tokenizer_fields: Optional[dict], *,
                     qtypes: Optional[Dict[str, str]] = None, **options) -> str:
  """specjax.io.gguf_writer.write_llama_gguf with TINY_QTYPES (overridden by
  `qtypes`) and the vocabulary of `tokenizer_fields` (a real file's
  TOKENIZER_KEYS metadata; None: no vocabulary)."""
  tok = None if tokenizer_fields is None else gguf_writer.TokenizerFields(
      *(tokenizer_fields[k] for k in gguf_writer.TOKENIZER_KEYS))
  return gguf_writer.write_llama_gguf(path, cfg, params, tokenizer=tok,
                                      qtypes={**TINY_QTYPES, **(qtypes or {})}, **options)


@dataclasses.dataclass(frozen=True)
class TinyGGUF:
  """A GGUF file written in this session, with what went into it."""

  path: str
  cfg: object  # ModelConfig that was written
  params: dict  # the float32 originals (specjax layout), before quantization
  qtypes: Dict[str, str]  # GGUF tensor name -> quantization type name
  tokenizer_fields: dict
  # write(path, cfg=..., params=..., tokenizer=True, **write_llama_gguf options)
  # -> another file; cfg / params default to this file's.
  write: Callable[..., str]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> TinyGGUF:
  reader = gguf_io.open_gguf(gguf_io.resolve_model_path(SMOLLM2))
  tokenizer_fields = {k: gguf_io.field(reader, k) for k in _TOKENIZER_KEYS}
  del reader
  cfg = tiny_model_config()
  params = tiny_params(cfg)

  def write(path, cfg=cfg, params=params, tokenizer=True, **options):
    return write_llama_gguf(path, cfg, params, tokenizer_fields if tokenizer else None,
                            **options)

  path = write(tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf")
  return TinyGGUF(path=path, cfg=cfg, params=params, qtypes=dict(TINY_QTYPES),
                  tokenizer_fields=tokenizer_fields, write=write)


# --- run configs -------------------------------------------------------------------

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "configs")


@pytest.fixture(scope="session")
def load_config():
  """load_config("medusa.py", "tiny", workdir=...) -> the config file's
  get_config(variant) with fields overridden."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  def load(filename, variant=None, **overrides):
    spec = importlib.util.spec_from_file_location(f"config_{filename[:-3]}",
                                                  os.path.join(CONFIGS_DIR, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(variant)
    for k, v in overrides.items():
      setattr(c, k, str(v) if k in ("workdir", "export") else v)
    return c
  return load


# --- scheduling ----------------------------------------------------------------------
#
# The README's command runs two workers (pytest -n 2 --dist loadfile: a module's
# tests and fixtures stay on one worker). Modules start longest first, so that
# neither worker finishes long before the other; the rest keep their order.
LONGEST_FIRST = (
    "test_exactness_montecarlo.py", "test_golden.py", "test_smollm2_speculative.py",
    "test_sharding.py", "test_golden_tiny.py", "test_multiprocess.py", "test_notebooks.py",
    "test_benchmark.py",
    "test_smollm2.py", "test_eagle.py", "test_draft_train.py", "test_peers.py",
    "test_medusa.py", "test_tree.py", "test_lookahead.py", "test_speculative.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


# --- the compile budget ----------------------------------------------------------------
#
# XLA compilations dominate the suite's time, and every new shape or static
# setting adds some. Each module's count of executables built (compiled, or
# read back from the persistent cache: the count does not depend on the
# cache's state) is checked against its budget in compile_budget.json, so the
# suite cannot silently grow back; seconds are printed, never asserted. Budgets
# are the recorded counts + 25% + 20 (which module first loads a session
# fixture, and near-tie checks that compile only where outputs diverge, move a
# few):
#   SPECJAX_COMPILE_BUDGET=record python -m pytest   -> compile_budget.json.recorded

BUDGET_FILE = os.path.join(os.path.dirname(__file__), "compile_budget.json")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = {"count": 0, "seconds": 0.0}


def _count_compile(event: str, duration: float, **_) -> None:
  if event == _COMPILE_EVENT:
    _compiles["count"] += 1
    _compiles["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _budgets() -> dict:
  import json  # pylint: disable=import-outside-toplevel
  with open(BUDGET_FILE) as f:
    return json.load(f)


_module_compiles = {}


@pytest.fixture(autouse=True, scope="module")
def _compile_budget(request):
  """Fails a module that builds more XLA executables than its budget."""
  before = dict(_compiles)
  yield
  name = os.path.basename(request.module.__file__)
  count = _compiles["count"] - before["count"]
  seconds = _compiles["seconds"] - before["seconds"]
  _module_compiles[name] = (count, seconds)
  budget = _budgets().get(name)
  if os.environ.get("SPECJAX_COMPILE_BUDGET") == "record":
    return
  if budget is None:  # a new module: record its count, then add its budget
    import warnings  # pylint: disable=import-outside-toplevel
    warnings.warn(f"{name} has no compile budget in {BUDGET_FILE}: it built {count} "
                  "executables; add it")
    return
  assert count <= budget, (
      f"{name} built {count} XLA executables, over its budget of {budget} ({BUDGET_FILE}): "
      "share shapes and static settings with the programs other tests compile, or raise the "
      "budget in the same commit and say why")


def pytest_sessionfinish(session):
  """An xdist worker hands its modules' counts to the controller."""
  if hasattr(session.config, "workeroutput"):
    session.config.workeroutput["compiles"] = dict(_module_compiles)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist controller: a worker finished
  _module_compiles.update(getattr(node, "workeroutput", {}).get("compiles", {}))


def pytest_terminal_summary(terminalreporter):
  if not _module_compiles:
    return
  terminalreporter.write_sep("=", "XLA executables built per module (count, compile seconds)")
  for name, (count, seconds) in sorted(_module_compiles.items(), key=lambda x: -x[1][1]):
    terminalreporter.write_line(f"{name:40s} {count:5d} {seconds:8.1f} s")
  if os.environ.get("SPECJAX_COMPILE_BUDGET") == "record":
    import json  # pylint: disable=import-outside-toplevel
    path = os.environ.get("SPECJAX_COMPILE_RECORD", BUDGET_FILE + ".recorded")
    with open(path, "w") as f:
      json.dump({n: c for n, (c, _) in sorted(_module_compiles.items())}, f, indent=1)


# --- compile effort per module ------------------------------------------------------
# (tests/compile_effort.py: which modules keep XLA's full optimisation, and why)

compile_effort.install()


@pytest.fixture(autouse=True, scope="module")
def _compile_effort(request):
  name = os.path.basename(request.module.__file__)
  jax.config.update("jax_disable_most_optimizations",
                    name not in compile_effort.OPTIMIZED_MODULES)
  yield
  jax.config.update("jax_disable_most_optimizations", False)


# --- process resources ---------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """Drop JAX's in-memory compiled executables after each test module.

  The whole suite runs in one process; on the 2-core CI machine XLA aborted
  (SIGABRT while compiling, no message, no OOM) once several hundred
  executables were alive, at a different test each run. Executables shared
  within a module stay shared; across modules the persistent compilation
  cache (above) reloads them from disk instead of recompiling."""
  yield
  jax.clear_caches()
  import gc  # pylint: disable=import-outside-toplevel
  gc.collect()
