"""push_cube: the native-MuJoCo pool and the MJX env (manipulation_mjx) step the same task.

SLOW: compiles MJX's reset and step for the task on the CPU (about 1-2 minutes on 2 cores), so it runs 2
envs only; the steps themselves are cheap once compiled.

As in test_agreement.py: reset the MJX env, copy its qpos/qvel into a CpuEnvPool with `set_state`, apply the
same random actions to both (auto-reset off) and compare obs, reward, done and the episode totals with
|mjx - cpu| <= TOL * (1 + |cpu|). MJX runs in float32 and MuJoCo in float64 with the same model (Brax's loader
on assets/push_cube.xml) and solver; the cube rests on the table (4 box-plane contacts) from the first step.

The actions unfold the arm towards the cube (plus noise): from PRNGKey(1)'s reset, env 1's fingertip meets its
cube at step 21, so the last 3 of the 24 steps push it. Measured (CPU, jax 0.10.2, mujoco 3.17): the largest
scaled gap is 1e-4 (the resting cube's angular velocity, settling on its contacts), 1e-5-9e-5 in the first
pushing steps; from about the 6th pushing step the cube's rocking velocities (obs 19-21) diverge between the
backends (O(1)) while positions stay within ~1 mm and rewards within ~2e-3 over 20 steps of pushing, the chaotic
contact phase that test_agreement.py's notes describe, which no fixed tolerance follows far.
"""
import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import manipulation
from ebrl_jax.sim import stages

pytestmark = [pytest.mark.contract, pytest.mark.slow]

TOL = 5e-4
NUM_ENVS, NUM_STEPS = 2, 24
UNFOLD = np.array([-0.5, -1.0, 1.0])  # shoulder, elbow, wrist torques that swing the fingertip into the cube


def _assert_close(mjx_value, cpu_value, what):
  mjx_value, cpu_value = np.asarray(mjx_value, np.float64), np.asarray(cpu_value, np.float64)
  err = np.abs(mjx_value - cpu_value) / (1.0 + np.abs(cpu_value))
  assert err.max() <= TOL, f'{what}: max scaled error {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}'


def test_push_cube_backends_agree():
  env = stages.make_mjx_env('push_cube', 250, 1, auto_reset=False)  # registry.load registers the Brax env
  state = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(1), NUM_ENVS, 1)
  step = jax.jit(stages.step, static_argnums=0)
  with cpu_env.CpuEnvPool('push_cube', NUM_ENVS, 250, num_threads=1, auto_reset=False) as pool:
    pipeline = state.brax_state.pipeline_state
    qpos = np.asarray(pipeline.q, np.float64)
    # The MJX reset draws within the task's ranges too (the mapping from uniforms is shared).
    p = manipulation.PARAMS
    assert np.all(np.abs(qpos[:, 5]) <= p['cube_x']) and np.all(np.abs(qpos[:, 3]) <= p['target_x'])
    obs = pool.set_state(range(NUM_ENVS), qpos, np.asarray(pipeline.qd))
    _assert_close(state.brax_state.obs, obs, 'initial obs')
    rng = np.random.default_rng(0)
    for t in range(NUM_STEPS):
      noise = 0.3 * rng.uniform(-1, 1, (NUM_ENVS, pool.spec.action_dim))
      actions = np.clip(UNFOLD + noise, -1, 1).astype(np.float32)
      state, mjx_res = step(env, state, jnp.asarray(actions))
      cpu_res = pool.step(actions)
      _assert_close(mjx_res.obs, cpu_res.obs, f'obs at step {t}')
      _assert_close(mjx_res.reward, cpu_res.reward, f'reward at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.done), cpu_res.done, f'done at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.truncation), cpu_res.truncation)
      _assert_close(mjx_res.episode_return, cpu_res.episode_return, f'episode_return at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.episode_length), cpu_res.episode_length)
    # The arm did push a cube (its contacts were part of the comparison).
    moved = np.linalg.norm(pool.get_state()[0][:, manipulation.CUBE_POS_Q] - qpos[:, manipulation.CUBE_POS_Q], axis=-1)
    assert moved.max() > 5e-3, moved
