"""HF transformers as a peer: the same GGUF file, dequantized by transformers.

transformers and torch are the optional `peers` extra, imported on first use.

Prefill and decode are timed apart, the same way as specjax's
`GenerateResult` (prefill_s ends when the first new token exists; decode_s is
the rest): a streamer records when `generate` hands over each token. Its first
call carries the prompt, its second the first new token, so

  prefill_s = t(first new token) - t(start)
  decode_s  = t(end) - t(first new token),  decode tokens/s = (n - 1) / decode_s.

This separates the two phases inside one run, so no difference of two noisy runs
(generate with max_new_tokens=1 and with N) is needed. On the CPU `generate`
already syncs on every token to check for EOS, so the streamer adds no sync.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

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


def load_hf_gguf(path: str):
  """AutoModelForCausalLM from a GGUF file, float32, eval mode."""
  torch, transformers = _import_peers()
  folder, name = os.path.split(os.path.abspath(path))
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  return model.eval()


@dataclasses.dataclass
class HFResult:
  """One greedy generation by transformers (batch of one)."""

  tokens: list  # emitted token ids (EOS included when hit)
  prefill_s: float  # start of generate -> first new token
  decode_s: float  # first new token -> end of generate

  @property
  def decode_tokens_per_s(self) -> float:
    n = len(self.tokens) - 1
    return n / self.decode_s if self.decode_s > 0 else float("nan")


class _TokenClock:
  """A generate() streamer that only timestamps each put (duck-typed BaseStreamer)."""

  def __init__(self):
    self.times = []

  def put(self, value):
    del value
    self.times.append(time.perf_counter())

  def end(self):
    pass


def settings(model=None) -> dict:
  """How the peer runs: recorded next to its numbers."""
  torch, transformers = _import_peers()
  return {
      "threads": torch.get_num_threads(),
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "dtype": str(next(model.parameters()).dtype) if model is not None else "torch.float32",
      "inference_mode": True,
      "do_sample": False,
      "timing": "streamer timestamps: prefill = start -> first token, decode = rest",
  }


def hf_greedy_generate(model, prompt_ids: Sequence[int], max_new_tokens: int) -> HFResult:
  """Greedy continuation of one token-id prompt, on all CPU cores.

  Stops at the model's EOS (as specjax does) or after max_new_tokens.
  """
  torch, _ = _import_peers()
  torch.set_num_threads(os.cpu_count() or 1)
  ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
  clock = _TokenClock()
  with torch.inference_mode():
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         streamer=clock, pad_token_id=model.generation_config.eos_token_id)
    t_end = time.perf_counter()
  tokens = out[0, ids.shape[1]:].tolist()
  if len(clock.times) < 2:
    raise RuntimeError("generate() produced no token")
  return HFResult(tokens=tokens, prefill_s=clock.times[1] - t0, decode_s=t_end - clock.times[1])
