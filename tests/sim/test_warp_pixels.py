"""--obs=pixels on --backend=mjx_warp: camera frames rendered by MJX's GPU renderer inside the simulation stage.

On a CPU machine (CI) the pure frame-stack update, the config checks, the observation spec and the refusals are
tested; the rendering itself needs warp-lang and a CUDA GPU (or EBRL_WARP_ALLOW_CPU=1: Warp's CPU kernels render
too, slowly) and is skipped otherwise. experiments/warp_pixels_check.py measures it on the GPU against native
MuJoCo's renderer.
"""
import importlib.util
import os

import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.rollout import mjx as mjx_rollout
from ebrl_jax.sim import manipulation
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import registry
from ebrl_jax.sim import render
from ebrl_jax.sim import stages


def _has_cuda():
  try:
    return bool(jax.devices('cuda'))
  except RuntimeError:
    return False


CAN_RENDER = importlib.util.find_spec('warp') is not None and (_has_cuda() or
                                                               os.environ.get('EBRL_WARP_ALLOW_CPU') == '1')
needs_warp_device = pytest.mark.skipif(not CAN_RENDER,
                                       reason='MJX-Warp rendering needs warp-lang and a CUDA GPU (or '
                                       "EBRL_WARP_ALLOW_CPU=1 for Warp's CPU kernels)")


def _native_update(stack, frame, stepped, restarted):
  """What PixelRenderer does to the stacks after a pool step: push for the envs stepped and not restarted by an
  auto-reset (by index), refill those restarted (their reset frame)."""
  stack = stack.copy()
  push = np.flatnonzero(stepped & ~restarted)
  stack[push] = render.stack_frames(stack[push], frame[push])
  fill = np.flatnonzero(restarted)
  stack[fill] = render.fill_stack(frame[fill], stack.shape[-1] // frame.shape[-1])
  return stack


def test_next_stacks_hand_case():
  # 3 envs, one pixel, 1 channel, 3 frames: env 0 appends, env 1 is refilled, env 2 (frozen) keeps its stack.
  stack = jnp.asarray(np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.uint8).reshape(3, 1, 1, 3))
  frame = jnp.asarray(np.array([10, 11, 12], np.uint8).reshape(3, 1, 1, 1))
  out = jax.jit(lambda *a: render.next_stacks(*a, xp=jnp))(stack, frame, jnp.array([False, False, True]),
                                                           jnp.array([False, True, False]))
  assert out.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(out).reshape(3, 3), [[2, 3, 10], [11, 11, 11], [7, 8, 9]])


@pytest.mark.parametrize('seed', [0, 1])
def test_next_stacks_matches_the_native_renderers_update(seed):
  rng = np.random.default_rng(seed)
  n, c, s = 16, 3, 4
  stack = rng.integers(0, 256, (n, 5, 4, c * s), dtype=np.uint8)
  frame = rng.integers(0, 256, (n, 5, 4, c), dtype=np.uint8)
  frozen = rng.random(n) < 0.3  # finished before the step (auto_reset=False): not stepped
  restarted = ~frozen & (rng.random(n) < 0.3)
  want = _native_update(stack, frame, ~frozen, restarted)
  got = jax.jit(lambda *a: render.next_stacks(*a, xp=jnp))(stack, frame, frozen, restarted)
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(render.next_stacks(stack, frame, frozen, restarted), want)  # numpy twin


def test_pixels_are_allowed_on_mjx_warp_and_refused_on_mjx_with_the_reason():
  sim = config_lib.SimConfig(task='push_cube', backend='mjx_warp', obs='pixels', image_size=32, frame_stack=2)
  assert config_lib.pixel_shape(sim) == (32, 32, 6)
  spec = registry.env_spec('push_cube', 250, 1, config_lib.pixel_shape(sim))
  assert spec.pixel_shape == (32, 32, 6)
  template = types.obs_template((4,), spec.obs_dim, spec.pixel_shape)
  assert template.pixels.shape == (4, 32, 32, 6) and template.pixels.dtype == jnp.uint8
  with pytest.raises(ValueError, match=r'--backend=mjx: .*takes MuJoCo Warp data only.*--backend=mjx_warp'):
    config_lib.SimConfig(task='push_cube', backend='mjx', obs='pixels')
  camera = render.CameraObs(height=32, width=32)
  with pytest.raises(ValueError, match=r'--backend=mjx: .*NotImplementedError for the JAX implementation'):
    mjx_env.make_mjx_env('push_cube', 10, 1, True, impl='jax', camera=camera)
  with pytest.raises(ValueError, match=r'--obs=pixels is not wired for --task=playground:CartpoleBalance'):
    mjx_env.make_mjx_env('playground:CartpoleBalance', 10, 1, True, impl='warp', camera=camera)


def test_state_observations_carry_no_pixels():
  state = stages.EnvGroupState(brax_state=None, episode_return=jnp.zeros(2), episode_length=jnp.zeros(2, jnp.int32))
  assert state.pixels is None and jax.tree_util.tree_leaves(state) == jax.tree_util.tree_leaves(
      (state.episode_return, state.episode_length))


