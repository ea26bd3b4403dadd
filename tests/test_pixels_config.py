"""--obs=pixels and its flags: validation that names the flag (and says what is not built yet), the flags'
defaults from the dataclass fields, and --pixel_depth from the flag to the camera, the obs spec and the native pool. (The run's segment spec with pixels: tests/controller/test_pixels_e2e.py.)"""
import dataclasses
import os
import subprocess
import sys

from absl import flags
from brax.envs import base as brax_base
from brax.envs import wrappers
import jax
from jax import numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import main as main_lib
from ebrl_jax import types
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.sim import manipulation
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import registry
from ebrl_jax.sim import render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pixels(**sim):
  return dict(dict(task='push_cube', obs='pixels', image_size=32, frame_stack=2), **sim)


@pytest.mark.parametrize('sim,pattern', [
    (dict(obs='rgb'), r"--obs='rgb' is not valid; allowed values: state, pixels"),
    (_pixels(backend='mjx'), r"--obs=pixels on --backend=mjx: MJX's renderer .* takes MuJoCo Warp data only .*"
     r'use --backend=mjx_warp'),
    (_pixels(task='ant'), r'--obs=pixels needs a task with a camera: --task=push_cube \(got --task=ant\)'),
    (_pixels(image_size=4), r'--image_size=4 must be at least 8'),
    (_pixels(frame_stack=0), r'--frame_stack=0 must be > 0'),
    (dict(frame_stack=3), r'--frame_stack=3 stacks camera frames: it needs --obs=pixels'),
    (dict(pixel_depth=True), r'--pixel_depth adds a depth channel to camera frames: it needs --obs=pixels'),
    (_pixels(backend='mjx', pixel_depth=True), r'--obs=pixels on --backend=mjx: .* use --backend=mjx_warp'),
    (_pixels(pixel_state='cube'), r"--pixel_state='cube' is not valid; allowed values: full, proprio"),
    (dict(pixel_state='proprio'), r'--pixel_state=proprio chooses the state beside camera frames: it needs '
     r'--obs=pixels'),
])
def test_sim_obs_errors_name_the_flag(sim, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.SimConfig(**sim)


@pytest.mark.parametrize('policy,pattern', [
    (dict(vision_encoder='resnet'), r"--vision_encoder='resnet' is not valid; allowed values: cnn, patches"),
    (dict(cnn_channels=()), r'--cnn_channels=\[\] must be non-empty and positive'),
    (dict(cnn_blocks=-1), r'--cnn_blocks=-1 must be >= 0'),
    (dict(patch_size=0), r'--patch_size=0 must be > 0'),
])
def test_policy_vision_errors_name_the_flag(policy, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.PolicyConfig(**policy)


@pytest.mark.parametrize('policy,schedule,pattern', [
    (dict(vision_encoder='patches'), {}, r'--vision_encoder=patches gives tokens, which --policy=mlp cannot take'),
    (dict(kind='transformer', vision_encoder='patches',
          patch_size=5), {}, r'--image_size=32 must be a multiple of --patch_size=5'),
    ({}, dict(name='async',
              colocate_generation=False), r'--obs=pixels with --nocolocate_generation .* is not built yet'),
    ({}, dict(name='auto'), r'--plan_generation with --obs=pixels would weigh a separate generation worker'),
])
def test_run_level_pixel_errors_name_the_flags(policy, schedule, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.Config(sim=config_lib.SimConfig(**_pixels(num_envs=4)),
                      policy=config_lib.PolicyConfig(**policy),
                      algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1),
                      schedule=config_lib.ScheduleConfig(**schedule),
                      resources=config_lib.ResourceConfig(plan_generation=schedule.get('name') == 'auto'))


def test_plan_and_auto_take_pixels():  # their calibration renders as the run does (resources/calibrate)
  for schedule, resources in ((dict(name='auto'), {}), (dict(name='async'), dict(plan=True))):
    cfg = config_lib.Config(sim=config_lib.SimConfig(**_pixels(num_envs=4)),
                            algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1),
                            schedule=config_lib.ScheduleConfig(num_groups=1, **schedule),
                            resources=config_lib.ResourceConfig(**resources))
    assert cfg.sim.obs == 'pixels'


def test_flags_default_from_the_fields_and_build_the_pixel_config():
  values = flags.FlagValues()
  main_lib.define_flags(values)
  values(['prog', '--task=push_cube', '--obs=pixels', '--frame_stack=3', '--image_size=48', '--cnn_channels=8,16'])
  cfg = main_lib.config_from_flags(values)
  assert (cfg.sim.obs, cfg.sim.frame_stack, cfg.sim.image_size) == ('pixels', 3, 48)
  assert cfg.policy.cnn_channels == (8, 16) and cfg.policy.vision_encoder == 'cnn'
  assert config_lib.pixel_shape(cfg.sim) == (48, 48, 9)
  assert config_lib.pixel_shape(config_lib.SimConfig()) == ()  # --obs=state, the default
  assert values['obs'].default == config_lib.SimConfig.obs and values['patch_size'].default == 8


@pytest.mark.parametrize('backend', ['mujoco_cpu', 'mjx_warp'])
def test_pixel_depth_flag_reaches_the_camera_and_the_obs_spec(backend):
  """--pixel_depth: the frozen config's field, the camera both pixel backends build from it (render.camera_of), and
  the obs spec every record, network and transport derives from (config.pixel_shape) agree on 4 channels a frame."""
  values = flags.FlagValues()
  main_lib.define_flags(values)
  values([
      'prog', '--task=push_cube', '--obs=pixels', '--pixel_depth', '--frame_stack=2', '--image_size=16',
      f'--backend={backend}'
  ])
  sim = main_lib.config_from_flags(values).sim
  assert sim.pixel_depth and values['pixel_depth'].default is config_lib.SimConfig.pixel_depth is False
  with pytest.raises(dataclasses.FrozenInstanceError):
    sim.pixel_depth = False
  camera = render.camera_of(sim)
  assert camera.depth and camera.channels == 4 and camera.shape == config_lib.pixel_shape(sim) == (16, 16, 8)
  obs = types.obs_template((3,), 5, config_lib.pixel_shape(sim))  # the records' and networks' observations
  assert (obs.pixels.shape, obs.pixels.dtype) == ((3, 16, 16, 8), np.uint8)
  rgb = dataclasses.replace(sim, pixel_depth=False)
  assert render.camera_of(rgb).shape == config_lib.pixel_shape(rgb) == (16, 16, 6) and not render.camera_of(rgb).depth
  assert render.camera_of(config_lib.SimConfig()) is None


def test_the_native_pool_of_the_config_observes_rgbd_stacks_of_the_obs_spec():
  sim = config_lib.SimConfig(**_pixels(num_envs=2, image_size=16, pixel_depth=True), num_threads=1)
  try:
    pool = cpu_rollout.make_pool(sim, 2, 0, auto_reset=True)
  except RuntimeError as err:  # no headless GL here (tests/sim/test_render.py's fixture says the same)
    pytest.skip(f'no headless OpenGL for mujoco.Renderer: {err}')
  with pool:
    obs = cpu_rollout.observe(pool, pool.reset())
  assert pool.spec.pixel_shape == config_lib.pixel_shape(sim) and obs.pixels.shape == (2, 16, 16, 8)
  depth = obs.pixels[..., 3::4]  # the table and the cube are within the 2 m depth range: some depth below 255
  assert obs.pixels.dtype == np.uint8 and (depth < 255).any() and np.array_equal(depth[..., 0], depth[..., 1])


def test_command_line_refuses_pixels_on_mjx_before_any_work(tmp_path):
  result = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', '--task=push_cube', '--obs=pixels', '--backend=mjx',
      f'--run_dir={tmp_path}/run'
  ],
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          capture_output=True,
                          text=True,
                          timeout=120)
  assert result.returncode == 2, result.stderr
  assert 'takes MuJoCo Warp data only' in result.stderr and '--backend=mujoco_cpu' in result.stderr
  assert not os.path.exists(tmp_path / 'run')


