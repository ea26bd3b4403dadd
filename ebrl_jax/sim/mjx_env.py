"""Brax environments on the MJX backend, wrapped for training.

`make_mjx_env` returns Brax's own env (`brax.envs.get_environment(brax_name, backend='mjx')`) wrapped with
Brax's training wrappers: VmapWrapper -> EpisodeWrapper(episode_length, action_repeat) -> AutoResetWrapper.
With auto_reset=False the last wrapper is `FreezeWhenDoneWrapper` instead (GRPO rolls whole episodes).

NOTE: Brax's AutoResetWrapper restarts a finished env from the initial state that env got at `reset`
(`info['first_pipeline_state']`), not from a fresh random one; the native-MuJoCo pool draws a fresh state.
Call `stages.reset` again to redraw.

The env is a plain Python object hashed by identity; `make_mjx_env` is memoised so equal arguments give the
same object, which makes it usable as a `jax.jit` static argument without recompiling.
"""
from __future__ import annotations

import functools

import jax
from jax import numpy as jnp

from brax import envs as brax_envs
from brax.envs import base as brax_base
from brax.envs.wrappers import training as brax_training

from ebrl_jax.sim import registry


def _where_batch(mask: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """jnp.where with a [B] mask broadcast over the trailing axes of x, y [B, ...]."""
  return jnp.where(jnp.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim)), x, y)


def where_envs(mask: jax.Array, x, y):
  """Per-env select between two pytrees whose leaves all have a leading batch axis [B, ...]."""
  return jax.tree.map(functools.partial(_where_batch, mask), x, y)


def strong_types(tree):
  """Drops weak types, so that states from `reset` and `step` share one jit signature (else step compiles
  twice: Brax's wrappers return weakly typed done/truncation after a step but not after a reset)."""
  return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype), tree)


class FreezeWhenDoneWrapper(brax_base.Wrapper):
  """Keeps a finished env as it is: no physics, reward 0, done 1; info (truncation, steps) is kept too."""

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    finished = state.done > 0
    nstate = self.env.step(state, action)
    frozen = state.replace(reward=jnp.zeros_like(nstate.reward))
    return where_envs(finished, frozen, nstate)


@functools.lru_cache(maxsize=None)
def make_mjx_env(task: str, episode_length: int, action_repeat: int = 1, auto_reset: bool = True) -> brax_base.Wrapper:
  """The wrapped batch env: `reset(keys [B, 2])`, `step(state, actions [B, A])` (Brax's API)."""
  task_def = registry.load(task)
  if episode_length <= 0 or action_repeat <= 0:
    raise ValueError(f'episode_length={episode_length} and action_repeat={action_repeat} must be > 0.')
  env = brax_envs.get_environment(task_def.brax_name, backend='mjx')
  env = brax_training.VmapWrapper(env)
  env = brax_training.EpisodeWrapper(env, episode_length, action_repeat)
  if auto_reset:
    return brax_training.AutoResetWrapper(env)
  return FreezeWhenDoneWrapper(env)


def is_auto_reset(env: brax_base.Env) -> bool:
  return isinstance(env, brax_training.AutoResetWrapper)
