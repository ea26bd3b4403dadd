"""push_cube on native MuJoCo: model layout, stepping, rewards by hand, reset noise, termination, registry."""
import os

from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import manipulation as m
from ebrl_jax.sim import registry
from ebrl_jax.sim import tasks

P = m.PARAMS
OBS_CUBE_MINUS_TIP, OBS_TARGET_MINUS_CUBE = slice(25, 28), slice(28, 31)


def _pool(num_envs=2, **kw):
  kw.setdefault('num_threads', 1)
  return cpu_env.CpuEnvPool('push_cube', num_envs, kw.pop('episode_length', 250), **kw)


def _qpos(cube_xy, target_xy, arm=(0.0, 2.5, -2.0)):
  return np.array([*arm, *target_xy, *cube_xy, m.CUBE_HALF, 1.0, 0.0, 0.0, 0.0])


def test_registry_entry_and_model_layout():
  task = registry.load('push_cube')
  assert task.xml_path == m.XML_PATH and os.path.isfile(task.xml_path)
  assert task.xml_path.startswith(os.path.dirname(cpu_env.__file__))  # ships inside the package
  assert registry.get_default_config('push_cube').episode_length == 250
  spec = registry.env_spec('push_cube', 250)
  assert (spec.obs_dim, spec.action_dim) == (m.OBS_DIM, m.NU)
  assert spec.dt == pytest.approx(0.005 * 4)  # timestep x n_frames
  model = cpu_env.load_model(task)
  m.check_layout(model)  # raises on a mismatch
  np.testing.assert_allclose(model.actuator_ctrlrange, [[-1, 1]] * 3)
  # Brax's own tasks still resolve under brax/envs/assets.
  assert registry.load('hopper').xml_path.endswith(os.path.join('brax', 'envs', 'assets', 'hopper.xml'))


def test_steps_with_obs_of_env_spec_shape():
  spec = registry.env_spec('push_cube', 250)
  with _pool(3) as pool:
    obs = pool.reset()
    assert obs.shape == (3, spec.obs_dim) and obs.dtype == np.float32
    rng = np.random.default_rng(0)
    for _ in range(10):
      res = pool.step(rng.uniform(-1, 1, (3, spec.action_dim)))
    assert res.obs.shape == (3, spec.obs_dim) and np.all(np.isfinite(res.obs))
    assert np.all(np.isfinite(res.reward)) and not res.done.any()
    # The relative vectors are the differences of the absolute positions in the same obs.
    tip, cube, target = res.obs[:, 6:9], res.obs[:, 9:12], res.obs[:, 22:25]
    np.testing.assert_allclose(res.obs[:, OBS_CUBE_MINUS_TIP], cube - tip, atol=1e-6)
    np.testing.assert_allclose(res.obs[:, OBS_TARGET_MINUS_CUBE], target - cube, atol=1e-6)


def _frame(tip, cube, target):
  sites = np.array([[tip, target, cube]], np.float64)  # site order: fingertip, target, cube
  return {'site_xpos': sites, 'qpos': np.zeros((1, m.NQ)), 'qvel': np.zeros((1, m.NV))}


def test_reward_by_hand():
  action = np.array([[0.5, -0.5, 1.0]])  # sum of squares 0.25 + 0.25 + 1 = 1.5
  # Cube exactly on the target, fingertip 0.1 behind it:
  # -0.5 * 0.1 (reach) - 1.0 * 0 (push) - 0.01 * 1.5 (control) + 1.0 (success) = 0.935.
  on_target = _frame(tip=(0.1, 0.1, 0.025), cube=(0.1, 0.2, 0.025), target=(0.1, 0.2, 0.025))
  terms = m.reward_terms(on_target, action, P)
  assert terms.success[0] and not terms.done[0]
  np.testing.assert_allclose(m.reward(terms, P), [0.935], rtol=1e-12)
  # Cube 0.06 from the target (outside the 0.05 radius), 0.1 from the tip: -0.05 - 0.06 - 0.015 = -0.125.
  near = _frame(tip=(0.1, 0.1, 0.025), cube=(0.1, 0.2, 0.025), target=(0.16, 0.2, 0.025))
  consts = tasks.make_consts(cpu_env.load_model(registry.load('push_cube')), 4, P)
  reward, done = m.reward_push_cube(None, near, action, consts)  # the registry's reward_fn
  np.testing.assert_allclose(reward, [-0.125], rtol=1e-12)
  assert not done[0]
  # The cube's centre past the table's edge (|x| > 0.5) ends the episode.
  off = _frame(tip=(0.1, 0.1, 0.025), cube=(0.51, 0.2, 0.025), target=(0.1, 0.2, 0.025))
  assert m.reward_terms(off, action, P).done[0]


