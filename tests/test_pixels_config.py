"""--obs=pixels and its flags: validation that names the flag (and says what is not built yet), and the flags'
defaults from the dataclass fields. (The run's segment spec with pixels: tests/controller/test_pixels_e2e.py.)"""
import os
import subprocess
import sys

from absl import flags
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import main as main_lib

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
    ({}, dict(name='auto'), r'--schedule=auto with --obs=pixels is not built yet'),
])
def test_run_level_pixel_errors_name_the_flags(policy, schedule, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.Config(sim=config_lib.SimConfig(**_pixels(num_envs=4)),
                      policy=config_lib.PolicyConfig(**policy),
                      algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1),
                      schedule=config_lib.ScheduleConfig(**schedule))


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
