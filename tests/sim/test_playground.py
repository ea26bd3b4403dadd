"""MuJoCo Playground envs by name (`--task=playground:NAME`): a bundled dm_control-suite task (CartpoleBalance)
through our MJX stages on CPU (impl='jax'), and the one-line errors for a missing package, an unknown name, the
CPU backend and missing mujoco_menagerie assets. Runs offline.
"""
import importlib.util

import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config
from ebrl_jax.sim import registry

if importlib.util.find_spec('mujoco_playground') is None:
  pytest.skip(
      "MuJoCo Playground is not installed (the optional extra: pip install -e '.[playground]', PyPI "
      'playground==0.2.0); the test extra installs it, so CI runs these tests',
      allow_module_level=True)

# pylint: disable=wrong-import-position
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import playground
from ebrl_jax.sim import stages

TASK = 'playground:CartpoleBalance'


def test_config_errors_name_the_flag():
  assert config.SimConfig(task=TASK, backend='mjx').task == TASK
  with pytest.raises(ValueError, match='needs --backend=mjx or --backend=mjx_warp'):
    config.SimConfig(task=TASK)  # default backend mujoco_cpu
  with pytest.raises(ValueError, match='must name a Playground env'):
    config.SimConfig(task='playground:', backend='mjx')
  with pytest.raises(ValueError, match='has no env'):
    registry.env_spec('playground:NoSuchEnv', 100)


def test_missing_menagerie_is_one_line(monkeypatch, tmp_path):
  _, pg_mjx_env = playground._modules()  # pylint: disable=protected-access
  missing = tmp_path / 'external_deps' / 'mujoco_menagerie'
  monkeypatch.setattr(pg_mjx_env, 'MENAGERIE_PATH', type(pg_mjx_env.MENAGERIE_PATH)(str(missing)))
  monkeypatch.delenv(playground.MENAGERIE_ENV, raising=False)
  task = 'playground:Go1JoystickFlatTerrain'
  with pytest.raises(playground.PlaygroundAssetsError) as err:
    playground.check_assets(task)
  message = str(err.value)
  assert '\n' not in message and str(missing) in message and playground.MENAGERIE_ENV in message
  monkeypatch.setenv(playground.MENAGERIE_ENV, str(tmp_path / 'nowhere'))
  with pytest.raises(playground.PlaygroundAssetsError, match='is not a directory'):
    playground.check_assets(task)
  monkeypatch.setenv(playground.MENAGERIE_ENV, str(tmp_path))
  playground.check_assets(task)  # a local copy: Playground is pointed at it
  assert str(pg_mjx_env.MENAGERIE_PATH) == str(tmp_path)
  playground.check_assets(TASK)  # a suite task needs no menagerie


def test_dict_observation_round_trip():
  example = {'state': jnp.arange(3.0), 'privileged_state': jnp.ones((2, 2)), 'pixels': jnp.zeros((2, 2, 1), jnp.uint8)}
  layout = playground._ObsLayout(example)  # pylint: disable=protected-access
  flat = layout.flatten(example)
  assert flat.shape == (layout.size,) == (11,) and flat.dtype == jnp.float32
  back = layout.unflatten(flat)
  for k, v in example.items():
    np.testing.assert_array_equal(back[k], v)
    assert back[k].dtype == v.dtype


def test_impl_follows_the_backend():
  assert playground.load(TASK, 'jax')._config.impl == 'jax'  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='--backend=mjx_warp'):
    stages.make_mjx_env(TASK, 20, 1, impl=stages.impl_for_backend('mjx_warp'))  # no CUDA GPU here


def test_cartpole_steps_through_our_stages():
  spec = registry.env_spec(TASK, episode_length=20)
  assert (spec.obs_dim, spec.action_dim, spec.dt) == (5, 1, pytest.approx(0.01))
  assert registry.get_default_config(TASK).episode_length == 1000
  env = stages.make_mjx_env(TASK, 20, 1)
  assert mjx_env.env_impl(env) == 'jax' and stages.make_mjx_env(TASK, 20, 1) is env
  state = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(0), 4, 2)
  assert state.brax_state.obs.shape == (4, spec.obs_dim)
  np.testing.assert_array_equal(state.brax_state.obs[0], state.brax_state.obs[1])  # a group shares its start
  step = jax.jit(stages.step, static_argnums=0)
  actions = jnp.linspace(-1.0, 1.0, 4)[:, None]
  for t in range(25):
    state, result = step(env, state, actions)
    assert np.all(np.isfinite(result.obs)) and np.all((result.reward >= 0) & (result.reward <= 1))
    if t == 19:  # the time limit: done and truncated, then auto-reset
      np.testing.assert_array_equal(result.done, 1.0)
      np.testing.assert_array_equal(result.truncation, 1.0)
      np.testing.assert_array_equal(result.episode_length, 20)
  np.testing.assert_array_equal(result.episode_length, 5)
  assert not np.array_equal(result.obs[0], result.obs[3])  # different actions, different states
