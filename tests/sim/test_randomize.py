"""Domain randomisation (`--randomize`): the spec, the draws, and that they reach the model each env steps with.

Native MuJoCo on hopper and push_cube (pixels); MJX on inverted_pendulum, the cheapest model to compile.
"""
import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import randomize
from ebrl_jax.sim import render
from ebrl_jax.sim import stages

SPEC = 'friction=0.8:1.2,mass=0.9:1.1,gain=0.5:2'


def test_parse():
  cfg = config.parse_randomize(SPEC)
  assert cfg.friction == (0.8, 1.2) and cfg.mass == (0.9, 1.1) and cfg.gain == (0.5, 2.0) and cfg.camera is None
  assert cfg.enabled and not cfg.pixels_only
  assert not config.parse_randomize('').enabled
  assert not config.SimConfig().randomization.enabled  # off by default
  assert config.SimConfig(randomize=SPEC).randomization == cfg


@pytest.mark.parametrize('spec', [
    'friction', 'frict=0.8:1.2', 'friction=0.8', 'friction=a:b', 'friction=1.2:0.8', 'mass=0:1', 'gain=-1:1',
    'mass=1:1,mass=1:1', 'friction=0.8:1.2,,'
])
def test_bad_spec_is_one_line_naming_the_flag(spec):
  with pytest.raises(ValueError) as err:
    config.SimConfig(randomize=spec)
  assert '--randomize' in str(err.value) and '\n' not in str(err.value)


def test_refused_where_not_supported():
  with pytest.raises(ValueError, match='--randomize=mass=0.9:1.1 runs on --backend=mujoco_cpu or mjx'):
    config.SimConfig(backend='mjx_warp', randomize='mass=0.9:1.1')


def _pool(randomization=None, num_envs=4, **kw):
  return cpu_env.CpuEnvPool('hopper', num_envs, 1000, num_threads=1, seed=3, randomization=randomization, **kw)


def _run(pool, steps=20):
  actions = np.random.default_rng(0).uniform(-1, 1, (steps, pool.num_envs, 3))
  for a in actions:
    pool.step(a)
  return pool.get_state()


def test_cpu_draws_in_range_per_group():
  cfg = config.parse_randomize(SPEC)
  with _pool(cfg, group_size=2) as pool:
    base = pool.model
    for i in range(4):
      m = pool.env_model(i)
      assert m is not base
      ratio = m.body_mass[1:] / base.body_mass[1:]
      assert np.all((ratio >= 0.9) & (ratio <= 1.1))
      np.testing.assert_allclose(m.body_inertia[1:] / base.body_inertia[1:], ratio[:, None] * np.ones((1, 3)))
      friction = m.geom_friction[:, 0] / base.geom_friction[:, 0]
      assert np.all((friction >= 0.8) & (friction <= 1.2))
      np.testing.assert_array_equal(m.geom_friction[:, 1:], base.geom_friction[:, 1:])
      gain = m.actuator_gainprm[:, 0] / base.actuator_gainprm[:, 0]
      assert np.all((gain >= 0.5) & (gain <= 2.0))
    # A GRPO group's envs share their draw; groups differ.
    np.testing.assert_array_equal(pool.env_model(0).body_mass, pool.env_model(1).body_mass)
    assert not np.array_equal(pool.env_model(0).body_mass, pool.env_model(2).body_mass)
    before = pool.env_model(0).body_mass.copy()
    pool.reset()  # a reset redraws
    assert not np.array_equal(before, pool.env_model(0).body_mass)


def test_cpu_step_uses_the_drawn_model():
  """gain=2:2 randomised == the plain pool with its model's gain doubled by hand, bit for bit."""
  with _pool(config.parse_randomize('gain=2:2')) as rand, _pool() as plain:
    plain.model.actuator_gainprm[:, 0] *= 2.0
    np.testing.assert_array_equal(rand.env_model(1).actuator_gainprm, plain.model.actuator_gainprm)
    for a, b in zip(_run(rand), _run(plain)):
      np.testing.assert_array_equal(a, b)


