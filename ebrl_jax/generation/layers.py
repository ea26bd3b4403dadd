"""Building blocks the network families share (flax.linen): their base class (`PolicyNetwork`), Brax's MLP, a
pre-LayerNorm transformer block, and the encoder-and-heads of the Gaussian transformer actor-critics
(`encode_with_heads`).

`policies` (state networks) and `vision` (pixel networks) both build on these; `policies` re-exports them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import chex
import flax.linen as nn
import jax.numpy as jnp

from ebrl_jax.types import Array

Dtype = Any
EMBED_INIT = nn.initializers.normal(0.02)
HEAD_INIT = nn.initializers.variance_scaling(0.01, 'fan_in', 'truncated_normal')


class PolicyNetwork(nn.Module):
  """The base of every actor-critic network family. `normalize_observations` is its `PolicyConfig`'s, recorded
  by `policies.make_network` so that `stages.init_policy_params` (and the train state's init) honours the config
  without being told again; None (a network built by hand) leaves it to init's argument. The network's own
  computation never reads it: the normaliser runs in `stages`, on the params' statistics."""
  normalize_observations: Optional[bool] = dataclasses.field(default=None, kw_only=True)


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


def encode_with_heads(module: nn.Module, tokens: Array, state: Array, *, action_chunk: int, action_dim: int,
                      num_layers: int, num_heads: int, mlp_ratio: int, dtype: Dtype, critic: str,
                      value_hidden_sizes: Sequence[int]):
  """The Gaussian transformer actor-critics' encoder and heads, their parameters created on `module` (called from
  its compact `__call__`): observation tokens [B, N, D] + K action queries (+ a value token with
  `critic='shared'`) through `num_layers` `EncoderBlock`s and a final LayerNorm; the action head reads the K query
  outputs, the value the value token's (shared) or a separate MLP of `value_hidden_sizes` reads `state` [B, O]
  (mlp). Returns (dist_params [B, K, 2A] float32, value [B] float32)."""
  shared = critic == 'shared'
  batch, num_tokens, d_model = tokens.shape
  extra = module.param('action_queries', EMBED_INIT, (action_chunk, d_model))
  if shared:
    extra = jnp.concatenate([extra, module.param('value_token', EMBED_INIT, (1, d_model))], 0)
  x = jnp.concatenate([tokens, jnp.broadcast_to(extra[None], (batch,) + extra.shape).astype(dtype)], axis=1)
  for i in range(num_layers):
    x = EncoderBlock(num_heads, mlp_ratio, dtype, name=f'block_{i}')(x)  # [B, N + K (+ 1), D]
  x = nn.LayerNorm(dtype=jnp.float32, name='ln_final')(x[:, num_tokens:].astype(jnp.float32))
  dist_params = nn.Dense(2 * action_dim, kernel_init=HEAD_INIT, name='action_head')(x[:, :action_chunk])
  if shared:
    value = nn.Dense(1, kernel_init=HEAD_INIT, name='value_head')(x[:, -1])
  else:
    value = MLP(tuple(value_hidden_sizes) + (1,), name='value')(state.astype(jnp.float32))
  chex.assert_shape(dist_params, (batch, action_chunk, 2 * action_dim))
  return dist_params, value[:, 0]
