"""Domain randomisation (`--randomize`): the spec, the draws, and that they reach the model each env steps with.

Native MuJoCo on hopper and push_cube (pixels); MJX on inverted_pendulum, the cheapest model to compile; MJX-Warp
on push_cube with pixels (a CUDA GPU, or EBRL_WARP_ALLOW_CPU=1 for Warp's slow CPU kernels; skipped otherwise).
"""
import importlib.util
import os

import jax
from jax import numpy as jnp
import mujoco
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


def test_every_backend_takes_it_and_playground_tasks_are_refused():
  for backend in config.BACKENDS:
    assert config.SimConfig(backend=backend, randomize='mass=0.9:1.1,color=0.5:1').randomization.color == (0.5, 1.0)
  with pytest.raises(ValueError,
                     match=r"--randomize=mass=0.9:1.1 runs on the project's own tasks, not "
                     r'--task=playground:CartpoleBalance'):
    config.SimConfig(backend='mjx', task='playground:CartpoleBalance', randomize='mass=0.9:1.1')


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


SERVOS = """<mujoco><worldbody><body><joint name="a" type="hinge"/><geom size="0.1"/>
  <body pos="0 0 -0.3"><joint name="b" type="hinge"/><geom size="0.1"/>
  <body pos="0 0 -0.3"><joint name="c" type="hinge"/><geom size="0.1"/></body></body></body></worldbody>
  <actuator><motor joint="a" gear="3"/><position joint="b" kp="40" kv="3"/><velocity joint="c" kv="7"/></actuator>
</mujoco>"""


def test_gain_scales_each_actuators_whole_force_law_servos_included():
  """gain=2:2 doubles every actuator's force at any state: a motor's, a position servo's with damping and a
  velocity servo's. Before the fix only gainprm[0] and biasprm[1] were scaled, so the velocity servo's -kv
  (biasprm[2]) and the position servo's damping kept their values: a servo to another target, not a stronger one."""
  model = mujoco.MjModel.from_xml_string(SERVOS)
  cfg = config.parse_randomize('gain=2:2')
  base = randomize.base_fields(cfg, model)
  fields = randomize.apply(cfg, base, randomize.draw_numpy(cfg, base, np.random.default_rng(0)))
  scaled = mujoco.MjModel.from_xml_string(SERVOS)
  for name, value in fields.items():
    getattr(scaled, name)[:] = value
  forces = []
  for m in (model, scaled):
    d = mujoco.MjData(m)
    d.qpos[:], d.qvel[:], d.ctrl[:] = (0.3, -0.2, 0.1), (0.5, 1.5, -2.0), (0.4, 0.7, 0.9)
    mujoco.mj_forward(m, d)
    forces.append(d.actuator_force.copy())
  assert np.all(np.abs(forces[0]) > 0.1), forces
  np.testing.assert_allclose(forces[1], 2.0 * forces[0], rtol=1e-12)


def test_gain_is_refused_for_a_muscle():
  model = mujoco.MjModel.from_xml_string(
      SERVOS.replace('<velocity joint="c" kv="7"/>', '<muscle joint="c" lengthrange="0.5 1.5"/>'))
  with pytest.raises(ValueError, match=r'actuator\(s\) \[2\] of this model are muscles or user actuators'):
    randomize.base_fields(config.parse_randomize('gain=0.5:2'), model)


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


def test_cpu_each_env_renders_with_its_own_draw(gl):  # pylint: disable=redefined-outer-name,unused-argument
  """Two envs in one state render their own colours and camera: each frame is, bit for bit, that of the plain pool
  whose model has that env's drawn fields set by hand; identity ranges give the plain frames."""
  camera = render.CameraObs(height=24, width=24)

  def pool(spec=''):
    cfg = config.parse_randomize(spec) if spec else None
    return cpu_env.CpuEnvPool('push_cube', 2, 250, num_threads=1, seed=5, camera=camera, randomization=cfg)

  with pool() as plain, pool('color=1:1,camera=0:0,camera_tilt=0:0') as ident, pool(
      'color=0.2:1,camera=-0.05:0.05,camera_tilt=-0.1:0.1') as rand:
    np.testing.assert_array_equal(ident.pixels(), plain.pixels())
    assert plain.model_fields() == {}
    drawn = rand.model_fields()
    assert set(drawn) == {'geom_rgba', 'cam_pos', 'cam_quat'} and drawn['geom_rgba'].shape == (2, plain.model.ngeom, 4)
    np.testing.assert_array_equal(drawn['cam_pos'][1], rand.env_model(1).cam_pos)
    qpos, qvel = plain.get_state([0])
    rand.set_state([0, 1], np.repeat(qpos, 2, 0), np.repeat(qvel, 2, 0))
    frames = rand.pixels()
    assert np.abs(frames[0].astype(int) - frames[1]).mean() > 1  # one state, two draws
    for i in range(2):
      for field, value in drawn.items():
        getattr(plain.model, field)[:] = value[i]
      plain.set_state([0], qpos, qvel)
      np.testing.assert_array_equal(plain.pixels([0])[0], frames[i])


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