def test_pixel_state_proprio_keeps_the_arm_prefix_on_the_native_pool():
  """--pixel_state=proprio: the spec's obs_dim is push_cube's proprioceptive prefix, and the native pool's state
  beside the frames is the first PROPRIO_DIM values of the full pool's (same seed: same resets, same actions)."""
  values = flags.FlagValues()
  main_lib.define_flags(values)
  values(['prog', '--task=push_cube', '--obs=pixels', '--pixel_state=proprio', '--image_size=16', '--num_envs=2'])
  sim = dataclasses.replace(main_lib.config_from_flags(values).sim, num_threads=1)
  assert sim.pixel_state == 'proprio' and values['pixel_state'].default == config_lib.SimConfig.pixel_state == 'full'
  assert render.camera_of(sim).state == 'proprio'
  assert registry.spec_of(sim).obs_dim == manipulation.PROPRIO_DIM == 9
  assert registry.spec_of(dataclasses.replace(sim, pixel_state='full')).obs_dim == manipulation.OBS_DIM
  try:
    pools = [
        cpu_rollout.make_pool(dataclasses.replace(sim, pixel_state=s), 2, 0, auto_reset=True)
        for s in ('full', 'proprio')
    ]
  except RuntimeError as err:  # no headless GL here (tests/sim/test_render.py's fixture says the same)
    pytest.skip(f'no headless OpenGL for mujoco.Renderer: {err}')
  full_pool, proprio_pool = pools
  with full_pool, proprio_pool:
    assert proprio_pool.spec.obs_dim == 9 and full_pool.spec.obs_dim == 31
    full, proprio = full_pool.reset(), proprio_pool.reset()
    actions = np.random.default_rng(0).uniform(-1, 1, (5, 2, 3))
    for a in actions:
      assert proprio.shape == (2, 9)
      np.testing.assert_array_equal(proprio, full[:, :9])
      want, got = cpu_rollout.observe(full_pool, full), cpu_rollout.observe(proprio_pool, proprio)
      np.testing.assert_array_equal(got.pixels, want.pixels)
      full, proprio = full_pool.step(a).obs, proprio_pool.step(a).obs


