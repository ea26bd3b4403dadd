"""Flags that cannot take effect are not accepted silently: GRPO's --grad_clip_scope=per_network and --value_cost
(GRPO trains no critic) and an --episode_length past what the envs can count are errors naming the flag; --num_groups
with --schedule=fused, which other tools read beside a fused flagfile, and PPO's flags that GRPO does not read (a
PPO flagfile under --algo=grpo) are one warning line each; a --resume across
--nonormalize_observations is refused naming the flag (the restored statistics say which run wrote the checkpoint).
Beside them: --platform's error lists no empty value, and --help / --helpfull exit 0."""
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import config_checks
from ebrl_jax import controller
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.generation import normalization
from ebrl_jax.resources import calibrate
from ebrl_jax.trainer import checkpoint_values

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _main(*args):
  return subprocess.run([sys.executable, '-m', 'ebrl_jax.main', *args],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=300)


@pytest.mark.parametrize('algo,words', [
    (dict(max_grad_norm=0.5, grad_clip_scope='per_network'), '--grad_clip_scope=per_network clips the critic'),
    (dict(value_cost=0.5), '--value_cost=0.5 weighs the critic\'s loss; --algo=grpo trains no critic'),
])
def test_grpo_refuses_the_critics_flags_and_ppo_takes_them(algo, words):
  with pytest.raises(ValueError, match=words):
    config_lib.AlgoConfig(name='grpo', **algo)
  assert config_lib.AlgoConfig(**algo)  # PPO's critic reads them
  assert config_lib.AlgoConfig(name='grpo', value_cost=config_lib.AlgoConfig().value_cost)  # the default: fine


@pytest.mark.parametrize('field', ['episode_length', 'action_repeat'])
def test_an_episode_longer_than_the_envs_count_is_refused(field):
  assert getattr(config_lib.SimConfig(**{field: 2**24}), field) == 2**24
  for value in (2**24 + 1, 2**63):
    with pytest.raises(ValueError, match=rf'--{field}={value} must be <= 16777216 \(2\*\*24\): MJX counts'):
      config_lib.SimConfig(**{field: value})


def test_num_groups_with_fused_is_a_warning_only_away_from_its_default():
  fused = lambda **kw: config_lib.Config(schedule=config_lib.ScheduleConfig(**kw))
  assert config_checks.no_effect(fused(num_groups=4)) == [
      '--num_groups=4 has no effect with --schedule=fused (one program steps every env); it sizes the env groups of '
      'the process schedules.'
  ]
  assert config_checks.no_effect(fused()) == [] and config_checks.no_effect(fused(name='sync', num_groups=4)) == []


def _grpo(algo=None, **policy):
  return config_lib.Config(sim=config_lib.SimConfig(num_envs=32, episode_length=40, group_size=4),
                           policy=config_lib.PolicyConfig(kind='transformer', **policy),
                           algo=config_lib.AlgoConfig(name='grpo', **(algo or {})))


def test_grpo_warns_of_each_ppo_flag_it_does_not_read_and_ppo_of_none():
  changed = dict(discount=0.99, gae_lambda=0.9, reward_scaling=1.0, normalize_advantage=False, batch_size=64)
  assert config_checks.no_effect(_grpo(changed)) == [
      '--discount=0.99 has no effect with --algo=grpo, which scores each episode by its undiscounted return; it is '
      'read by --algo=ppo.',
      '--gae_lambda=0.9 has no effect with --algo=grpo, which estimates no advantages from a critic; it is read by '
      '--algo=ppo.',
      '--reward_scaling=1.0 has no effect with --algo=grpo, which normalises returns within each group; it is read '
      'by --algo=ppo.',
      '--normalize_advantage=False has no effect with --algo=grpo, which normalises returns within each group; it '
      'is read by --algo=ppo.',
      '--batch_size=64 has no effect with --algo=grpo, which collects one whole episode per env and splits the envs '
      'into --num_minibatches; it is read by --algo=ppo.',
  ]
  assert config_checks.no_effect(_grpo()) == []
  assert config_checks.no_effect(config_lib.Config(algo=config_lib.AlgoConfig(**changed))) == []