def _warp_can_run():
  if importlib.util.find_spec('warp') is None:
    return False
  if os.environ.get('EBRL_WARP_ALLOW_CPU') == '1':
    return True
  try:
    return bool(jax.devices('cuda'))
  except RuntimeError:
    return False


@pytest.mark.skipif(not _warp_can_run(),
                    reason='MJX-Warp needs warp-lang and a CUDA GPU (or EBRL_WARP_ALLOW_CPU=1 for its CPU kernels)')
def test_warp_draws_reach_the_physics_the_camera_and_the_renderer():
  """On MJX-Warp (push_cube with a camera): the draws are in range and shared per group; gain=2:2 steps as the
  plain env with doubled actions; the data's camera pose (what the renderer reads) is the drawn one; the frames
  are those MJX's renderer gives for that data with the drawn colours, and not those without them."""
  camera = render.CameraObs(height=16, width=16)
  cfg = config.parse_randomize('gain=2:2,color=0.2:1,camera=-0.05:0.05,camera_tilt=-0.1:0.1')
  env = mjx_env.make_mjx_env('push_cube', 100, 1, True, impl='warp', randomization=cfg, camera=camera)
  plain = mjx_env.make_mjx_env('push_cube', 100, 1, True, impl='warp', camera=camera)
  reset, step = jax.jit(stages.reset, static_argnums=(0, 2, 3)), jax.jit(stages.step, static_argnums=0)
  state, state_p = reset(env, jax.random.PRNGKey(2), 4, 2), reset(plain, jax.random.PRNGKey(2), 4, 2)
  fields = {k: np.asarray(v) for k, v in mjx_env.model_fields(env, state.brax_state).items()}
  base = plain.unwrapped.sys
  assert set(fields) == set(randomize.fields_of(cfg)) and mjx_env.model_fields(plain, state_p.brax_state) == {}
  scale = fields['geom_rgba'][..., :3] / np.asarray(base.geom_rgba)[None, :, :3]
  assert np.all((scale >= 0.2 - 1e-6) & (scale <= 1 + 1e-6))
  np.testing.assert_array_equal(scale[0], scale[1])  # a GRPO group shares its draw
  assert not np.array_equal(scale[0], scale[2])
  actions = jnp.tile(jnp.array([0.3, -0.2, 0.1]), (4, 1))
  for _ in range(3):
    state, _ = step(env, state, actions)
    state_p, _ = step(plain, state_p, 2 * actions)
  data = state.brax_state.pipeline_state
  np.testing.assert_allclose(data.qpos, state_p.brax_state.pipeline_state.qpos, atol=1e-5)
  cam = mjx_env.pixel_renderer(env).camera_id  # a worldbody camera: its pose is cam_pos, cam_quat
  np.testing.assert_allclose(data.cam_xpos[:, cam], fields['cam_pos'][:, cam], atol=1e-5)
  for i in range(4):
    mat = np.zeros(9)
    mujoco.mju_quat2Mat(mat, fields['cam_quat'][i, cam].astype(np.float64))
    np.testing.assert_allclose(np.asarray(data.cam_xmat[i, cam]).reshape(9), mat, atol=1e-5)
  frames = np.asarray(state.pixels)
  render_with = jax.jit(lambda rgba, d: mjx_env.pixel_renderer(plain).frames(base.replace(geom_rgba=rgba), d)[1])
  np.testing.assert_array_equal(render_with(fields['geom_rgba'], data), frames)
  assert np.abs(np.asarray(render_with(base.geom_rgba, data)).astype(int) - frames).mean() > 1
