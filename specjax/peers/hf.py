"""HF transformers as a peer: the same weights (the GGUF file dequantized by
transformers, or an HF-format directory), greedy AR and transformers' own
speculative modes.

transformers and torch are the optional `peers` extra, imported on first use.

Modes (all greedy, batch of one unless said):

* `hf_greedy_generate`: plain autoregressive `generate`.
* `hf_assisted_generate`: assisted generation with an assistant (draft)
  model, `k` guesses per round, constant schedule, no confidence stop. In
  transformers 5.x the candidate generator reads `num_assistant_tokens`,
  `num_assistant_tokens_schedule` and `assistant_confidence_threshold` from
  the *assistant's* generation config (generation/candidate_generator.py:
  `AssistedCandidateGenerator.__init__` deep-copies
  `assistant_model.generation_config`); values passed to `generate()` land in
  the target's config and are ignored there. So they are set on the
  assistant. The default threshold (0.4) would stop drafting early; 0 turns
  it off, like specjax's `draft_stop=0`.
* `hf_batch_generate`: plain `generate` on a left-padded batch of prompts
  (answer throughput for training data, `specjax.benchmarks.datagen`).
* `hf_prompt_lookup_generate`: prompt lookup decoding
  (`prompt_lookup_num_tokens=k`, `max_matching_ngram_size=n`): the last n..1
  tokens are searched in the prompt + output, the EARLIEST match's
  continuation (up to k tokens) is proposed. (specjax's prompt_lookup
  proposes the most recent match.)

Prefill and decode are timed apart, the same way as specjax's
`GenerateResult` (prefill_s ends when the first new tokens exist; decode_s is
the rest): a streamer records when `generate` hands over tokens. Its first
call carries the prompt, its second the first new tokens -- one token for AR,
the first round's accepted guesses plus the bonus token for the speculative
modes (whose first round runs inside prefill, as their target prefill
verifies the first guesses) -- so

  prefill_s = t(first new tokens) - t(start)
  decode_s  = t(end) - t(first new tokens),
  decode tokens/s = (n - first_tokens) / decode_s.

This separates the two phases inside one run, so no difference of two noisy runs
(generate with max_new_tokens=1 and with N) is needed. On the CPU `generate`
already syncs on every round to check for EOS, so the streamer adds no sync.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

EXTRA_HINT = 'pip install -e ".[peers]"  (transformers, accelerate; torch)'


def _import_peers():
  # Interleaved with specjax in one process, torch's OpenMP workers must sleep
  # when idle: by default they spin for a while after each parallel region and
  # steal the cores from the specjax run that follows (measured: +5 ms/token).
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
        f"the HF transformers peer needs the optional 'peers' extra: {EXTRA_HINT} ({e})") from e
  return torch, transformers


def available() -> bool:
  """Whether torch and transformers can be imported (without importing them)."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def load_hf_gguf(path: str, dtype: str = "float32"):
  """AutoModelForCausalLM from a GGUF file (dequantized), eval mode."""
  torch, transformers = _import_peers()
  folder, name = os.path.split(os.path.abspath(path))
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=getattr(torch, dtype))
  return model.eval()


def load_hf_model(path: str, dtype: str = "float32"):
  """A causal LM from a GGUF file or an HF-format directory (e.g. a draft model
  written by experiments/export.py, which LlamaForCausalLM loads), eval mode."""
  if str(path).endswith(".gguf"):
    return load_hf_gguf(path, dtype)
  torch, transformers = _import_peers()
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=getattr(torch, dtype)).eval()


@dataclasses.dataclass
class HFResult:
  """One greedy generation by transformers (batch of one)."""

  tokens: list  # emitted token ids (EOS included when hit)
  prefill_s: float  # start of generate -> first new tokens
  decode_s: float  # first new tokens -> end of generate
  first_tokens: int = 1  # tokens handed over with the first new ones (prefill's share)
  rounds: Optional[int] = None  # target forwards after prefill (streamer hand-overs)

  @property
  def decode_tokens(self) -> int:
    return len(self.tokens) - self.first_tokens

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


class _TokenClock:
  """A generate() streamer that only timestamps each put and counts its tokens
  (duck-typed BaseStreamer)."""

  def __init__(self):
    self.times = []
    self.counts = []

  def put(self, value):
    self.times.append(time.perf_counter())
    self.counts.append(int(value.shape[-1]) if value.dim() else 1)

  def end(self):
    pass


def set_threads(threads: Optional[int] = None) -> int:
  """torch's intra-op threads (default: all CPU cores) -> the number set."""
  torch, _ = _import_peers()
  torch.set_num_threads(threads or os.cpu_count() or 1)
  return torch.get_num_threads()


