"""Self-speculative decoding by layer skipping (Zhang et al. 2023, "Draft &
Verify", arXiv:2309.08168; early exit as in LayerSkip, Elhoushi et al. 2024).

The drafter is the target itself running a subset of its layers (then the
final norm and the LM head): no second model in memory. It reads and writes
the target's own cache: the committed prefix there was written by the full
model, and every slot the drafter writes (length - 1 .. length + k - 2) is
rewritten by the verify forward, which feeds length - 1 .. length - 1 + k.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import cut_at_eos, sample_chain
from specjax.models import transformer


def parse_layers(spec, num_layers: int) -> Tuple[int, ...]:
  """'0-11' / '0,2,4' / 'every2' / (0, 1, 2) -> sorted layer tuple."""
  try:
    layers = _layer_list(spec, num_layers)
  except (TypeError, ValueError):
    raise ValueError(f"layers={spec!r}: expected a layer string such as '0-11', '0,2,4' or "
                     "'every2', or a list of layer indices") from None
  if not layers or any(not 0 <= i < num_layers for i in layers):
    raise ValueError(f"layer subset {spec!r} must name layers in [0, {num_layers})")
  return tuple(sorted(set(layers)))


def _layer_list(spec, num_layers: int) -> Tuple[int, ...]:
  if isinstance(spec, str):
    if spec.startswith("every"):
      layers = tuple(range(0, num_layers, int(spec[5:])))
    else:
      layers = []
      for part in spec.split(","):
        if "-" in part:
          a, b = part.split("-")
          layers.extend(range(int(a), int(b) + 1))
        elif part.strip():
          layers.append(int(part))
      layers = tuple(layers)
  else:
    layers = tuple(int(i) for i in spec)
  return layers


@dataclasses.dataclass(frozen=True)
class LayerSkip(Drafter):
  layers: Tuple[int, ...] = ()
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  name = "layer_skip"

  def __post_init__(self):
    super().__post_init__()
    if not self.layers:
      raise ValueError("LayerSkip needs a non-empty subset of layers")

  def check(self, target_cfg, params) -> None:
    if max(self.layers) >= target_cfg.num_layers:
      raise ValueError(f"layer_skip: layer {max(self.layers)} does not exist in a "
                       f"{target_cfg.num_layers}-layer target")

  def propose(self, params, target, state, ctx, target_cache, keys):
    """Drafts with the target's own layers: writes their keys/values into the
    target's cache above its fill level (the verify forward rewrites them)."""
    cache = target_cache
    last = jnp.take_along_axis(ctx.history, (ctx.length - 1)[:, None], axis=1)

    def step(c, x):
      lg, _, c = transformer.forward(
          target.params, target.cfg, x[:, None], transformer.chain_positions(c, 1), c,
          active=ctx.active, layers=self.layers)
      return lg[:, 0], c

    first, cache = step(cache, last[:, 0])
    tokens, q, cache, _ = sample_chain(step, cache, first, keys, self.k, self.sampling,
                                       ctx.active)
    num = cut_at_eos(tokens, jnp.full(tokens.shape[:1], self.k, jnp.int32), target.cfg.eos_id)
    return Proposal(tokens=tokens, q=q, num_proposed=num), state, cache
