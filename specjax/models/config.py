"""Model configuration: a frozen, hashable dataclass passed to jit as static."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


# The largest tile of the batch-invariant forward: its per-row attention views
# are (tile, slots, kv heads, head dim) gathers, and no decode block is larger.
MAX_INVARIANT_TILE = 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU).

  Hashable, so it is passed to `jax.jit` as a static argument.
  """

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_seq_len: int = 8192
  bos_id: int = 1
  eos_id: int = 2
  pad_id: int = 2
  # Parameter / activation dtype name ("float32" or "bfloat16"); matmuls always
  # accumulate in float32.
  dtype: str = "float32"
  # Decode-time forwards (AR steps, verify blocks, trees) computed so that a
  # row's result is bit for bit independent of the block it is in
  # (`specjax.models.invariant`): greedy speculative decoding then equals
  # greedy AR token for token. `io.load.load_model` turns it on by default for
  # bfloat16 on the CPU (`invariant.default_for`); a bare config keeps it off.
  batch_invariant: bool = False
  # Rows per tile of the batch-invariant forward (0: the precision's default,
  # `specjax.models.invariant.TILES`). Every decode-time forward pads its B x T
  # rows to whole tiles of this size, so its cost is a step function of B x T:
  # a tile of B * (k + 1) verifies a chain in one tile (cheapest speculative
  # runs) and makes each AR step pay a whole tile. Bits depend on it: compare
  # runs made with the same tile.
  invariant_tile: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "ffn_dim", "max_seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if not 0 <= self.invariant_tile <= MAX_INVARIANT_TILE:
      raise ValueError(f"ModelConfig.invariant_tile must be 0 (the precision's default) or "
                       f"1..{MAX_INVARIANT_TILE} rows, got {self.invariant_tile}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, v = self.dim, self.ffn_dim, self.vocab_size
    attn = d * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else v * d
    return v * d + self.num_layers * per_layer + d + head


def tiny_config(**overrides) -> ModelConfig:
  """A small random model for tests: 2 layers, 4 heads / 2 kv heads, vocab 64."""
  base = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, ffn_dim=64, rope_theta=10000.0, max_seq_len=256,
              bos_id=1, eos_id=2, pad_id=0)
  base.update(overrides)
  return ModelConfig(**base)
