"""Actor-critic networks (flax.linen). Every network maps normalised observations `obs [B, O]` to
`(dist_params [B, K, 2A], value [B])`: K action-chunk steps, each with a Gaussian mean and raw scale (see
`distribution.split_params`), and one critic value per observation.

* `MLPActorCritic`: Brax's PPO networks (separate policy and value MLPs, swish, lecun-uniform kernels, zero
  biases); K = 1.
* `TransformerActorCritic`: a VLA-style encoder: observation tokens, K action-query tokens (and a value token,
  `--critic=shared`) through pre-LayerNorm blocks; ~1M to ~100M parameters via `d_model` and `num_layers`. Its
  critic is a separate MLP by default (`--critic`, config_generation).

`make_network` also builds `token_policy.TokenPolicy` (`--policy=token`), which emits categorical action tokens
instead of `dist_params`; `generation.stages` tells the two contracts apart (`stages.head_of`). With camera
observations (`--obs=pixels`) it builds the pixel networks of `vision` instead, which take a `types.PixelObs`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ebrl_jax import config_generation
from ebrl_jax.config import POLICIES, PolicyConfig
from ebrl_jax.generation import layers
from ebrl_jax.generation import token_policy
from ebrl_jax.generation import vision
from ebrl_jax.types import Array, Params

Dtype = Any

MLP = layers.MLP
EncoderBlock = layers.EncoderBlock


def count_params(params: Params) -> int:
  """Total number of scalars in a parameter pytree (works on `jax.eval_shape` outputs too)."""
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


class MLPActorCritic(layers.PolicyNetwork):
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


class TransformerActorCritic(layers.PolicyNetwork):
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
  # 'shared': the value token's head on the trunk; 'mlp': a separate MLP critic of `value_hidden_sizes` on the
  # observation (no value token), so the value loss moves no policy parameter (config_generation, --critic).
  critic: str = 'shared'
  value_hidden_sizes: Sequence[int] = (256, 256, 256, 256, 256)

  @nn.compact
  def __call__(self, obs: Array) -> Tuple[Array, Array]:
    """obs [B, O] -> (dist_params [B, K, 2A], value [B])."""
    chex.assert_rank(obs, 2)
    batch, obs_dim = obs.shape
    num_tokens = -(-obs_dim // self.obs_token_size)
    pad = num_tokens * self.obs_token_size - obs_dim
    tokens = jnp.pad(obs, ((0, 0), (0, pad))).reshape(batch, num_tokens, self.obs_token_size)
    x = nn.Dense(self.d_model, dtype=self.dtype, name='obs_embed')(tokens.astype(self.dtype))
    x = x + self.param('obs_pos_embed', layers.EMBED_INIT, (num_tokens, self.d_model)).astype(self.dtype)
    return layers.encode_with_heads(self,
                                    x,
                                    obs,
                                    action_chunk=self.action_chunk,
                                    action_dim=self.action_dim,
                                    num_layers=self.num_layers,
                                    num_heads=self.num_heads,
                                    mlp_ratio=self.mlp_ratio,
                                    dtype=self.dtype,
                                    critic=self.critic,
                                    value_hidden_sizes=self.value_hidden_sizes)


def make_network(policy_config: PolicyConfig, obs_dim: int, action_dim: int, pixel_shape: Tuple[int,
                                                                                                ...] = ()) -> nn.Module:
  """Builds the network named by `policy_config.kind`. `obs_dim` is accepted for symmetry (flax infers input
  sizes at init). The transformer and token policies, and with pixels the MLP policy's CNN encoder, compute in
  `policy_config.compute_dtype` (params stay float32); the token policy cuts the state into `obs_token_size`
  tokens with `token_policy.StateTokenizer`.
  With `pixel_shape` (`--obs=pixels`) the network takes a `types.PixelObs`: see `_make_pixel_network`.
  The network records `policy_config.normalize_observations` (`layers.PolicyNetwork`), which
  `stages.init_policy_params` and `trainer.stages.init_train_state` take up."""
  del obs_dim
  network = _build_network(policy_config, action_dim, pixel_shape)
  return network.clone(normalize_observations=policy_config.normalize_observations)


def _build_network(policy_config: PolicyConfig, action_dim: int, pixel_shape: Tuple[int, ...]) -> nn.Module:
  """`make_network`'s network, before it records the config's normalize_observations."""
  critic = config_generation.critic_of(policy_config, pixels=bool(pixel_shape))
  if pixel_shape:
    return _make_pixel_network(policy_config, action_dim, critic)
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
                                  dtype=dtype,
                                  critic=critic,
                                  value_hidden_sizes=tuple(policy_config.value_hidden_sizes))
  if policy_config.kind == 'token':
    return _token_policy(policy_config, action_dim, token_policy.StateTokenizer(policy_config.obs_token_size), critic)
  raise ValueError(f'--policy={policy_config.kind!r} is not valid; allowed values: {", ".join(POLICIES)}.')


def _make_pixel_network(p: PolicyConfig, action_dim: int, critic: str) -> nn.Module:
  """The pixel networks of `vision`: `mlp` -> `CNNActorCritic` (IMPALA features of width d_model beside the
  state, then the MLP heads); `transformer` -> `VisionTransformerActorCritic` and `token` -> `TokenPolicy` over a
  `PixelTokenizer` prefix (image tokens of `vision_encoder`, then state tokens)."""
  dtype = jnp.dtype(p.compute_dtype)
  channels = tuple(p.cnn_channels)
  if p.kind == 'mlp':
    return vision.CNNActorCritic(action_dim=action_dim,
                                 stage_channels=channels,
                                 feature_dim=p.d_model,
                                 policy_hidden_sizes=tuple(p.policy_hidden_sizes),
                                 value_hidden_sizes=tuple(p.value_hidden_sizes),
                                 dtype=dtype,
                                 num_blocks=p.cnn_blocks)
  if p.kind == 'transformer':
    return vision.VisionTransformerActorCritic(d_model=p.d_model,
                                               num_layers=p.num_layers,
                                               num_heads=p.num_heads,
                                               mlp_ratio=p.mlp_ratio,
                                               patch_size=p.patch_size,
                                               action_dim=action_dim,
                                               action_chunk=p.action_chunk,
                                               obs_token_size=p.obs_token_size,
                                               dtype=dtype,
                                               encoder=p.vision_encoder,
                                               stage_channels=channels,
                                               num_blocks=p.cnn_blocks,
                                               critic=critic,
                                               value_hidden_sizes=tuple(p.value_hidden_sizes))
  if p.kind == 'token':
    tokenizer = vision.PixelTokenizer(p.patch_size, p.d_model, p.obs_token_size, dtype, p.vision_encoder, channels,
                                      p.cnn_blocks)
    return _token_policy(p, action_dim, tokenizer, critic)
  raise ValueError(f'--policy={p.kind!r} is not valid; allowed values: {", ".join(POLICIES)}.')


def _token_policy(p: PolicyConfig, action_dim: int, tokenizer: nn.Module, critic: str = 'shared') -> nn.Module:
  """`token_policy.TokenPolicy` of `p`'s sizes over the observation tokens `tokenizer` makes, with `critic`'s value
  network (config_generation.critic_of)."""
  return token_policy.TokenPolicy(action_dim=action_dim,
                                  action_chunk=p.action_chunk,
                                  num_bins=p.num_bins,
                                  d_model=p.d_model,
                                  num_layers=p.num_layers,
                                  num_heads=p.num_heads,
                                  mlp_ratio=p.mlp_ratio,
                                  dtype=jnp.dtype(p.compute_dtype),
                                  tokenizer=tokenizer,
                                  critic=critic,
                                  value_hidden_sizes=tuple(p.value_hidden_sizes))