def configure_assistant(assistant, k: int) -> None:
  """Make `assistant` draft exactly k guesses per round (see the module docstring)."""
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"num_assistant_tokens must be an integer >= 1, got {k!r}")
  g = assistant.generation_config
  g.num_assistant_tokens = k
  g.num_assistant_tokens_schedule = "constant"
  g.assistant_confidence_threshold = 0.0


def settings(model=None, *, mode: str = "ar", assistant=None, k: Optional[int] = None,
             max_ngram: Optional[int] = None) -> dict:
  """How the peer runs: recorded next to its numbers."""
  torch, transformers = _import_peers()
  out = {
      "threads": torch.get_num_threads(),
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "dtype": str(next(model.parameters()).dtype) if model is not None else "torch.float32",
      "inference_mode": True,
      "do_sample": False,
      "mode": mode,
      "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
      "timing": "streamer timestamps: prefill = start -> first new tokens, decode = rest; "
                "warm-up runs excluded",
  }
  if mode == "assisted":
    g = assistant.generation_config if assistant is not None else None
    out.update({
        "k": k,
        "num_assistant_tokens": g.num_assistant_tokens if g else k,
        "num_assistant_tokens_schedule": g.num_assistant_tokens_schedule if g else "constant",
        "assistant_confidence_threshold": g.assistant_confidence_threshold if g else 0.0,
        "assistant_dtype": (str(next(assistant.parameters()).dtype)
                            if assistant is not None else None),
        "assistant_layers": (assistant.config.num_hidden_layers
                             if assistant is not None else None),
        "assistant_vocab": assistant.config.vocab_size if assistant is not None else None,
    })
  elif mode == "prompt_lookup":
    out.update({"k": k, "prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram,
                "min_ngram": 1, "match": "earliest occurrence, n-gram from max down to 1"})
  return out


def _generate(model, prompt_ids: Sequence[int], max_new_tokens: int, threads: Optional[int],
              **mode) -> HFResult:
  torch, _ = _import_peers()
  set_threads(threads)
  ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
  clock = _TokenClock()
  with torch.inference_mode():
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         streamer=clock, pad_token_id=model.generation_config.eos_token_id,
                         **mode)
    t_end = time.perf_counter()
  tokens = out[0, ids.shape[1]:].tolist()
  if len(clock.times) < 2:
    raise RuntimeError("generate() produced no token")
  return HFResult(tokens=tokens, prefill_s=clock.times[1] - t0, decode_s=t_end - clock.times[1],
                  first_tokens=clock.counts[1], rounds=len(clock.times) - 2)


def hf_greedy_generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
                       threads: Optional[int] = None) -> HFResult:
  """Greedy continuation of one token-id prompt (default: on all CPU cores).

  Stops at the model's EOS (as specjax does) or after max_new_tokens.
  """
  return _generate(model, prompt_ids, max_new_tokens, threads)


def hf_batch_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      eos_ids: Sequence[int] = (), threads: Optional[int] = None) -> list:
  """Greedy answers of several prompts in ONE `generate` call (a static batch:
  prompts left-padded, the call runs until its longest answer ends), each
  answer cut after its first EOS (the model's own, or an id in `eos_ids`).
  -> list of token lists, in the prompts' order."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("hf_batch_generate needs at least one prompt and no empty prompt")
  torch, _ = _import_peers()
  set_threads(threads)
  own = model.generation_config.eos_token_id
  own = [] if own is None else ([own] if isinstance(own, int) else list(own))
  stop = {int(t) for t in eos_ids} | {int(t) for t in own}
  pad = min(stop) if stop else 0
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad, dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for row, p in enumerate(prompts):  # left padding: every row's last prompt token at width - 1
    ids[row, width - len(p):] = torch.tensor([int(t) for t in p], dtype=torch.long)
    mask[row, width - len(p):] = 1
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         pad_token_id=pad, eos_token_id=sorted(stop) or None)
  answers = []
  for row in out[:, width:].tolist():
    cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
    answers.append(row[:cut])
  return answers


def hf_assisted_generate(model, assistant, prompt_ids: Sequence[int], max_new_tokens: int,
                         k: int, threads: Optional[int] = None) -> HFResult:
  """Greedy assisted generation: `assistant` drafts k tokens per round, the
  target verifies them in one forward (the same vocabulary: no translation)."""
  configure_assistant(assistant, k)
  return _generate(model, prompt_ids, max_new_tokens, threads, assistant_model=assistant)


def hf_prompt_lookup_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, k: int,
                              max_ngram: int, threads: Optional[int] = None) -> HFResult:
  """Greedy prompt lookup decoding: up to k guesses copied after an n-gram match
  (n from max_ngram down to 1)."""
  if k < 1 or max_ngram < 1:
    raise ValueError(f"prompt lookup needs k >= 1 and max_ngram >= 1, got {k}, {max_ngram}")
  return _generate(model, prompt_ids, max_new_tokens, threads, prompt_lookup_num_tokens=k,
                   max_matching_ngram_size=max_ngram)
