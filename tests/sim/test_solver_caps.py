"""--solver_iterations / --ls_iterations: the caps reach native MuJoCo's model and data and MJX's system, merge with
a task's own overrides, and bad values are refused naming the flag."""
import mujoco
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import registry


def test_caps_replace_the_tasks_own_and_zero_keeps_them():
  ant = registry.load('ant')
  assert dict(registry.solver_caps(ant)) == dict(ant.mjx_opt_overrides)  # Brax's 1 / 4
  capped = dict(registry.solver_caps(ant, (0, 8)))
  assert capped['ls_iterations'] == 8 and capped['iterations'] == 1 and capped['solver'] == registry.SOLVER_NEWTON
  assert dict(registry.solver_caps(registry.load('push_cube'), (3, 0))) == {'iterations': 3}
  with pytest.raises(ValueError, match='>= 0'):
    registry.solver_caps(ant, (-1, 0))


def _max_solver_iterations(pool, steps=40):
  rng = np.random.default_rng(0)
  pool.reset()
  most = 0
  for _ in range(steps):
    pool.step(rng.uniform(-1, 1, (pool.num_envs, pool.spec.action_dim)).astype(np.float32))
    most = max(most, max(int(d.solver_niter[0]) for d in pool._datas))  # pylint: disable=protected-access
  return most


def test_native_pool_runs_the_capped_solver():
  with cpu_env.CpuEnvPool('push_cube', 8, 250, num_threads=1, solver=(1, 8)) as pool:
    assert (pool.model.opt.iterations, pool.model.opt.ls_iterations) == (1, 8)
    capped = _max_solver_iterations(pool)
  with cpu_env.CpuEnvPool('push_cube', 8, 250, num_threads=1) as pool:
    assert (pool.model.opt.iterations, pool.model.opt.ls_iterations) == (100, 50)  # MuJoCo's defaults
    free = _max_solver_iterations(pool)
  assert capped <= 1 < free  # the uncapped solver takes more than one iteration on these contacts


def test_mjx_env_system_gets_the_caps():
  env = mjx_env.make_mjx_env('push_cube', 250, 1, True, impl='jax', solver=(3, 8))
  opt = env.unwrapped.sys.opt
  assert (int(opt.iterations), int(opt.ls_iterations)) == (3, 8)
  ant = mjx_env.make_mjx_env('ant', 1000, 1, True, impl='jax', solver=(0, 6)).unwrapped.sys.opt
  assert (int(ant.iterations), int(ant.ls_iterations)) == (1, 6)  # Brax's iterations kept, the linesearch capped
  default = mjx_env.make_mjx_env('push_cube', 250, 1, True, impl='jax').unwrapped.sys.opt
  assert (int(default.iterations), int(default.ls_iterations)) == (100, 50)
  assert mujoco.mjtSolver(int(opt.solver)) == mujoco.mjtSolver.mjSOL_NEWTON


@pytest.mark.parametrize('kwargs,match', [({
    'solver_iterations': -1
}, '--solver_iterations=-1'), ({
    'ls_iterations': -2
}, '--ls_iterations=-2'),
                                          ({
                                              'task': 'playground:CartpoleBalance',
                                              'backend': 'mjx',
                                              'ls_iterations': 8
                                          }, 'Playground env takes its solver options')])
def test_bad_caps_are_refused_by_flag(kwargs, match):
  with pytest.raises(ValueError, match=match):
    config_lib.SimConfig(**kwargs)