def test_pixel_state_proprio_on_a_task_that_names_no_proprioception_is_refused():
  with pytest.raises(ValueError, match=r'--pixel_state=proprio: --task=ant does not say which .* --pixel_state=full'):
    registry.state_dim(registry.load('ant'), 'proprio')
  assert registry.state_dim(registry.load('ant'), 'full') == 27


def test_state_slice_wrapper_cuts_reset_step_and_auto_reset_observations():
  """mjx_env.StateSliceWrapper (what MJX-Warp envs get with --pixel_state=proprio) under Brax's episode and
  auto-reset wrappers, on a stand-in batched env whose obs are [step count, 1, 2, ..., 5] per env: every
  observation the outer wrappers give, the auto-reset's first_obs too, is the first 2 values."""

  class Counter(brax_base.Env):  # a batch of 2 envs; obs[:, 0] counts steps since reset

    def reset(self, rng):
      return brax_base.State(jnp.zeros((2, 1)), self._obs(jnp.zeros(2)), jnp.zeros(2), jnp.zeros(2))

    def step(self, state, action):
      count = state.pipeline_state[:, 0] + 1
      return state.replace(pipeline_state=count[:, None], obs=self._obs(count), reward=count)

    def _obs(self, count):
      return jnp.concatenate([count[:, None], jnp.tile(jnp.arange(1.0, 6.0), (2, 1))], axis=-1)

    observation_size, action_size, backend = 6, 1, 'test'

  sliced = mjx_env.StateSliceWrapper(Counter(), 2)
  assert sliced.observation_size == 2
  env = wrappers.training.AutoResetWrapper(wrappers.training.EpisodeWrapper(sliced, 2, 1))
  state = env.reset(jax.random.PRNGKey(0))
  np.testing.assert_array_equal(state.obs, [[0, 1], [0, 1]])
  np.testing.assert_array_equal(state.info['first_obs'], [[0, 1], [0, 1]])
  state = env.step(state, jnp.zeros((2, 1)))
  np.testing.assert_array_equal(state.obs, [[1, 1], [1, 1]])
  state = env.step(state, jnp.zeros((2, 1)))  # the 2-step episodes end: the auto-reset's first obs, cut
  assert np.asarray(state.done).all() and state.obs.shape == (2, 2)
  np.testing.assert_array_equal(state.obs, [[0, 1], [0, 1]])
