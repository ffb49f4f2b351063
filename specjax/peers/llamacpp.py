"""llama.cpp (through llama-cpp-python) as a peer: the same GGUF file with its
own quantized kernels, greedy AR and its prompt lookup decoding.

llama-cpp-python is the optional `llamacpp` extra, imported on first use; the
peers benchmark skips this peer when it is absent. Its wheel compiles
llama.cpp (~10 min); on CPUs where the default build dies with "Illegal
instruction" build it with
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
              -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"

Modes (greedy: temperature 0 selects llama.cpp's greedy sampler; no repeat
penalty):

* AR: `Llama.generate` one token per forward.
* prompt lookup: `Llama(draft_model=LlamaPromptLookupDecoding(
  max_ngram_size=n, num_pred_tokens=k))` -- the last n..1 tokens are searched
  in the whole context, the earliest match's continuation (up to k tokens) is
  evaluated with the next token in one batch, and the guesses after the first
  mismatch are removed from the KV cache. (It makes llama-cpp-python compute
  logits for every position, also in rounds without guesses.) Its output is
  not always llama.cpp's own AR output: a verify batch of k + 1 rows runs
  other matmul kernels than a one-row step (activations quantized per batch),
  so the argmax flips where the top two logits are close.

`LlamaCppProcess` runs a loaded model in a child process of its own (what the
side-by-side benchmark uses: see its docstring for why).

Timing as the other peers: prefill ends when the first new token is handed
over by the generator; decode is the rest, tokens after the first over the
time after the first. Each run starts from an empty context (`reset()`), so a
repeat never reuses the previous run's prompt cache.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from typing import Optional, Sequence

# OpenMP's wait policy as this process started: the HF peer sets
# OMP_WAIT_POLICY=PASSIVE for PyTorch (specjax/peers/hf.py), and llama.cpp's
# CPU backend, built with OpenMP, synchronizes its threads at every op of a
# step; `LlamaCppProcess` gives its child this original setting.
_OMP_WAIT_POLICY_AT_START = os.environ.get("OMP_WAIT_POLICY")

EXTRA_HINT = ('pip install -e ".[llamacpp]"  (llama-cpp-python; it builds llama.cpp, '
              "~10 min)")


def available() -> bool:
  """Whether llama-cpp-python can be imported (without importing it)."""
  return importlib.util.find_spec("llama_cpp") is not None


def _import():
  try:
    import llama_cpp  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
        f"the llama.cpp peer needs the optional 'llamacpp' extra: {EXTRA_HINT} ({e})") from e
  return llama_cpp


def has_prompt_lookup() -> bool:
  """Whether this llama-cpp-python offers prompt lookup decoding."""
  _import()
  try:
    from llama_cpp import llama_speculative  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  return hasattr(llama_speculative, "LlamaPromptLookupDecoding")


@dataclasses.dataclass
class LlamaCppResult:
  """One greedy generation by llama.cpp (batch of one)."""

  tokens: list  # emitted token ids (EOS included when hit)
  prefill_s: float  # start -> first new token
  decode_s: float  # first new token -> last

  @property
  def decode_tokens(self) -> int:
    return len(self.tokens) - 1

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def load(path: str, *, n_ctx: int = 4096, threads: Optional[int] = None,
         prompt_lookup: Optional[tuple] = None):
  """A `llama_cpp.Llama` on a GGUF file.

  Args:
    n_ctx: context size (prompt + new tokens + guesses must fit).
    threads: threads for decode and prompt batches (default: all CPU cores).
    prompt_lookup: (k, max_ngram) to decode with prompt lookup; None for AR.
  """
  llama_cpp = _import()
  threads = threads or os.cpu_count() or 1
  draft = None
  if prompt_lookup is not None:
    if not has_prompt_lookup():
      raise ImportError("this llama-cpp-python has no llama_speculative.LlamaPromptLookupDecoding")
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # pylint: disable=import-outside-toplevel
    k, ngram = prompt_lookup
    draft = LlamaPromptLookupDecoding(max_ngram_size=int(ngram), num_pred_tokens=int(k))
  # logits_all with a draft model: llama-cpp-python (0.3.x) keeps every position's
  # logits when it has a draft model, but sizes its logits buffer from the
  # `logits_all` argument (n_batch rows when False), so a prompt longer than
  # n_batch (512) fails with "could not broadcast ... into shape (0,)".
  return llama_cpp.Llama(model_path=str(path), n_ctx=int(n_ctx), n_threads=threads,
                         n_threads_batch=threads, seed=0, draft_model=draft,
                         logits_all=draft is not None, verbose=False)


def settings(llm, *, mode: str = "ar", k: Optional[int] = None,
             max_ngram: Optional[int] = None) -> dict:
  llama_cpp = _import()
  out = {
      "llama_cpp_python": getattr(llama_cpp, "__version__", None),
      "threads": llm.n_threads,
      "threads_batch": llm.n_threads_batch,
      "n_ctx": llm.n_ctx(),
      "weights": "the GGUF's own quantized tensors",
      "sampler": "greedy (temp=0), repeat_penalty=1",
      "mode": mode,
      "process": ("a child process of its own" if isinstance(llm, LlamaCppProcess)
                  else "the caller's"),
      "OMP_WAIT_POLICY": (_OMP_WAIT_POLICY_AT_START if isinstance(llm, LlamaCppProcess)
                          else os.environ.get("OMP_WAIT_POLICY")),
      "timing": "generator hand-overs: prefill = start -> first token, decode = rest; "
                "warm-up runs excluded; context reset before each run",
  }
  if mode == "prompt_lookup":
    out.update({"k": k, "num_pred_tokens": k, "max_ngram_size": max_ngram, "min_ngram": 1,
                "match": "earliest occurrence, n-gram from max down to 1"})
  return out


def greedy_generate(llm, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_ids: Sequence[int] = ()) -> LlamaCppResult:
  """Greedy continuation of one token-id prompt; stops after an id in `eos_ids`
  (and the model's own EOS) or after max_new_tokens."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if len(prompt_ids) + max_new_tokens >= llm.n_ctx():
    raise ValueError(f"prompt ({len(prompt_ids)}) + {max_new_tokens} new tokens do not fit "
                     f"llama.cpp's context of {llm.n_ctx()}: raise n_ctx")
  stop = set(int(t) for t in eos_ids) | {int(llm.token_eos())}
  llm.reset()
  tokens, t_first = [], None
  t0 = time.perf_counter()
  gen = llm.generate([int(t) for t in prompt_ids], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                     repeat_penalty=1.0, reset=True)
  for token in gen:
    tokens.append(int(token))
    if t_first is None:
      t_first = time.perf_counter()
    if token in stop or len(tokens) >= max_new_tokens:
      break
  gen.close()
  t_end = time.perf_counter()
  if t_first is None:
    raise RuntimeError("llama.cpp produced no token")
  return LlamaCppResult(tokens=tokens, prefill_s=t_first - t0, decode_s=t_end - t_first)


# --- llama.cpp in a process of its own ------------------------------------------------


class LlamaCppProcess:
  """A `load`ed llama.cpp model served by a child process of its own.

  A process of its own is how llama.cpp is deployed: its threads and memory
  are not the benchmark process's, and it imports llama-cpp-python only
  (spawned, not forked: a fork of a process running JAX is unsafe). The
  child times each generation itself, as `greedy_generate` does in process.
  It starts with OpenMP's wait policy as this process started: the HF peer
  sets OMP_WAIT_POLICY=PASSIVE here for PyTorch, and llama.cpp's OpenMP
  threads, which meet at every op of a step, then sleep between ops (~900
  voluntary context switches per token instead of ~0; a side-by-side run with
  the policy inherited measured its AR at 38 tokens/s against 55.5 in a run
  without the HF peer, `experiments/results/peers/`).

  Attributes mirror `llama_cpp.Llama`'s (`n_threads`, `n_threads_batch`,
  `n_ctx()`), so `settings` takes either.
  """

  def __init__(self, path: str, *, n_ctx: int = 4096, threads: Optional[int] = None,
               prompt_lookup: Optional[tuple] = None):
    import multiprocessing  # pylint: disable=import-outside-toplevel
    if not available():  # a clear ImportError here rather than in the child
      _import()
    ctx = multiprocessing.get_context("spawn")
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=_serve, name="llama.cpp peer", daemon=True,
                             args=(child, str(path), dict(n_ctx=n_ctx, threads=threads,
                                                          prompt_lookup=prompt_lookup),
                                   _OMP_WAIT_POLICY_AT_START))
    self._proc.start()
    child.close()
    info = self._call(None)
    self.n_threads, self.n_threads_batch, self._n_ctx = info

  def n_ctx(self) -> int:
    return self._n_ctx

  def _call(self, request):
    if request is not None:
      self._conn.send(request)
    try:
      status, payload = self._conn.recv()
    except EOFError as e:
      raise RuntimeError(f"the llama.cpp peer process died (exit code "
                         f"{self._proc.exitcode})") from e
    if status == "ok":
      return payload
    kind, message = payload
    raise (ValueError if kind == "ValueError" else RuntimeError)(
        f"llama.cpp peer process: {kind}: {message}")

  def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                      eos_ids: Sequence[int] = ()) -> LlamaCppResult:
    """`greedy_generate` run by the child process."""
    return self._call(([int(t) for t in prompt_ids], int(max_new_tokens),
                       [int(t) for t in eos_ids]))

  def close(self) -> None:
    if self._proc.is_alive():
      try:
        self._conn.send("close")
      except (BrokenPipeError, OSError):
        pass
      self._proc.join(timeout=10)
      if self._proc.is_alive():
        self._proc.kill()
    self._conn.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _serve(conn, path: str, options: dict, omp_wait_policy: Optional[str]) -> None:
  """The child of `LlamaCppProcess`: load, then answer requests until told to close."""
  # Before llama_cpp (and with it libgomp, which reads it once) is imported here.
  if omp_wait_policy is None:
    os.environ.pop("OMP_WAIT_POLICY", None)
  else:
    os.environ["OMP_WAIT_POLICY"] = omp_wait_policy
  try:
    llm = load(path, **options)
    conn.send(("ok", (llm.n_threads, llm.n_threads_batch, llm.n_ctx())))
  except Exception as e:  # pylint: disable=broad-except
    conn.send(("error", (type(e).__name__, str(e))))
    return
  while True:
    try:
      request = conn.recv()
    except EOFError:  # the parent is gone
      return
    if request == "close":
      return
    try:
      conn.send(("ok", greedy_generate(llm, *request)))
    except Exception as e:  # pylint: disable=broad-except
      conn.send(("error", (type(e).__name__, str(e))))
