"""The errors specjax raises for bad input and for numerical faults.

One family for everything a user can get wrong from outside the library:

  BadInputError (ValueError)
    MalformedFileError     a file (GGUF, safetensors / HF directory, drafter
                           checkpoint, prompt file) is missing, truncated,
                           garbled, or holds what no model can be made of
                           (wrong magic, unknown dtype, shape or size not
                           matching its config or its own length, NaN weights);
                           the message names the file (and the line, for
                           line-based files) and the problem
    ConfigValueError       a setting is out of range or unknown (negative k,
                           temperature < 0, top_p outside (0, 1], unknown
                           method, ...)

and one for a fault found while decoding:

  NonFiniteLogitsError (FloatingPointError)
                           the target produced NaN / inf logits for a token it
                           was about to emit; raised instead of returning
                           tokens drawn from them

The loaders' own errors (`specjax.io.gguf.GGUFError`, `specjax.io.hf.HFFormatError`,
`specjax.io.checkpoints.CheckpointError`, `PromptFileError`) are
subclasses of MalformedFileError, so `except MalformedFileError` catches any
bad file, and `except ValueError` still catches everything it caught before.
Parsers check every size, count and offset a file declares against the file's
real size before they allocate or loop on it.
"""

from __future__ import annotations

from typing import Optional, Sequence


class BadInputError(ValueError):
  """Input from outside the library (a file or a setting) that cannot be used."""


class MalformedFileError(BadInputError):
  """A file that is missing, truncated, garbled or not a usable model / prompt file."""


class PromptFileError(MalformedFileError):
  """A prompt file (Spec-Bench JSONL) with a bad line; the message names file and line."""


class ConfigValueError(BadInputError):
  """A setting outside its range, of the wrong type, or unknown."""


class NonFiniteLogitsError(FloatingPointError):
  """The target's logits were NaN or inf where a token was to be chosen.

  Attributes:
    rows: batch rows that saw non-finite logits.
    token_index: per row of `rows`, the index (0 = the first new token) of
      the first output token whose logits were not finite.
    result: the generation result (tokens up to the end of the loop), for
      inspection; its tokens from `token_index` on are not to be trusted.
  """

  def __init__(self, rows: Sequence[int], token_index: Sequence[int], result=None,
               what: str = "decoding"):
    self.rows = list(rows)
    self.token_index = list(token_index)
    self.result = result
    shown = ", ".join(f"row {r} at output token {t}"
                      for r, t in list(zip(self.rows, self.token_index))[:8])
    more = f" (and {len(self.rows) - 8} more rows)" if len(self.rows) > 8 else ""
    super().__init__(
        f"{what}: the target model produced NaN or inf logits: {shown}{more}. The tokens "
        "from there on would be drawn from garbage; check the weights (a NaN in a "
        "parameter), the dtype (bfloat16 overflow), or the inputs")


def first_nonfinite(nonfinite_at, result=None, what: str = "decoding") -> Optional[
    NonFiniteLogitsError]:
  """The error to raise for per-row first-bad-token indices (-1: none), or None."""
  rows = [i for i, t in enumerate(nonfinite_at) if int(t) >= 0]
  if not rows:
    return None
  return NonFiniteLogitsError(rows, [int(nonfinite_at[i]) for i in rows], result, what)
