"""The native-MuJoCo pool steps the same physics, observations, rewards and terminations as Brax's MJX env.

Each case resets the MJX env, copies its qpos/qvel into a CpuEnvPool with `set_state`, then applies the same
random actions to both for up to NUM_STEPS steps (auto-reset off on both, so finished envs stay comparable).

Tolerance: |mjx - cpu| <= TOL * (1 + |cpu|) elementwise with TOL = 5e-4, for obs and reward; done exactly.
MJX runs in float32 and MuJoCo in float64: the first step agrees to ~1e-6 (float32 rounding), and the gap grows
along the trajectory, most where contacts switch on; over 50 steps the largest gaps measured were 3e-5
(hopper, with ground contact), 2e-5 (reacher) and 1e-6 (inverted_pendulum). 5e-4 leaves 10x headroom and is
still far below what a wrong observation term, reward weight or body index gives (>= 1e-2).

Ant (and humanoid) are special: Brax's MJX env uses a Newton solver stopped after ONE iteration, and MJX's and
MuJoCo's Newton iterations (line searches) differ, so with active contacts the two backends' velocities differ
by ~1e-1 after one env step (measured: 1e-6 with a converged solver, 0.15 with the 1-iteration one). The ant
case therefore converges the solver on both sides (iterations 100, ls_iterations 50) to check everything else.
"""
import warnings

import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import stages

TOL = 5e-4
NUM_ENVS = 2
_reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
_step = jax.jit(stages.step, static_argnums=0)


def _converged_ant_env():
  from brax import envs as brax_envs  # pylint: disable=g-import-not-at-top
  from brax.envs.wrappers import training  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    env = brax_envs.get_environment('ant', backend='mjx')
  env.sys = env.sys.tree_replace({'opt.iterations': 100, 'opt.ls_iterations': 50})
  env = training.EpisodeWrapper(training.VmapWrapper(env), 1000, 1)
  return mjx_env.FreezeWhenDoneWrapper(env)


def _assert_close(mjx_value, cpu_value, what):
  mjx_value, cpu_value = np.asarray(mjx_value, np.float64), np.asarray(cpu_value, np.float64)
  err = np.abs(mjx_value - cpu_value) / (1.0 + np.abs(cpu_value))
  assert err.max() <= TOL, f'{what}: max scaled error {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}'


# (task, action scale, steps). inverted_pendulum gets small forces so that it survives a dozen steps.
CASES = [('inverted_pendulum', 0.1, 30), ('reacher', 1.0, 30), ('hopper', 1.0, 30), ('ant', 1.0, 20)]


@pytest.mark.parametrize('task,action_scale,num_steps', CASES, ids=[c[0] for c in CASES])
def test_backends_agree(task, action_scale, num_steps):
  if task == 'ant':
    env = _converged_ant_env()
  else:
    env = stages.make_mjx_env(task, 1000, 1, auto_reset=False)
  state = _reset(env, jax.random.PRNGKey(1), NUM_ENVS, 1)
  with cpu_env.CpuEnvPool(task, NUM_ENVS, 1000, num_threads=1, auto_reset=False) as pool:
    if task == 'ant':
      pool.model.opt.iterations, pool.model.opt.ls_iterations = 100, 50
    pipeline = state.brax_state.pipeline_state
    obs = pool.set_state(range(NUM_ENVS), np.asarray(pipeline.q), np.asarray(pipeline.qd))
    _assert_close(state.brax_state.obs, obs, 'initial obs')
    rng = np.random.default_rng(0)
    for t in range(num_steps):
      actions = (action_scale * rng.uniform(-1, 1, (NUM_ENVS, pool.spec.action_dim))).astype(np.float32)
      state, mjx_res = _step(env, state, jnp.asarray(actions))
      cpu_res = pool.step(actions)
      _assert_close(mjx_res.obs, cpu_res.obs, f'obs at step {t}')
      _assert_close(mjx_res.reward, cpu_res.reward, f'reward at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.done), cpu_res.done, f'done at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.truncation), cpu_res.truncation)
      _assert_close(mjx_res.episode_return, cpu_res.episode_return, f'episode_return at step {t}')
      np.testing.assert_array_equal(np.asarray(mjx_res.episode_length), cpu_res.episode_length)
    if task == 'inverted_pendulum':
      # Both pendulums fell (~13 steps); finished envs are frozen alike on both backends.
      assert cpu_res.done.all()
      np.testing.assert_array_equal(cpu_res.reward, 0.0)
      np.testing.assert_array_equal(np.asarray(mjx_res.reward), 0.0)
