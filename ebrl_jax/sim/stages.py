"""Pure, jit-able simulation stages on the MJX backend (Brax's envs with backend='mjx').

    env = stages.make_mjx_env('hopper', episode_length=1000, action_repeat=1)
    reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
    step = jax.jit(stages.step, static_argnums=0)
    state = reset(env, key, 64, 1)
    state, result = step(env, state, actions)          # actions [B, A]

The env is a static argument (memoised by `make_mjx_env`, hashed by identity). Episode semantics match
`ebrl_jax.sim.cpu_env.CpuEnvPool` (see its module docstring): done/truncation follow Brax's EpisodeWrapper
(`info['truncation']`), a chunk stops each env at its first done, and with auto_reset=False a finished env is
frozen (final obs, reward 0, done 1, its episode's truncation and totals) until the next `reset`.
episode_length counts Brax env steps (it advances by action_repeat per step), like Brax's episode metrics.
"""
from __future__ import annotations

from typing import Any, Tuple

import chex
import flax
import jax
from jax import numpy as jnp

from ebrl_jax import types
from ebrl_jax.sim.mjx_env import impl_for_backend, is_auto_reset, make_mjx_env, strong_types, where_envs

__all__ = ['EnvGroupState', 'make_mjx_env', 'reset', 'step', 'step_chunk']


@flax.struct.dataclass
class EnvGroupState:
  """brax_state: the wrapped Brax State (leaves [B, ...]); episode_return [B] float32 and episode_length [B]
  int32: running totals of the current episode (of the finished one for frozen envs)."""
  brax_state: Any
  episode_return: jax.Array
  episode_length: jax.Array


def reset(env, key: types.PRNGKey, num_envs: int, group_size: int = 1) -> EnvGroupState:
  """Starts `num_envs` episodes; envs [g * group_size, (g + 1) * group_size) share one reset key and hence
  their initial state. key: a raw uint32 [2] or typed PRNG key."""
  if num_envs <= 0 or group_size <= 0 or num_envs % group_size:
    raise ValueError(f'num_envs={num_envs} must be a positive multiple of group_size={group_size}.')
  keys = jax.random.split(key, num_envs // group_size)
  if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.key_data(keys)  # Brax's wrappers expect raw [B, 2] keys
  keys = jnp.repeat(keys, group_size, axis=0)
  brax_state = strong_types(env.reset(keys))
  return EnvGroupState(brax_state=brax_state,
                       episode_return=jnp.zeros(num_envs, jnp.float32),
                       episode_length=jnp.zeros(num_envs, jnp.int32))


def step(env, state: EnvGroupState, actions: jax.Array) -> Tuple[EnvGroupState, types.StepResult]:
  """One env step of every env; actions [B, A]. Returns the new state and a StepResult of [B] arrays
  (obs [B, O] is already the reset observation where an episode ended and auto-reset is on)."""
  num_envs = state.episode_return.shape[0]
  chex.assert_rank(actions, 2)
  chex.assert_axis_dimension(actions, 0, num_envs)
  frozen = state.brax_state.done > 0
  if is_auto_reset(env):
    frozen = jnp.zeros_like(frozen)  # done only marks the env the AutoResetWrapper has just restarted
  brax_state = strong_types(env.step(state.brax_state, actions))
  reward = brax_state.reward.astype(jnp.float32)
  done = brax_state.done.astype(jnp.float32)
  episode_return = state.episode_return + reward
  episode_length = state.episode_length + jnp.where(frozen, 0, env.action_repeat).astype(jnp.int32)
  result = types.StepResult(obs=brax_state.obs,
                            reward=reward,
                            done=done,
                            truncation=brax_state.info['truncation'].astype(jnp.float32),
                            episode_return=episode_return,
                            episode_length=episode_length)
  if is_auto_reset(env):
    episode_return = jnp.where(done > 0, 0.0, episode_return)
    episode_length = jnp.where(done > 0, 0, episode_length)
  return EnvGroupState(brax_state, episode_return, episode_length), result


def step_chunk(env, state: EnvGroupState, actions: jax.Array) -> Tuple[EnvGroupState, types.StepResult]:
  """Up to K env steps per env with actions [B, K, A] (a lax.scan); each env stops at its first done.

  Returns obs after the chunk [B, O] (the reset obs for an env whose episode ended in it, with auto-reset);
  reward [B] summed over the executed steps; done = any done; truncation, episode_return, episode_length of
  that finished episode (running totals elsewhere). With K=1 this is `step`.
  """
  chex.assert_rank(actions, 3)
  num_envs = state.episode_return.shape[0]
  zeros = jnp.zeros(num_envs, jnp.float32)
  init = (state, jnp.zeros(num_envs, bool),
          types.StepResult(obs=state.brax_state.obs,
                           reward=zeros,
                           done=zeros,
                           truncation=zeros,
                           episode_return=state.episode_return,
                           episode_length=state.episode_length))

  def body(carry, action):
    state, stopped, acc = carry
    new_state, res = step(env, state, action)
    state = where_envs(stopped, state, new_state)
    live = ~stopped
    acc = types.StepResult(obs=state.brax_state.obs,
                           reward=acc.reward + jnp.where(live, res.reward, 0.0),
                           done=jnp.where(live, res.done, acc.done),
                           truncation=jnp.where(live, res.truncation, acc.truncation),
                           episode_return=jnp.where(live, res.episode_return, acc.episode_return),
                           episode_length=jnp.where(live, res.episode_length, acc.episode_length))
    return (state, stopped | (res.done > 0), acc), None

  (state, _, result), _ = jax.lax.scan(body, init, jnp.swapaxes(actions, 0, 1))
  return state, result