@needs_warp_device
@pytest.mark.parametrize('auto_reset', [True, False])
def test_warp_frames_stack_through_reset_chunks_and_episode_ends(auto_reset):
  camera = render.CameraObs(height=16, width=16, frame_stack=3)
  env = mjx_env.make_mjx_env('push_cube', 4, 1, auto_reset, impl='warp', camera=camera)
  state = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(0), 4, 2)
  first = np.asarray(state.pixels)
  assert first.shape == (4, 16, 16, 9) and first.dtype == np.uint8 and first.any()
  np.testing.assert_array_equal(first, np.concatenate([first[..., :3]] * 3, axis=-1))  # filled with the reset frame
  np.testing.assert_array_equal(first[0], first[1])  # a GRPO group shares its start, and its frame
  assert (first[0] != first[2]).any()
  obs = stages.observation(state)
  assert isinstance(obs, types.PixelObs) and obs.state.shape == (4, registry.env_spec('push_cube', 4, 1).obs_dim)

  chunk = jax.jit(stages.step_chunk, static_argnums=0)
  actions = jnp.tile(jnp.array([1.0, -1.0, 1.0]), (4, 2, 1))
  state, result = chunk(env, state, actions)  # env steps 1-2: one new frame per chunk
  second = np.asarray(state.pixels)
  assert isinstance(result.obs, types.PixelObs)
  np.testing.assert_array_equal(np.asarray(result.obs.pixels), second)
  np.testing.assert_array_equal(second[..., :6], first[..., 3:])
  assert (second[..., 6:] != first[..., 6:]).any()  # the arm moved
  state, result = chunk(env, state, actions)  # steps 3-4: every episode ends
  assert np.asarray(result.done).all()
  third = np.asarray(state.pixels)
  if auto_reset:  # restarted from their reset state: the stack is the reset frame again
    np.testing.assert_array_equal(third, first)
  else:  # the final frame appended; then frozen envs keep their stacks
    np.testing.assert_array_equal(third[..., :6], second[..., 3:])
    state, _ = chunk(env, state, actions)
    np.testing.assert_array_equal(np.asarray(state.pixels), third)
  regrouped = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(1), 4, 4)
  again = np.asarray(regrouped.pixels)  # a group reset refreshes every stack
  np.testing.assert_array_equal(again, np.concatenate([again[..., :3]] * 3, axis=-1))
  assert (again[..., :3] != first[..., :3]).any() and (again[0] == again[3]).all()


def test_mjx_rollouts_build_their_env_with_the_flags_camera(monkeypatch):
  calls = []
  monkeypatch.setattr(stages, 'make_mjx_env', lambda *args, **kwargs: calls.append((args, kwargs)))
  sim = config_lib.SimConfig(task='push_cube', backend='mjx_warp', obs='pixels', image_size=32, frame_stack=2)
  mjx_rollout.make_env(sim, auto_reset=False)
  mjx_rollout.make_env(config_lib.SimConfig(task='push_cube', backend='mjx_warp'), auto_reset=True)
  (args, pixels), (_, state) = calls
  assert args == ('push_cube', sim.episode_length, sim.action_repeat)
  assert pixels['camera'] == render.CameraObs(camera='fixed', height=32, width=32, frame_stack=2)
  assert pixels['impl'] == 'warp' and not pixels['auto_reset'] and state['camera'] is None and state['auto_reset']


@needs_warp_device
def test_warp_proprio_state_is_the_full_states_arm_prefix():
  """--pixel_state=proprio on MJX-Warp: the state beside the frames is the first PROPRIO_DIM values of the full
  observation of the same envs (same keys, same actions), through reset, a chunk and an auto-reset; the frames
  are the same."""
  full_env, proprio_env = (mjx_env.make_mjx_env('push_cube',
                                                3,
                                                1,
                                                True,
                                                impl='warp',
                                                camera=render.CameraObs(height=16, width=16, state=state))
                           for state in ('full', 'proprio'))
  reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
  chunk = jax.jit(stages.step_chunk, static_argnums=0)
  full, proprio = reset(full_env, jax.random.PRNGKey(0), 4, 1), reset(proprio_env, jax.random.PRNGKey(0), 4, 1)
  actions = jnp.tile(jnp.array([1.0, -1.0, 1.0]), (4, 2, 1))
  for _ in range(3):  # env steps 2, 4 (the 3-step episodes end and auto-reset), 6
    want, got = stages.observation(full), stages.observation(proprio)
    assert got.state.shape == (4, manipulation.PROPRIO_DIM)
    np.testing.assert_array_equal(np.asarray(got.state), np.asarray(want.state)[:, :manipulation.PROPRIO_DIM])
    np.testing.assert_array_equal(np.asarray(got.pixels), np.asarray(want.pixels))
    (full, _), (proprio, _) = chunk(full_env, full, actions), chunk(proprio_env, proprio, actions)