def test_cube_on_target_in_the_pool_earns_the_bonus():
  with _pool(2) as pool:
    # env 0: the cube at rest exactly on the target; env 1: the cube 0.15 from it.
    qpos = np.stack([_qpos((0.05, 0.15), (0.05, 0.15)), _qpos((0.05, 0.0), (0.05, 0.15))])
    pool.set_state([0, 1], qpos, np.zeros((2, m.NV)))
    res = pool.step(np.zeros((2, 3)))
    reach = np.linalg.norm(res.obs[:, OBS_CUBE_MINUS_TIP], axis=-1)
    push = np.linalg.norm(res.obs[:, OBS_TARGET_MINUS_CUBE], axis=-1)
    assert push[0] < 1e-3 and push[1] == pytest.approx(0.15, abs=1e-3)  # the cube rests where it was put
    # reward = -0.5 * reach - push (+ 1 on target); zero action costs nothing.
    np.testing.assert_allclose(res.reward, -0.5 * reach - push + np.array([1.0, 0.0]), atol=1e-5)


def test_reset_noise_within_ranges():
  with _pool(64, seed=3) as pool:
    qpos, qvel = pool.get_state()
  init = np.array([0.0, 2.5, -2.0])
  arm, target, cube, quat = qpos[:, m.ARM_Q], qpos[:, m.TARGET_Q], qpos[:, m.CUBE_POS_Q], qpos[:, m.CUBE_QUAT_Q]
  assert np.all(np.abs(arm - init) <= P['arm_noise']) and np.all(np.abs(qvel[:, m.ARM_V]) <= P['arm_vel_noise'])
  assert np.all(np.abs(cube[:, 0]) <= P['cube_x'])
  assert np.all((cube[:, 1] >= P['cube_y_lo']) & (cube[:, 1] <= P['cube_y_hi']))
  np.testing.assert_array_equal(cube[:, 2], m.CUBE_HALF)
  assert np.all(np.abs(target[:, 0]) <= P['target_x'])
  assert np.all((target[:, 1] >= P['target_y_lo']) & (target[:, 1] <= P['target_y_hi']))
  # A turn about z only, within +-pi/4; the cube and the target start at rest.
  np.testing.assert_allclose(np.linalg.norm(quat, axis=-1), 1.0)
  np.testing.assert_array_equal(quat[:, 1:3], 0.0)
  assert np.all(np.abs(2 * np.arctan2(quat[:, 3], quat[:, 0])) <= P['cube_yaw'] + 1e-12)
  np.testing.assert_array_equal(qvel[:, m.TARGET_V], 0.0)
  np.testing.assert_array_equal(qvel[:, m.CUBE_V], 0.0)
  # Noise really is drawn, over most of each range (64 draws of a uniform).
  for values, width in ((cube[:, 0], 0.2), (cube[:, 1], 0.1), (target[:, 0], 0.3), (target[:, 1], 0.13)):
    assert np.ptp(values) > 0.7 * width


def test_reset_from_uniform_bounds_and_jax_agree():
  init = np.array([0.0, 2.5, -2.0, 0, 0.185, 0, 0, 0.025, 1, 0, 0, 0])
  lo, _ = m.reset_from_uniform(np.zeros(m.NUM_UNIFORMS), init, P)
  # u = 0 gives every range's lower end: arm -0.1, cube (-0.1, -0.05), yaw -pi/4, target (-0.15, 0.12).
  np.testing.assert_allclose(lo[:5], [-0.1, 2.4, -2.1, -0.15, 0.12])
  np.testing.assert_allclose(lo[5:8], [-0.1, -0.05, 0.025])
  np.testing.assert_allclose(lo[8:], [np.cos(np.pi / 8), 0, 0, -np.sin(np.pi / 8)])
  u = np.random.default_rng(0).uniform(size=(5, m.NUM_UNIFORMS))
  for a, b in zip(m.reset_from_uniform(u, init, P), m.reset_from_uniform(jnp.asarray(u), jnp.asarray(init), P, jnp)):
    np.testing.assert_allclose(np.asarray(b), a, atol=1e-6)


def test_cube_off_the_table_fails_without_truncation():
  with _pool(1) as pool:
    pool.set_state([0], _qpos((0.55, 0.0), (0.0, 0.2))[None], np.zeros((1, m.NV)))
    res = pool.step(np.zeros((1, 3)))
    assert res.done[0] == 1 and res.truncation[0] == 0 and res.episode_length[0] == 1


def test_time_limit_only_truncates():
  with _pool(2, episode_length=3) as pool:
    res = [pool.step(np.zeros((2, 3))) for _ in range(3)]
    assert [r.done.any() for r in res] == [False, False, True]
    np.testing.assert_array_equal(res[-1].truncation, [1, 1])
