"""End-to-end runs of the fused schedule on tiny tasks, within a budget of seconds each."""
import json
import os

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.runtime import metrics as metrics_lib


def _config(run_dir, **overrides):
  sim = dict(task='inverted_pendulum',
             backend='mujoco_cpu',
             num_envs=32,
             episode_length=1000,
             num_eval_envs=8,
             num_threads=1)
  algo = dict(batch_size=32, num_minibatches=8, unroll_length=5, num_updates_per_batch=4)
  schedule = dict(num_timesteps=51_200,
                  num_evals=4,
                  seed=0,
                  run_dir=str(run_dir),
                  compilation_cache_dir='',
                  progress_bar=False)
  for section, values in overrides.items():
    {'sim': sim, 'algo': algo, 'schedule': schedule}[section].update(values)
  return config_lib.Config(sim=config_lib.SimConfig(**sim),
                           algo=config_lib.AlgoConfig(**algo),
                           schedule=config_lib.ScheduleConfig(**schedule))


def test_ppo_learns_the_pendulum_on_native_mujoco(tmp_path):
  summary = controller.run(_config(tmp_path / 'ppo'))
  first = summary.eval_curve[0]['return']
  # A random policy balances the pole for ~25 steps; 51,200 PPO steps reach several hundred (1000 = solved).
  assert first < 100
  assert summary.best_eval_return > 300
  assert summary.best_eval_return > 4 * first
  assert summary.env_steps == 51_200  # 32 x 8 segments x 5 steps = 1280 per iteration, 40 iterations
  # Every artefact a user looks for is there and consistent.
  records = [json.loads(line) for line in open(tmp_path / 'ppo' / 'metrics.jsonl')]
  assert records[-1]['env_steps'] == 51_200
  assert any('train/ppo/total_loss' in r for r in records)
  assert os.listdir(tmp_path / 'ppo' / 'tb')
  saved = json.load(open(tmp_path / 'ppo' / 'summary.json'))
  assert saved['env_steps'] == 51_200 and saved['compile_s'] > 0


def test_grpo_learns_with_group_resets(tmp_path):
  cfg = _config(tmp_path / 'grpo',
                sim=dict(num_envs=16, group_size=4, episode_length=200),
                algo=dict(name='grpo', num_minibatches=4, learning_rate=1e-3),
                schedule=dict(num_timesteps=16 * 200 * 12, num_evals=3))
  summary = controller.run(cfg)
  assert summary.env_steps == 16 * 200 * 12
  first = summary.eval_curve[0]['return']
  assert summary.best_eval_return > 2 * first, summary.eval_curve


def test_resume_continues_the_step_count(tmp_path):
  run_dir = tmp_path / 'resume'
  first = controller.run(_config(run_dir, schedule=dict(num_timesteps=2_560, num_evals=2)))
  assert first.env_steps == 2_560  # 2 iterations of 32 x 8 segments x 5 steps = 1,280 env steps each
  with pytest.raises(ValueError, match='already holds checkpoints; pass --resume'):
    controller.run(_config(run_dir, schedule=dict(num_timesteps=5_120, num_evals=4)))
  second = controller.run(_config(run_dir, schedule=dict(num_timesteps=5_120, num_evals=4, resume=True)))
  assert second.env_steps == 5_120
  steps = [json.loads(line)['env_steps'] for line in open(run_dir / 'metrics.jsonl')]
  # The resumed session starts where the first stopped: no step count goes back to zero after 2,560.
  resumed_from = steps.index(2_560)
  assert all(s >= 2_560 for s in steps[resumed_from:])
  assert max(steps) == 5_120


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match='--resume was given but .* holds no checkpoint'):
    controller.run(_config(tmp_path / 'empty', schedule=dict(resume=True)))


def test_mjx_backend_runs_the_fused_program(tmp_path):
  cfg = _config(tmp_path / 'mjx',
                sim=dict(backend='mjx', num_envs=8, num_eval_envs=2, episode_length=50),
                algo=dict(batch_size=8, num_minibatches=2, num_updates_per_batch=1),
                schedule=dict(num_timesteps=160, num_evals=1))
  summary = controller.run(cfg)
  assert summary.env_steps == 160  # 8 x 2 segments x 5 steps = 80 per iteration, 2 iterations
  assert summary.backend == 'mjx'
  assert all(abs(e['return']) < 1e6 for e in summary.eval_curve)


def test_non_finite_loss_stops_the_run(tmp_path):
  logger = metrics_lib.MetricsLogger(str(tmp_path), 100, progress_bar=False)
  logger.log(10, {'train/ppo/total_loss': 1.0})
  with pytest.raises(metrics_lib.NonFiniteMetricError, match='train/ppo/total_loss is nan at env step 20'):
    logger.log(20, {'train/ppo/total_loss': float('nan')})
  logger.close()
