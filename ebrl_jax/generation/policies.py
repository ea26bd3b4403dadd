"""Actor-critic networks (flax.linen). Every network maps normalised observations `obs [B, O]` to
`(dist_params [B, K, 2A], value [B])`: K action-chunk steps, each with a Gaussian mean and raw scale (see
`distribution.split_params`), and one critic value per observation.

* `MLPActorCritic`: Brax's PPO networks (separate policy and value MLPs, swish, lecun-uniform kernels, zero
  biases); K = 1.
* `TransformerActorCritic`: a VLA-style encoder: observation tokens, K action-query tokens and a value token
  through pre-LayerNorm blocks; ~1M to ~100M parameters via `d_model` and `num_layers`.

`make_network` also builds `token_policy.TokenPolicy` (`--policy=token`), which emits categorical action tokens
instead of `dist_params`; `generation.stages` tells the two contracts apart (`stages.head_of`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ebrl_jax.config import POLICIES, PolicyConfig
from ebrl_jax.generation import token_policy
from ebrl_jax.types import Array, Params

Dtype = Any


def count_params(params: Params) -> int:
  """Total number of scalars in a parameter pytree (works on `jax.eval_shape` outputs too)."""
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


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


class MLPActorCritic(nn.Module):
  """Brax's PPO networks: policy MLP `O -> hidden -> 2A`, value MLP `O -> hidden -> 1`, nothing shared."""
  policy_hidden_sizes: Sequence[int]
  value_hidden_sizes: Sequence[int]
  action_dim: int
  action_chunk: int = 1

  @nn.compact
  def __call__(self, obs: Array) -> Tuple[Array, Array]:
    """obs [B, O] -> (dist_params [B, 1, 2A], value [B])."""
    if self.action_chunk != 1:
      raise ValueError(f'MLPActorCritic emits one action per step; got action_chunk={self.action_chunk}.')
    chex.assert_rank(obs, 2)
    dist_params = MLP(tuple(self.policy_hidden_sizes) + (2 * self.action_dim,), name='policy')(obs)
    value = MLP(tuple(self.value_hidden_sizes) + (1,), name='value')(obs)
    return dist_params[:, None, :], value[:, 0]


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


class TransformerActorCritic(nn.Module):
  """Encoder over `N = ceil(O / obs_token_size)` observation tokens + K action queries + 1 value token.

  Params are float32; `dtype` (e.g. jnp.bfloat16) is the compute dtype of the trunk. The heads run in float32,
  so log-probs are computed from float32 distribution parameters.
  """
  d_model: int
  num_layers: int
  num_heads: int
  mlp_ratio: int
  obs_token_size: int
  action_dim: int
  action_chunk: int = 1
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, obs: Array) -> Tuple[Array, Array]:
    """obs [B, O] -> (dist_params [B, K, 2A], value [B])."""
    chex.assert_rank(obs, 2)
    batch, obs_dim = obs.shape
    num_tokens = -(-obs_dim // self.obs_token_size)
    pad = num_tokens * self.obs_token_size - obs_dim
    tokens = jnp.pad(obs, ((0, 0), (0, pad))).reshape(batch, num_tokens, self.obs_token_size)
    embed_init = nn.initializers.normal(0.02)
    x = nn.Dense(self.d_model, dtype=self.dtype, name='obs_embed')(tokens.astype(self.dtype))
    x = x + self.param('obs_pos_embed', embed_init, (num_tokens, self.d_model)).astype(self.dtype)
    queries = self.param('action_queries', embed_init, (self.action_chunk, self.d_model))
    value_token = self.param('value_token', embed_init, (1, self.d_model))
    extra = jnp.broadcast_to(
        jnp.concatenate([queries, value_token], 0)[None], (batch, self.action_chunk + 1, self.d_model))
    x = jnp.concatenate([x, extra.astype(self.dtype)], axis=1)  # [B, N + K + 1, D]
    for i in range(self.num_layers):
      x = EncoderBlock(self.num_heads, self.mlp_ratio, self.dtype, name=f'block_{i}')(x)
    x = nn.LayerNorm(dtype=jnp.float32, name='ln_final')(x[:, num_tokens:].astype(jnp.float32))
    head_init = nn.initializers.variance_scaling(0.01, 'fan_in', 'truncated_normal')
    dist_params = nn.Dense(2 * self.action_dim, kernel_init=head_init, name='action_head')(x[:, :-1])
    value = nn.Dense(1, kernel_init=head_init, name='value_head')(x[:, -1])
    chex.assert_shape(dist_params, (batch, self.action_chunk, 2 * self.action_dim))
    return dist_params, value[:, 0]


def make_network(policy_config: PolicyConfig, obs_dim: int, action_dim: int) -> nn.Module:
  """Builds the network named by `policy_config.kind`. `obs_dim` is accepted for symmetry (flax infers input
  sizes at init). The transformer and token policies compute in `policy_config.compute_dtype` (params stay
  float32); the token policy cuts the state into `obs_token_size` tokens with `token_policy.StateTokenizer`."""
  del obs_dim
  dtype = jnp.dtype(policy_config.compute_dtype)
  if policy_config.kind == 'mlp':
    return MLPActorCritic(policy_hidden_sizes=tuple(policy_config.policy_hidden_sizes),
                          value_hidden_sizes=tuple(policy_config.value_hidden_sizes),
                          action_dim=action_dim,
                          action_chunk=policy_config.action_chunk)
  if policy_config.kind == 'transformer':
    return TransformerActorCritic(d_model=policy_config.d_model,
                                  num_layers=policy_config.num_layers,
                                  num_heads=policy_config.num_heads,
                                  mlp_ratio=policy_config.mlp_ratio,
                                  obs_token_size=policy_config.obs_token_size,
                                  action_dim=action_dim,
                                  action_chunk=policy_config.action_chunk,
                                  dtype=dtype)
  if policy_config.kind == 'token':
    return token_policy.TokenPolicy(action_dim=action_dim,
                                    action_chunk=policy_config.action_chunk,
                                    num_bins=policy_config.num_bins,
                                    d_model=policy_config.d_model,
                                    num_layers=policy_config.num_layers,
                                    num_heads=policy_config.num_heads,
                                    mlp_ratio=policy_config.mlp_ratio,
                                    dtype=dtype,
                                    tokenizer=token_policy.StateTokenizer(policy_config.obs_token_size))
  raise ValueError(f'--policy={policy_config.kind!r} is not valid; allowed values: {", ".join(POLICIES)}.')
