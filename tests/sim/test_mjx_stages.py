"""MJX stages on inverted_pendulum (the cheapest model to compile): groups, bookkeeping, chunks.

Every test uses the same env and batch shape, so each stage compiles once for the module.
"""
import dataclasses

import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.sim import stages

NUM_ENVS, GROUP_SIZE, EPISODE_LENGTH = 4, 2, 5
ENV = stages.make_mjx_env('inverted_pendulum', EPISODE_LENGTH, 1)
_reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
_step = jax.jit(stages.step, static_argnums=0)
_chunk = jax.jit(stages.step_chunk, static_argnums=0)


def _initial(seed=0):
  return _reset(ENV, jax.random.PRNGKey(seed), NUM_ENVS, GROUP_SIZE)


def test_make_mjx_env_is_memoised():
  assert stages.make_mjx_env('inverted_pendulum', EPISODE_LENGTH, 1) is ENV
  assert hash(ENV) == hash(stages.make_mjx_env('inverted_pendulum', EPISODE_LENGTH, 1))


def test_training_and_evaluation_envs_share_one_loaded_model():
  frozen = stages.make_mjx_env('inverted_pendulum', EPISODE_LENGTH, 1, auto_reset=False)
  assert frozen is not ENV and frozen.unwrapped is ENV.unwrapped  # the model loaded once, wrapped twice
  capped = stages.make_mjx_env('inverted_pendulum', EPISODE_LENGTH, 1, solver=(2, 4))
  assert capped.unwrapped is not ENV.unwrapped and int(capped.unwrapped.sys.opt.iterations) == 2
  randomized = stages.make_mjx_env('inverted_pendulum',
                                   EPISODE_LENGTH,
                                   1,
                                   randomization=config_lib.RandomizationConfig(mass=(0.5, 2.0)))
  assert randomized.unwrapped is not ENV.unwrapped  # a randomised env swaps its model while tracing: its own


def test_groups_share_the_initial_state_and_groups_differ():
  q = np.asarray(_initial().brax_state.pipeline_state.q)
  np.testing.assert_array_equal(q[0], q[1])
  np.testing.assert_array_equal(q[2], q[3])
  assert not np.allclose(q[0], q[2])


def test_time_limit_truncates_reports_totals_and_auto_resets():
  # Zero force: the pole needs ~13 steps to pass 0.2 rad (see test_cpu_env), so the 5-step limit ends it.
  state = _initial()
  first_obs = np.asarray(state.brax_state.obs)
  total = np.zeros(NUM_ENVS)
  for t in range(EPISODE_LENGTH):
    state, res = _step(ENV, state, jnp.zeros((NUM_ENVS, 1)))
    assert isinstance(res, types.StepResult)
    total += np.asarray(res.reward)
    assert np.all(np.asarray(res.done) == (t == EPISODE_LENGTH - 1))
  np.testing.assert_array_equal(res.truncation, np.ones(NUM_ENVS))
  np.testing.assert_allclose(res.episode_return, total)  # 5 x reward 1.0
  np.testing.assert_array_equal(res.episode_length, np.full(NUM_ENVS, EPISODE_LENGTH))
  # Brax's AutoResetWrapper restarts from the env's first initial state.
  np.testing.assert_array_equal(np.asarray(res.obs), first_obs)
  state, res = _step(ENV, state, jnp.zeros((NUM_ENVS, 1)))
  assert not np.asarray(res.done).any()
  np.testing.assert_array_equal(res.episode_length, np.ones(NUM_ENVS))


def test_chunk_of_one_equals_step():
  actions = jax.random.uniform(jax.random.PRNGKey(1), (NUM_ENVS, 1), minval=-0.3, maxval=0.3)
  state_a, res_a = _step(ENV, _initial(), actions)
  state_b, res_b = _chunk(ENV, _initial(), actions[:, None])
  for x, y in zip(res_a, res_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(np.asarray(state_a.brax_state.pipeline_state.qpos),
                                np.asarray(state_b.brax_state.pipeline_state.qpos))


def test_chunk_stops_each_env_at_its_first_done():
  state = _initial()
  first_obs = np.asarray(state.brax_state.obs)
  state, res = _chunk(ENV, state, jnp.zeros((NUM_ENVS, 3, 1)))  # steps 1-3
  np.testing.assert_allclose(res.reward, np.full(NUM_ENVS, 3.0))
  assert not np.asarray(res.done).any()
  state, res = _chunk(ENV, state, jnp.zeros((NUM_ENVS, 3, 1)))  # steps 4, 5 (time limit); 3rd not run
  np.testing.assert_allclose(res.reward, np.full(NUM_ENVS, 2.0))
  np.testing.assert_array_equal(res.done, np.ones(NUM_ENVS))
  np.testing.assert_array_equal(res.truncation, np.ones(NUM_ENVS))
  np.testing.assert_allclose(res.episode_return, np.full(NUM_ENVS, 5.0))
  np.testing.assert_array_equal(res.episode_length, np.full(NUM_ENVS, 5))
  np.testing.assert_array_equal(np.asarray(res.obs), first_obs)  # at the reset state, not run on
  np.testing.assert_array_equal(state.episode_length, np.zeros(NUM_ENVS))


def test_an_env_whose_simulation_blows_up_ends_its_episode_as_a_failure_and_resets():
  # NaN velocities in env 0 (MJX carries them on from step to step; native MuJoCo's step resets such data, and its
  # pool ends the episode the same way, test_cpu_env): its episode ends as a failure, reward 0, and it starts
  # afresh from its first initial state; no NaN reaches the step's result, and the other envs step as before.
  state = _initial()
  ps = state.brax_state.pipeline_state
  blown = dataclasses.replace(
      state, brax_state=state.brax_state.replace(pipeline_state=ps.replace(qvel=ps.qvel.at[0].set(jnp.nan))))
  zeros = jnp.zeros((NUM_ENVS, 1))
  _, res = _step(ENV, blown, zeros)
  _, clean = _step(ENV, state, zeros)
  np.testing.assert_array_equal(res.done, [1, 0, 0, 0])
  np.testing.assert_array_equal(res.truncation, np.zeros(NUM_ENVS))  # a failure, not the time limit
  assert float(res.reward[0]) == 0 and float(res.episode_return[0]) == 0 and int(res.episode_length[0]) == 1
  np.testing.assert_array_equal(np.asarray(res.obs)[0], np.asarray(state.brax_state.obs)[0])  # auto-reset
  for field in ('obs', 'reward', 'done'):
    np.testing.assert_array_equal(np.asarray(getattr(res, field))[1:], np.asarray(getattr(clean, field))[1:])


def test_actions_of_the_wrong_size_are_refused_naming_the_shape():
  """Before the fix only the env axis was checked: 3 actions for the pendulum's 1 failed deep in MJX's scan
  (IndexError: 'f argument "6" with type "u" has length "3"...'), as native MuJoCo's pool never did."""
  state = _initial()
  with pytest.raises(ValueError, match=r'actions \(4, 3\) must be \[4, 1\]'):
    _step(ENV, state, jnp.zeros((NUM_ENVS, 3)))
  with pytest.raises(ValueError, match=r'actions \(4, 2, 3\) must be \[4, K, 1\]'):
    _chunk(ENV, state, jnp.zeros((NUM_ENVS, 2, 3)))