def test_cpu_off_is_unchanged():
  with _pool() as plain, _pool(config.RandomizationConfig()) as off, _pool(config.parse_randomize(SPEC)) as on:
    assert off.env_model(0) is off.model and off.randomization is None
    np.testing.assert_array_equal(plain.get_state()[0], on.get_state()[0])  # the same initial states
    for a, b in zip(_run(plain), _run(off)):
      np.testing.assert_array_equal(a, b)
    assert not np.array_equal(_run(plain)[0], _run(on)[0])


@pytest.fixture(scope='module')
def gl():
  try:
    if render.needs_headless_gl():
      render.select_gl_backend('egl')
    render.PixelRenderer(cpu_env.load_model(cpu_env.registry.load('push_cube')), render.CameraObs(), 1).close()
  except (ImportError, RuntimeError) as err:
    pytest.skip(f'no headless OpenGL for mujoco.Renderer ({render.gl_backend()}): {err}')


def test_cpu_pixels_see_camera_and_colour(gl):  # pylint: disable=redefined-outer-name,unused-argument

  def frames(spec):
    cfg = config.parse_randomize(spec) if spec else None
    with cpu_env.CpuEnvPool('push_cube', 2, 250, num_threads=1, camera=render.CameraObs(), randomization=cfg) as p:
      return p, p.pixels().astype(int)

  _, plain = frames('')
  pool, dark = frames('color=0.3:0.3')
  np.testing.assert_allclose(pool.env_model(0).geom_rgba[:, :3],
                             np.clip(pool.model.geom_rgba[:, :3] * 0.3, 0, 1),
                             rtol=1e-6)
  assert dark.mean() < plain.mean() - 10
  pool, moved = frames('camera=0.1:0.1,camera_tilt=0.1:0.1')
  np.testing.assert_allclose(pool.env_model(1).cam_pos, pool.model.cam_pos + 0.1, rtol=1e-6)
  assert np.abs(moved - plain).mean() > 5


def test_mjx_draws_reach_the_step():
  """On MJX: the drawn fields are in range and shared per group; with mass=1:1,gain=2:2 the randomised env steps
  as the plain env does with doubled actions (a motor's force is gain * ctrl)."""
  cfg = config.parse_randomize('mass=1:1,gain=2:2,friction=0.8:1.2')
  env = stages.make_mjx_env('inverted_pendulum', 100, 1, randomization=cfg)
  plain = stages.make_mjx_env('inverted_pendulum', 100, 1)
  assert plain is stages.make_mjx_env('inverted_pendulum', 100, 1, randomization=config.RandomizationConfig())
  key = jax.random.PRNGKey(1)
  reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
  state = reset(env, key, 4, 2)
  fields = mjx_env.model_fields(env, state.brax_state)
  base = plain.unwrapped.sys
  assert set(fields) == set(randomize.fields_of(cfg))
  np.testing.assert_allclose(fields['actuator_gainprm'][:, :, 0],
                             np.broadcast_to(2 * base.actuator_gainprm[:, 0], (4, 1)))
  friction = fields['geom_friction'][:, :, 0] / base.geom_friction[None, :, 0]
  assert np.all((friction >= 0.8) & (friction <= 1.2))
  np.testing.assert_array_equal(friction[0], friction[1])
  assert not np.array_equal(friction[0], friction[2])
  state_p = reset(plain, key, 4, 2)
  assert mjx_env.model_fields(plain, state_p.brax_state) == {}

  step = jax.jit(stages.step, static_argnums=0)
  actions = jnp.full((4, 1), 0.1)
  for _ in range(3):
    state, _ = step(env, state, actions)
    state_p, _ = step(plain, state_p, 2 * actions)
  np.testing.assert_allclose(state.brax_state.pipeline_state.q, state_p.brax_state.pipeline_state.q, atol=1e-5)