def test_grpo_takes_an_action_chunk_that_does_not_divide_the_unroll_length_it_does_not_collect():
  """GRPO collects whole episodes; PPO's segments of --unroll_length steps must hold whole chunks. The calibration
  times GRPO in unrolls of --unroll_length rounded down to whole chunks."""
  assert _grpo(action_chunk=4).segment_shape == (1, 10)  # the default --unroll_length=5 is no multiple of 4
  assert calibrate.timed_unroll_steps(_grpo(action_chunk=4)) == 1
  assert calibrate.timed_unroll_steps(_grpo(dict(unroll_length=13), action_chunk=4)) == 3
  assert calibrate.timed_unroll_steps(_grpo(dict(unroll_length=100), action_chunk=4)) == 10  # within the episode
  assert calibrate.timed_unroll_steps(_grpo(dict(unroll_length=2), action_chunk=4)) == 1  # at least one chunk
  with pytest.raises(ValueError, match='--unroll_length=5 must be a multiple of --action_chunk=4'):
    config_lib.Config(sim=config_lib.SimConfig(num_envs=32),
                      policy=config_lib.PolicyConfig(kind='transformer', action_chunk=4))
  ppo = config_lib.Config(policy=config_lib.PolicyConfig(kind='transformer', action_chunk=5))
  assert calibrate.timed_unroll_steps(ppo) == 1 and ppo.segment_shape[1] == 1


def test_the_platform_error_lists_the_values_and_no_empty_one():
  with pytest.raises(ValueError) as refused:
    config_lib.ResourceConfig(platform='tpu')
  assert "--platform='tpu' is not valid; allowed values: cpu, gpu, cuda (unset: JAX chooses)." == str(refused.value)


def test_the_command_line_warns_of_num_groups_with_fused_and_help_exits_0(tmp_path):
  (tmp_path / 'a_file').write_text('x')
  result = _main('--num_groups=4', f'--run_dir={tmp_path}/a_file')  # refused after the warning, before any work
  assert result.returncode == 2 and '--num_groups=4 has no effect with --schedule=fused' in result.stderr
  for flag in ('--help', '--helpfull'):
    result = _main(flag)
    assert result.returncode == 0 and '--num_groups' in result.stdout, (flag, result.returncode)


def _state(normalize, count):
  """What `normalization_change` reads of a TrainState: params' statistics and static flag."""
  stats = normalization.init_stats(3).replace(count=jnp.float32(count))
  return types.SimpleNamespace(
      params=gen_stages.PolicyParams(normalizer=stats, network={}, normalize_observations=normalize))


def test_the_statistics_say_whether_the_checkpoint_normalised():
  assert checkpoint_values.normalization_change(_state(True, 640), _state(True, 0)) is None
  assert checkpoint_values.normalization_change(_state(False, 0), _state(False, 0)) is None
  assert 'its statistics have seen 640), and this run has --nonormalize_observations' in (
      checkpoint_values.normalization_change(_state(True, 640), _state(False, 0)))
  assert 'written by a run with --nonormalize_observations (its observation statistics are empty)' in (
      checkpoint_values.normalization_change(_state(False, 0), _state(True, 0)))


def test_a_resume_across_nonormalize_observations_is_refused_naming_the_flag(tmp_path):
  run_dir = tmp_path / 'run'
  cfg = runs_testlib.tiny_pendulum_config(run_dir, num_timesteps=1280, num_evals=1)
  assert controller.run(cfg).iterations == 1
  result = _main(*TINY, '--num_timesteps=2560', '--resume', '--nonormalize_observations', f'--run_dir={run_dir}')
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2 and lines[-1].startswith(f'FATAL: --resume: checkpoint 1 in {run_dir}/checkpoints '
                                                         'was written by a run that normalised its observations')
  assert 'Resume without --nonormalize_observations' in lines[-1] and 'Traceback' not in result.stderr
