"""Registry contract and the facts copied from Brax: frame skip, MJX option overrides, obs/action sizes."""
import warnings

import jax
import mujoco
import numpy as np
import pytest

from ebrl_jax import config
from ebrl_jax import sim
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import registry
from ebrl_jax.sim import tasks


def test_unknown_task_is_a_value_error_naming_the_valid_ones():
  with pytest.raises(ValueError) as err:
    registry.load('cartpole')
  for name in config.TASKS:
    assert name in str(err.value)


def test_names_match_config_tasks_and_duplicates_are_refused():
  assert set(registry.names()) == set(config.TASKS) == set(sim.names())
  with pytest.raises(ValueError, match='already registered'):
    registry.register('ant', registry.load('ant'))


def test_default_config_and_env_spec():
  cfg = registry.get_default_config('hopper')
  assert isinstance(cfg, config.SimConfig) and cfg.task == 'hopper' and cfg.episode_length == 1000
  spec = registry.env_spec('hopper', episode_length=500, action_repeat=2)
  # hopper.xml: timestep 0.002, Brax frame skip 4 -> 0.008 s per env step, x2 action repeat.
  assert spec.obs_dim == 11 and spec.action_dim == 3
  assert spec.dt == pytest.approx(0.016) and spec.episode_length == 500
  with pytest.raises(ValueError, match='action_repeat'):
    registry.env_spec('hopper', 10, 0)


def test_enum_constants_match_mujoco():
  assert registry.SOLVER_NEWTON == int(mujoco.mjtSolver.mjSOL_NEWTON)
  assert registry.DISABLE_EULERDAMP == int(mujoco.mjtDisableBit.mjDSBL_EULERDAMP)


@pytest.mark.parametrize('task', config.TASKS)
def test_task_matches_brax_mjx_env(task):
  from brax import envs as brax_envs  # pylint: disable=g-import-not-at-top
  task_def = registry.load(task)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    env = brax_envs.get_environment(task_def.brax_name, backend='mjx')
  # Sizes by tracing reset only (no compilation).
  obs = jax.eval_shape(env.reset, jax.random.PRNGKey(0)).obs
  assert obs.shape == (task_def.obs_dim,)
  assert env.action_size == task_def.action_dim
  assert env._n_frames == task_def.n_frames  # pylint: disable=protected-access
  # The native model steps with the options Brax's MJX env steps with.
  model = cpu_env.load_model(task_def)
  for field in ('solver', 'iterations', 'ls_iterations', 'disableflags', 'integrator', 'cone'):
    assert int(getattr(model.opt, field)) == int(getattr(env.sys.opt, field)), field
  assert model.opt.timestep == pytest.approx(float(env.sys.opt.timestep))
  assert registry.env_spec(task, 1000).dt == pytest.approx(float(env.dt), rel=1e-6)
  assert model.nbody == env.sys.nbody and model.nq == env.sys.nq
  np.testing.assert_allclose(tasks.make_consts(model, 1, {}).init_q, np.asarray(env.sys.init_q), rtol=1e-6)
