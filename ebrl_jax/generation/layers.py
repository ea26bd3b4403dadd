"""Building blocks the network families share (flax.linen): Brax's MLP and a pre-LayerNorm transformer block.

`policies` (state networks) and `vision` (pixel networks) both build on these; `policies` re-exports them.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from ebrl_jax.types import Array

Dtype = Any


class MLP(nn.Module):
  """Dense layers with `activation` between them (not after the last), lecun-uniform kernels as in Brax."""
  layer_sizes: Sequence[int]
  activation: Callable[[Array], Array] = nn.swish

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for i, size in enumerate(self.layer_sizes):
      x = nn.Dense(size, kernel_init=nn.initializers.lecun_uniform(), name=f'hidden_{i}')(x)
      if i != len(self.layer_sizes) - 1:
        x = self.activation(x)
    return x


class EncoderBlock(nn.Module):
  """Pre-LayerNorm transformer block: x + MHA(LN(x)), then x + MLP(LN(x)). tokens [B, N, D] -> [B, N, D]."""
  num_heads: int
  mlp_ratio: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    d_model = x.shape[-1]
    h = nn.LayerNorm(dtype=self.dtype, name='ln_attn')(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                        dtype=self.dtype,
                                        param_dtype=jnp.float32,
                                        name='attn')(h, h)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name='ln_mlp')(x)
    h = nn.Dense(self.mlp_ratio * d_model, dtype=self.dtype, name='mlp_in')(h)
    h = nn.Dense(d_model, dtype=self.dtype, name='mlp_out')(nn.gelu(h))
    return x + h
