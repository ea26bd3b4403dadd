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

Camera observations (an env made with `camera=`, `--obs=pixels` on `--backend=mjx_warp`): `reset` and every
`step` / `step_chunk` render the camera of every env on the GPU (`warp_render.WarpRenderer`, one render per call,
so a chunk of K actions adds one frame, as on native MuJoCo) and keep the stacks in `EnvGroupState.pixels`
[B, H, W, C * S] uint8, updated as `render.PixelRenderer` updates native MuJoCo's (`render.next_stacks`): a reset
fills a stack with the reset frame, an env an auto-reset restarted gets its reset frame likewise, an env that
was already frozen keeps its stack, every other env appends its new frame (oldest first). With `--randomize`
each env renders with its own model (`mjx_env.render_model`): its drawn colours (geom_rgba, read per env by the
renderer) and camera pose (cam_pos / cam_quat, through the kinematics into the data's cam_xpos / cam_xmat). The observation to act
on is then `observation(state)`, a `types.PixelObs`, and so is `StepResult.obs`.
"""
from __future__ import annotations

from typing import Any, Tuple

import chex
import flax
import jax
from jax import numpy as jnp

from ebrl_jax import types
from ebrl_jax.sim import render
from ebrl_jax.sim.mjx_env import (impl_for_backend, is_auto_reset, make_mjx_env, pixel_renderer, render_model,
                                  strong_types, where_envs)

__all__ = ['EnvGroupState', 'make_mjx_env', 'observation', 'reset', 'step', 'step_chunk']


@flax.struct.dataclass
class EnvGroupState:
  """brax_state: the wrapped Brax State (leaves [B, ...]); episode_return [B] float32 and episode_length [B]
  int32: running totals of the current episode (of the finished one for frozen envs); pixels: the stacked camera
  frames [B, H, W, C * S] uint8 of an env with a camera, else None."""
  brax_state: Any
  episode_return: jax.Array
  episode_length: jax.Array
  pixels: Any = None


def observation(state: EnvGroupState):
  """What the policy acts on: the state [B, O], or with a camera a `types.PixelObs` of the stacks beside it."""
  obs = state.brax_state.obs
  return obs if state.pixels is None else types.PixelObs(pixels=state.pixels, state=obs)


def _render(env, brax_state):
  """(brax_state with the render's token in its data, frames [B, H, W, C] uint8) of every env."""
  data, frames = pixel_renderer(env).frames(render_model(env, brax_state), brax_state.pipeline_state)
  return brax_state.replace(pipeline_state=data), frames


def _observe(env, state: EnvGroupState, result: types.StepResult, keep: jax.Array):
  """After a step or chunk of an env with a camera: the new frames into the stacks (`render.next_stacks`; `keep`
  [B]: envs frozen before it) and into result.obs. Without a camera, (state, result) as they are."""
  if state.pixels is None:
    return state, result
  brax_state, frames = _render(env, state.brax_state)
  refill = (result.done > 0) & is_auto_reset(env)
  pixels = render.next_stacks(state.pixels, frames, keep, refill, xp=jnp)
  state = state.replace(brax_state=brax_state, pixels=pixels)
  return state, result._replace(obs=observation(state))


def _frozen(env, state: EnvGroupState) -> jax.Array:
  """[B] envs that a step leaves as they are: finished ones without auto-reset."""
  frozen = state.brax_state.done > 0
  return jnp.zeros_like(frozen) if is_auto_reset(env) else frozen


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
  pixels = None
  if pixel_renderer(env) is not None:
    brax_state, frames = _render(env, brax_state)
    pixels = render.fill_stack(frames, pixel_renderer(env).camera.frame_stack, xp=jnp)
  return EnvGroupState(brax_state=brax_state,
                       episode_return=jnp.zeros(num_envs, jnp.float32),
                       episode_length=jnp.zeros(num_envs, jnp.int32),
                       pixels=pixels)


def step(env, state: EnvGroupState, actions: jax.Array) -> Tuple[EnvGroupState, types.StepResult]:
  """One env step of every env; actions [B, A]. Returns the new state and a StepResult of [B] arrays
  (obs [B, O] is already the reset observation where an episode ended and auto-reset is on)."""
  new_state, result = _physics_step(env, state, actions)
  return _observe(env, new_state, result, _frozen(env, state))


def _physics_step(env, state: EnvGroupState, actions: jax.Array) -> Tuple[EnvGroupState, types.StepResult]:
  """`step` without rendering: pixels are carried as they are, result.obs is the state [B, O]."""
  num_envs = state.episode_return.shape[0]
  chex.assert_rank(actions, 2)
  if tuple(actions.shape) != (num_envs, env.action_size):
    raise ValueError(f'actions {tuple(actions.shape)} must be [{num_envs}, {env.action_size}] (B envs, A actions).')
  frozen = _frozen(env, state)  # with auto-reset, done only marks the env the AutoResetWrapper has just restarted
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
  return EnvGroupState(brax_state, episode_return, episode_length, state.pixels), result


def step_chunk(env, state: EnvGroupState, actions: jax.Array) -> Tuple[EnvGroupState, types.StepResult]:
  """Up to K env steps per env with actions [B, K, A] (a lax.scan); each env stops at its first done.

  Returns obs after the chunk [B, O] (the reset obs for an env whose episode ended in it, with auto-reset; a
  `types.PixelObs` with a camera, rendered once after the chunk);
  reward [B] summed over the executed steps; done = any done; truncation, episode_return, episode_length of
  that finished episode (running totals elsewhere). With K=1 this is `step`.
  """
  chex.assert_rank(actions, 3)
  num_envs = state.episode_return.shape[0]
  if actions.shape[0] != num_envs or actions.shape[2] != env.action_size:
    raise ValueError(f'actions {tuple(actions.shape)} must be [{num_envs}, K, {env.action_size}] (B envs, a chunk '
                     'of K steps, A actions).')
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
    new_state, res = _physics_step(env, state, action)
    state = where_envs(stopped, state, new_state)
    live = ~stopped
    acc = types.StepResult(obs=state.brax_state.obs,
                           reward=acc.reward + jnp.where(live, res.reward, 0.0),
                           done=jnp.where(live, res.done, acc.done),
                           truncation=jnp.where(live, res.truncation, acc.truncation),
                           episode_return=jnp.where(live, res.episode_return, acc.episode_return),
                           episode_length=jnp.where(live, res.episode_length, acc.episode_length))
    return (state, stopped | (res.done > 0), acc), None

  (new_state, _, result), _ = jax.lax.scan(body, init, jnp.swapaxes(actions, 0, 1))
  return _observe(env, new_state, result, _frozen(env, state))
