"""The command line rejects bad input before any work, with one message naming the flag."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'ebrl_jax.main', *args],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout)


@pytest.mark.parametrize('flag,expected', [
    ('--task=antt', "--task='antt' is not valid; allowed values: ant, halfcheetah, hopper"),
    ('--backend=physx', "--backend='physx' is not valid; allowed values: mujoco_cpu, mjx"),
    ('--policy=cnn', "--policy='cnn' is not valid; allowed values: mlp, transformer"),
    ('--schedule=warp', "--schedule='warp' is not valid; allowed values: fused, sync, async"),
    ('--algo=sac', "--algo='sac' is not valid; allowed values: ppo, grpo"),
    ('--policy_hidden_sizes=32,x', '--policy_hidden_sizes=32,x must be a comma-separated list of integers'),
    ('--env_slices=2', '--env_slices=2 splits the env groups that a separate generation worker serves: it needs '
     '--schedule=sync or async, --nocolocate_generation and --backend=mujoco_cpu'),
])
def test_bad_flag_values_exit_with_named_error(tmp_path, flag, expected):
  result = _run(flag, f'--run_dir={tmp_path}/run')
  assert result.returncode != 0
  assert expected in result.stderr
  assert not os.path.exists(tmp_path / 'run'), 'no work (not even the run directory) before validation'


def test_batch_shape_error(tmp_path):
  result = _run('--num_envs=48', '--batch_size=10', '--num_minibatches=4', f'--run_dir={tmp_path}/run')
  assert result.returncode != 0
  assert '--batch_size=10 x --num_minibatches=4 = 40 segments per iteration must be a multiple of --num_envs=48' \
      in result.stderr


def test_missing_flagfile(tmp_path):
  result = _run(f'--flagfile={tmp_path}/nope.flags')
  assert result.returncode != 0
  assert 'nope.flags' in result.stderr


def test_malformed_flagfile(tmp_path):
  path = tmp_path / 'bad.flags'
  path.write_text('--task=ant\n--no_such_flag=3\n')
  result = _run(f'--flagfile={path}')
  assert result.returncode != 0
  assert 'no_such_flag' in result.stderr


def test_unexpected_positional_argument(tmp_path):
  result = _run('train', f'--run_dir={tmp_path}/run')
  assert result.returncode != 0
  assert 'Unexpected positional arguments: train' in result.stderr


def test_every_flagfile_parses():
  """Each flagfile in experiments/ builds a valid Config (its first line says how to run it)."""
  sys.path.insert(0, ROOT)
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ebrl_jax import main  # pylint: disable=g-import-not-at-top
  flagfiles = sorted(f for f in os.listdir(os.path.join(ROOT, 'experiments')) if f.endswith('.flags'))
  assert 'quickstart.flags' in flagfiles
  for name in flagfiles:
    path = os.path.join(ROOT, 'experiments', name)
    with open(path) as f:
      assert f.readline().startswith('# python'), f'{name} must open with the command that runs it'
    values = flags.FlagValues()
    main.define_flags(values)
    values(['prog', f'--flagfile={path}'])
    cfg = main.config_from_flags(values)
    assert cfg.schedule.run_dir
