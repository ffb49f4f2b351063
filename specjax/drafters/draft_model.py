"""An independent draft model (Leviathan et al. 2023; Chen et al. 2023).

Any model that shares the target's vocabulary: a smaller pretrained model, a
distilled one (`specjax.training`), or a tiny random one in tests. It keeps its
own KV cache of the committed history. Each round it first feeds the committed
tokens it has not seen -- the correction or bonus token, and after an
all-accept round also its own last guess (which the verify forward fed but it
did not) -- then drafts k tokens autoregressively. On commit its fill level is
lowered to the prefix it agrees with, discarding what it wrote for rejected
guesses.

A reduced draft vocabulary (a distilled model trained with one, or any draft
model narrowed at load by `with_draft_vocab`): params carry "vocab" (Vd,) ids
and "lm_rows" (Vd, D), those rows of its LM head; drafting computes logits over
them only (on SmolLM2 the full LM head costs more than its first layers) and
q is zero on every other token -- exactly the distribution drawn from.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import (chain_widths, check_draft_stop, cut_at_eos, draw_from,
                                    parse_draft_vocab, ranked_vocab, sample_chain)
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

# The most committed tokens a chain drafter can be behind: the bonus token plus
# its own last guess after an all-accept round.
CATCH_UP = 2


@flax.struct.dataclass
class DraftModelState:
  cache: cache_lib.KVCache  # holds history[:cache.length]


@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
  cfg: ModelConfig = None
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  # > 0: dynamic draft length, stop once the chain's confidence falls below (`sample_chain`)
  draft_stop: float = 0.0
  name = "draft_model"
  keeps_own_guesses = True  # its cache holds its accepted guesses' entries (`commit`)

  def __post_init__(self):
    super().__post_init__()
    if self.cfg is None:
      raise ValueError("DraftModel needs the draft model's ModelConfig")
    check_draft_stop(self.name, self.draft_stop)

  @property
  def verify_widths(self) -> tuple:
    return chain_widths(self.k, self.draft_stop)

  @property
  def vocab_size(self):
    return self.cfg.vocab_size

  def check(self, target_cfg, params) -> None:
    super().check(target_cfg, params)
    if params is None:
      raise ValueError("draft_model: the draft model's params were not loaded (draft_params)")

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots):
    b, t = prompt_tokens.shape
    cache = cache_lib.init_cache(self.cfg, b, num_slots)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, _, cache = transformer.forward(params, self.cfg, prompt_tokens, pos, cache,
                                      compute_logits=False)
    return DraftModelState(cache=cache.with_length(prompt_lengths))

  def draft(self, params, target, state, ctx, keys):
    cache = state.cache
    m = cache.length
    behind = jnp.clip(ctx.length - m, 1, CATCH_UP)
    idx = jnp.minimum(m[:, None] + jnp.arange(CATCH_UP)[None], ctx.history.shape[1] - 1)
    fed = jnp.take_along_axis(ctx.history, idx, axis=1)
    logits, cache = self._forward(params, fed, cache, CATCH_UP, ctx.active)
    cache = cache.with_length(jnp.where(ctx.active, m + behind, m))
    first = jnp.take_along_axis(logits, (behind - 1)[:, None, None], axis=1)[:, 0]

    def step(c, x):
      lg, c = self._forward(params, x[:, None], c, 1, ctx.active)
      return lg[:, 0], c

    def draw(lg, i):
      return draw_from(lg, self.sampling, keys, i, params.get("vocab"), self.cfg.vocab_size)

    tokens, q, cache, num = sample_chain(step, cache, first, keys, self.k, self.sampling,
                                         ctx.active, draw=draw, draft_stop=self.draft_stop)
    num = cut_at_eos(tokens, num, self.cfg.eos_id)
    return Proposal(tokens=tokens, q=q, num_proposed=num), DraftModelState(cache)

  def _forward(self, params, tokens, cache, num_new: int, active):
    """-> (logits over the draft vocabulary (B, T, V or Vd), cache)."""
    pos = transformer.chain_positions(cache, num_new)
    if "vocab" not in params:
      logits, _, cache = transformer.forward(params, self.cfg, tokens, pos, cache, active=active)
      return logits, cache
    _, hidden, cache = transformer.forward(params, self.cfg, tokens, pos, cache, active=active,
                                           compute_logits=False)
    return transformer.lm_head({"embed": params["lm_rows"]},
                               self.cfg.replace(tie_embeddings=True), hidden), cache

  def commit(self, params, state, ctx, verify):
    # Entries past the committed prefix it agrees with belong to rejected guesses.
    c = state.cache
    return DraftModelState(c.with_length(jnp.minimum(c.length, ctx.length - 1)))


def with_draft_vocab(params, cfg: ModelConfig, draft_vocab, rank=None):
  """The draft model's params with its draft vocabulary chosen at load time:
  None keeps the params' own ("vocab" or the full one); "full" drops it; N
  keeps the N first tokens of `rank` (most frequent first; default the
  params' "vocab_rank"), EOS always included. Adds "lm_rows" for the
  reduced case."""
  params = {k: v for k, v in params.items() if k not in ("lm_rows",)}
  rank = params.pop("vocab_rank", rank)
  choice = parse_draft_vocab(draft_vocab, cfg)
  if choice == "full":
    params.pop("vocab", None)
  elif choice is not None:
    params["vocab"] = ranked_vocab(rank, choice, cfg, params.get("vocab"))
  if "vocab" in params:
    w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    params["lm_rows"] = jnp.take(w, params["vocab"], axis=0)
  return params


def truncated_model(params, cfg: ModelConfig, num_layers: int):
  """The target's first `num_layers` layers + final norm + LM head as a separate
  draft model (arrays shared, not copied; it keeps its own cache). A weak but
  legitimate independent drafter until a trained one is loaded."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"a truncated draft model needs 1..{cfg.num_layers} layers, got {num_layers}")
  dparams = dict(params, layers=list(params["layers"][:num_layers]))
  return dparams, cfg.replace(num_layers=num_layers)


def student_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
  """A distilled draft model's config: the target's with `num_layers` layers."""
  return cfg.replace(num_layers=num_layers)


def assemble(student: dict, target_params, cfg: ModelConfig) -> dict:
  """Full draft-model params: the student's layers and norm + the target's
  embedding (and untied LM head); arrays shared, cast to the target's dtype.
  Extra entries of the student ("vocab", ...) are kept."""
  dt = cfg.jnp_dtype
  out = {k: v for k, v in student.items() if k not in ("layers", "final_norm", "vocab_rank")}
  out["layers"] = [jax.tree.map(lambda x: x.astype(dt), l) for l in student["layers"]]
  out["final_norm"] = student["final_norm"].astype(dt)
  out["embed"] = target_params["embed"]
  if not cfg.tie_embeddings:
    out["lm_head"] = target_params["lm_head"]
  return out
