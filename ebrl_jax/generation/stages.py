"""Generation stages: initialise policy parameters and act (sample actions, log-probs, values).

Pure functions; `network` (a flax module, hashable) is a static argument when jitted:

  act_fn = jax.jit(stages.act, static_argnums=(0,), static_argnames=('deterministic', 'min_std'))
  out = act_fn(network, params, obs, key)          # ActOutput, actions [B, K, A]

Observations are normalised inside `act`/`evaluate`/`value` with `params.normalizer` (identity when
`params.normalize_observations` is False); of a camera observation (`types.PixelObs`) only the state part is, the
pixels reach the network as uint8. Each then runs the network's `PolicyHead` (`head_of`, the one place
that tells network families apart): the Gaussian head for networks that emit `dist_params [B, K, 2A]`
(`policies.MLPActorCritic`, `policies.TransformerActorCritic`), or the head a network class carries itself
(`token_policy.TokenPolicy`: categorical action tokens). Axis names: B batch, O obs dim, K action chunk,
A action dim.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from ebrl_jax.generation import distribution
from ebrl_jax.generation import normalization
from ebrl_jax import types
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


class PolicyHead(NamedTuple):
  """How one family of networks is initialised, acts and is scored, on normalised observations:

    init(network, key, obs [1, O]) -> variables
    act(network, variables, obs [B, O], key, deterministic, min_std) -> ActOutput
    evaluate(network, variables, obs [B, O], raw_actions [B, K, A] float32, key, min_std) -> EvalOutput
    value(network, variables, obs [B, O]) -> values [B] float32

  `raw_actions` is whatever that head's `act` returned as `ActOutput.raw_actions` (pre-tanh samples for the
  Gaussian, token ids as float32 for the token policy); `min_std` and the entropy key are the Gaussian's.
  """
  init: Callable
  act: Callable
  evaluate: Callable
  value: Callable


def apply_network(network: nn.Module, params: PolicyParams, obs: Array) -> Tuple[Array, Array]:
  """Gaussian-head networks: obs [B, O] (raw) -> (dist_params [B, K, 2A] float32, values [B] float32),
  normalising first."""
  dist_params, values = network.apply(params.network, _normalize(params, obs))
  return dist_params.astype(jnp.float32), values.astype(jnp.float32)


def _gaussian_init(network, key, obs):
  return network.init(key, obs)


def _gaussian_act(network, variables, obs, key, deterministic, min_std):
  dist_params, values = network.apply(variables, obs)
  loc, scale = distribution.split_params(dist_params.astype(jnp.float32), min_std)
  raw = loc if deterministic else distribution.sample_raw(loc, scale, key)
  log_probs = jnp.sum(distribution.log_prob(loc, scale, raw), axis=-1)
  chex.assert_equal_shape([loc, raw])
  return ActOutput(actions=distribution.postprocess(raw),
                   raw_actions=raw,
                   log_probs=log_probs,
                   values=values.astype(jnp.float32))


def _gaussian_evaluate(network, variables, obs, raw_actions, key, min_std):
  dist_params, values = network.apply(variables, obs)
  loc, scale = distribution.split_params(dist_params.astype(jnp.float32), min_std)
  chex.assert_equal_shape([loc, raw_actions])
  log_probs = jnp.sum(distribution.log_prob(loc, scale, raw_actions), axis=-1)
  entropy = jnp.sum(distribution.entropy(loc, scale, key), axis=-1)
  return EvalOutput(log_probs=log_probs, entropy=entropy, values=values.astype(jnp.float32))


def _gaussian_value(network, variables, obs):
  return network.apply(variables, obs)[1].astype(jnp.float32)


GAUSSIAN_HEAD = PolicyHead(init=_gaussian_init, act=_gaussian_act, evaluate=_gaussian_evaluate, value=_gaussian_value)


def head_of(network: nn.Module) -> PolicyHead:
  """The network's head, keyed on its class: a class may carry its own `policy_head` (a `PolicyHead`;
  `token_policy.TokenPolicy` does), every other network uses `GAUSSIAN_HEAD`.

  NOTE: the head rides on the class rather than in a table here because a policy family builds on this module
  (token_policy imports it for `PolicyHead` and `EvalOutput`); this module imports no network family.
  """
  head = getattr(type(network), 'policy_head', GAUSSIAN_HEAD)
  if not isinstance(head, PolicyHead):
    raise TypeError(f'{type(network).__name__}.policy_head must be a stages.PolicyHead; got {type(head).__name__}.')
  return head


def _normalize(params: PolicyParams, obs):
  """The state [B, O] (a `PixelObs`'s state part) normalised; pixels pass unchanged."""
  state = types.proprioception(obs)
  chex.assert_rank(state, 2)
  if state.shape[-1] != params.normalizer.mean.shape[-1]:  # the statistics would broadcast a [B, 1] silently
    raise ValueError(f'obs has {state.shape[-1]} features (shape {tuple(state.shape)}); these params were '
                     f'initialised for {params.normalizer.mean.shape[-1]} (init_train_state\'s obs_dim).')
  if not params.normalize_observations:
    return obs
  return types.with_state(obs, normalization.normalize(params.normalizer, state))


def _rows(obs) -> int:
  return types.proprioception(obs).shape[0]


def normalizes_observations(network: nn.Module, normalize_observations: Optional[bool] = None) -> bool:
  """Whether params initialised for `network` normalise observations: `normalize_observations` where given, else
  the network's own (`policies.make_network` records its `PolicyConfig`'s, `layers.PolicyNetwork`), else True.
  ValueError where both are given and differ: the config is never overruled without a word."""
  recorded = getattr(network, 'normalize_observations', None)
  if normalize_observations is None:
    return True if recorded is None else bool(recorded)
  if recorded is not None and bool(recorded) != bool(normalize_observations):
    raise ValueError(f'normalize_observations={bool(normalize_observations)} contradicts the network\'s '
                     f'PolicyConfig(normalize_observations={bool(recorded)}) (recorded by make_network): pass the '
                     'same value, or leave the argument out to take the config\'s.')
  return bool(normalize_observations)


def init_policy_params(
    network: nn.Module,
    key: PRNGKey,
    obs_dim: int,
    normalize_observations: Optional[bool] = None,
    pixel_shape: Tuple[int, ...] = ()) -> PolicyParams:
  """Initialises network variables (from a dummy `[1, O]` observation, or a `PixelObs` with `pixel_shape`
  [H, W, C] pixels beside it) and empty observation statistics (of the state). `normalize_observations`: see
  `normalizes_observations` (None: the network's PolicyConfig's)."""
  normalize_observations = normalizes_observations(network, normalize_observations)
  # One compiled init instead of op-by-op dispatch (seconds for a tiny MLP on CPU); nests fine under jit.
  init = jax.jit(functools.partial(head_of(network).init, network))
  dummy = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), types.obs_template((1,), obs_dim, pixel_shape))
  return PolicyParams(normalizer=normalization.init_stats(obs_dim),
                      network=init(key, dummy),
                      normalize_observations=normalize_observations)


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
    obs: [B, O] raw observations (or a `types.PixelObs` of pixels [B, H, W, C] uint8 and state [B, O]).
    key: PRNG key for sampling.
    deterministic: take the mode (Gaussian: raw = loc; tokens: argmax) instead of sampling (static).
    min_std: floor added to softplus(raw scale) (static; Gaussian heads only).
  Returns:
    ActOutput: actions [B, K, A] in [-1, 1], raw_actions [B, K, A] float32 (Gaussian: pre-tanh samples,
    actions = tanh(raw); token policy: the bin ids, actions their bin centres), log_probs [B] (sum over K and
    A; the Gaussian's with the tanh Jacobian), values [B].
  """
  out = head_of(network).act(network, params.network, _normalize(params, obs), key, deterministic, min_std)
  chex.assert_shape([out.log_probs, out.values], (_rows(obs),))
  chex.assert_equal_shape([out.actions, out.raw_actions])
  chex.assert_type([out.actions, out.raw_actions, out.log_probs, out.values], jnp.float32)
  return out


def evaluate(network: nn.Module,
             params: PolicyParams,
             obs: Array,
             raw_actions: Array,
             key: PRNGKey,
             min_std: float = 0.001) -> EvalOutput:
  """Scores stored raw actions under `params`: obs [B, O], raw_actions [B, K, A] (what `act` returned) ->
  EvalOutput(log_probs [B], entropy [B], values [B]). The Gaussian's entropy is a one-sample estimate (`key`),
  the token policy's the exact per-token entropies along the stored tokens; both summed over K and A."""
  out = head_of(network).evaluate(network, params.network, _normalize(params, obs), raw_actions, key, min_std)
  chex.assert_shape([out.log_probs, out.entropy, out.values], (_rows(obs),))
  return out


def value(network: nn.Module, params: PolicyParams, obs: Array) -> Array:
  """Critic only: obs [B, O] (raw) -> values [B] float32 (the bootstrap value; the token policy skips the action
  tokens)."""
  values = head_of(network).value(network, params.network, _normalize(params, obs))
  chex.assert_shape(values, (_rows(obs),))
  return values


def _act_at(network, min_std, deterministic, params, obs, key, index):
  """`act` with the step key folded in on the device, so a host loop does no key arithmetic per step."""
  return act(network, params, obs, jax.random.fold_in(key, index), deterministic=deterministic, min_std=min_std)


def make_act(network: nn.Module, min_std: float, deterministic: bool = False):
  """A jitted `act(params, obs [B, O], key, index) -> ActOutput` with the index folded into the key (what a
  host loop around native MuJoCo and the generation worker call once per policy step)."""
  return jax.jit(functools.partial(_act_at, network, min_std, deterministic))


def _act_per_request(network, min_std, slice_envs, params, obs, keys):
  """`act` on R requests at once, each with its own key: obs [R * B_s, O], keys [R, 2] -> ActOutput [R * B_s, ...].
  Request r's rows draw exactly what `act(network, params, obs_r, keys[r])` draws (a co-located MJX step)."""
  r = keys.shape[0]
  obs = obs.reshape((r, slice_envs) + obs.shape[1:])
  out = jax.vmap(lambda o, k: act(network, params, o, k, min_std=min_std))(obs, keys)
  return jax.tree.map(lambda x: x.reshape((r * slice_envs,) + x.shape[2:]), out)


def make_act_per_request(network: nn.Module, min_std: float, slice_envs: int):
  """A jitted `act(params, obs [R * B_s, O], keys [R, 2]) -> ActOutput`: what the generation worker calls for MJX
  groups, whose requests carry their step's key."""
  return jax.jit(functools.partial(_act_per_request, network, min_std, slice_envs))
