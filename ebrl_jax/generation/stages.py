"""Generation stages: initialise policy parameters and act (sample actions, log-probs, values).

Pure functions; `network` (a flax module, hashable) is a static argument when jitted:

  act_fn = jax.jit(stages.act, static_argnums=(0,), static_argnames=('deterministic', 'min_std'))
  out = act_fn(network, params, obs, key)          # ActOutput, actions [B, K, A]

Observations are normalised inside `act`/`evaluate` with `params.normalizer` (identity when
`params.normalize_observations` is False). Axis names: B batch, O obs dim, K action chunk, A action dim.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from ebrl_jax.generation import distribution
from ebrl_jax.generation import normalization
from ebrl_jax.types import ActOutput, Array, Params, PRNGKey


@struct.dataclass
class PolicyParams:
  """Everything `act` needs: observation statistics and network variables.

  NOTE: `normalize_observations` is static (not a leaf): toggling it changes the pytree structure, so it is
  part of a jitted function's cache key and never travels as data.
  """
  normalizer: normalization.RunningStats
  network: Params
  normalize_observations: bool = struct.field(pytree_node=False, default=True)


class EvalOutput(NamedTuple):
  """What `evaluate` returns: log_probs, entropy, values, each [B]."""
  log_probs: Array
  entropy: Array
  values: Array


def init_policy_params(network: nn.Module,
                       key: PRNGKey,
                       obs_dim: int,
                       normalize_observations: bool = True) -> PolicyParams:
  """Initialises network variables (from a dummy `[1, O]` observation) and empty observation statistics."""
  # One compiled init instead of op-by-op dispatch (seconds for a tiny MLP on CPU); nests fine under jit.
  variables = jax.jit(network.init)(key, jnp.zeros((1, obs_dim), jnp.float32))
  return PolicyParams(normalizer=normalization.init_stats(obs_dim),
                      network=variables,
                      normalize_observations=normalize_observations)


def apply_network(network: nn.Module, params: PolicyParams, obs: Array) -> Tuple[Array, Array]:
  """obs [B, O] (raw) -> (dist_params [B, K, 2A] float32, values [B] float32), normalising first."""
  chex.assert_rank(obs, 2)
  if params.normalize_observations:
    obs = normalization.normalize(params.normalizer, obs)
  dist_params, values = network.apply(params.network, obs)
  return dist_params.astype(jnp.float32), values.astype(jnp.float32)


def act(network: nn.Module,
        params: PolicyParams,
        obs: Array,
        key: PRNGKey,
        deterministic: bool = False,
        min_std: float = 0.001) -> ActOutput:
  """Samples an action chunk for each observation.

  Args:
    network: the actor-critic module (static).
    params: policy parameters.
    obs: [B, O] raw observations.
    key: PRNG key for sampling.
    deterministic: take the mode (raw = loc) instead of sampling (static).
    min_std: floor added to softplus(raw scale) (static).
  Returns:
    ActOutput: actions [B, K, A] = tanh(raw_actions), raw_actions [B, K, A], log_probs [B] (sum over K and A,
    tanh Jacobian included), values [B].
  """
  dist_params, values = apply_network(network, params, obs)
  loc, scale = distribution.split_params(dist_params, min_std)
  raw = loc if deterministic else distribution.sample_raw(loc, scale, key)
  log_probs = jnp.sum(distribution.log_prob(loc, scale, raw), axis=-1)
  chex.assert_equal_shape([loc, raw])
  chex.assert_shape([log_probs, values], (obs.shape[0],))
  return ActOutput(actions=distribution.postprocess(raw), raw_actions=raw, log_probs=log_probs, values=values)


def evaluate(network: nn.Module,
             params: PolicyParams,
             obs: Array,
             raw_actions: Array,
             key: PRNGKey,
             min_std: float = 0.001) -> EvalOutput:
  """Scores stored raw actions under `params`: obs [B, O], raw_actions [B, K, A] ->
  EvalOutput(log_probs [B], entropy [B] (one-sample estimate, summed over K and A), values [B])."""
  dist_params, values = apply_network(network, params, obs)
  loc, scale = distribution.split_params(dist_params, min_std)
  chex.assert_equal_shape([loc, raw_actions])
  log_probs = jnp.sum(distribution.log_prob(loc, scale, raw_actions), axis=-1)
  entropy = jnp.sum(distribution.entropy(loc, scale, key), axis=-1)
  return EvalOutput(log_probs=log_probs, entropy=entropy, values=values)


def _act_at(network, min_std, deterministic, params, obs, key, index):
  """`act` with the step key folded in on the device, so a host loop does no key arithmetic per step."""
  return act(network, params, obs, jax.random.fold_in(key, index), deterministic=deterministic, min_std=min_std)


def make_act(network: nn.Module, min_std: float, deterministic: bool = False):
  """A jitted `act(params, obs [B, O], key, index) -> ActOutput` with the index folded into the key (what a
  host loop around native MuJoCo and the generation worker call once per policy step)."""
  return jax.jit(functools.partial(_act_at, network, min_std, deterministic))
