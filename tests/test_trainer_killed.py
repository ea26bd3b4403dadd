"""A SIGKILLed trainer worker sends no summary, yet the run's summary.json is written as for a stop (before: the
run ended with its FATAL line and no summary.json, the curve only in metrics.jsonl): `stopped` = 'trainer_died',
the worker's death in `extra.failure`, the evaluation curve and the last train metrics it had logged in this run,
the checkpoint --resume continues from; exit code 3, one FATAL line, no worker and no shared memory left, and no
semaphore of the trainer's left to multiprocessing's resource tracker (no 'leaked semaphore' warning)."""
import json
import os
import signal
import subprocess
import sys
import time

import runs_testlib  # pylint: disable=g-bad-import-order

from ebrl_jax import config as config_lib
from ebrl_jax.controller import runner
from ebrl_jax.runtime import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(path):
  return [json.loads(line) for line in open(path)]


def test_a_sigkilled_trainer_worker_leaves_the_summary_of_what_it_had_logged(tmp_path):
  run_dir = tmp_path / 'run'
  run_dir.mkdir(mode=0o700)
  earlier = {'env_steps': 5, 'wall_s': 1.0, 'eval/episode_return': 123.0}  # an earlier run's: not this run's curve
  (run_dir / 'metrics.jsonl').write_text(json.dumps(earlier) + '\n')
  proc = subprocess.Popen([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--schedule=async',
      '--num_groups=2', '--target_return=100000', '--compilation_cache_dir=', '--noprogress_bar',
      '--telemetry_period_s=0', f'--run_dir={run_dir}'
  ],
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE,
                          text=True)
  try:
    deadline = time.monotonic() + 240
    while '"train/' not in (run_dir / 'metrics.jsonl').read_text():  # the trainer is training: kill it
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.1)
    trainer = json.load(open(run_dir / 'workers.json'))['workers']['trainer']
    os.kill(trainer, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 3, err[-3000:]
  fatal = [line for line in err.splitlines() if line.startswith('FATAL: ')]
  assert len(fatal) == 1 and 'Traceback' not in err, err[-3000:]
  # Nothing the killed trainer made is left to multiprocessing's resource tracker, which says so when the
  # controller exits (its stderr is the run's): tensorboardX's queue left 3 semaphores there before.
  assert 'leaked' not in err, err[-3000:]
  assert fatal[0].startswith(f'FATAL: the trainer worker (pid {trainer}) died with exit code -9; the run stopped. '
                             f'{run_dir}/summary.json holds the run so far. '), fatal[0]
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'trainer_died' and summary['schedule'] == 'async'
  assert summary['extra']['failure'] == f'the trainer worker (pid {trainer}) died with exit code -9'
  logged = _records(run_dir / 'metrics.jsonl')[1:]  # this run's
  evals = [r for r in logged if 'eval/episode_return' in r]
  assert summary['eval_curve'] == [{
      'env_steps': r['env_steps'],
      'wall_s': r['wall_s'],
      'return': r['eval/episode_return']
  } for r in evals]
  assert summary['final_eval_return'] == (evals[-1]['eval/episode_return'] if evals else None)
  last_train = [r for r in logged if any(k.startswith('train/') for k in r)][-1]
  assert summary['extra']['last_metrics'] == last_train
  assert summary['env_steps'] == max(r['env_steps'] for r in logged) and summary['iterations'] >= 1
  step = summary['extra']['last_checkpoint']
  if step is None:
    assert 'No checkpoint had been written' in fatal[0]
  else:
    assert f'Its checkpoint {step} in {run_dir}/checkpoints stays loadable: continue with --resume.' in fatal[0]
  runs_testlib.assert_nothing_left(run_dir)


def test_the_log_is_read_from_this_runs_offset_past_a_line_cut_by_the_kill(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"env_steps": 0, "eval/episode_return": 1.0}\n')
  offset = metrics.log_size(str(tmp_path))
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"env_steps": 2560, "wall_s": 3.0, "eval/episode_return": 20.0}\n'
            '{"env_steps": 5120, "wall_s": 4.0, "train/ppo/total_loss": 2.5}\n'
            '{"env_steps": 7680, "wall_s": 5.0, "train/ppo/tot')  # cut mid-write
  logged = metrics.read_log(str(tmp_path), offset)
  assert [r['env_steps'] for r in logged] == [2560, 5120]
  assert metrics.read_log(str(tmp_path / 'nowhere')) == [] and metrics.log_size(str(tmp_path / 'nowhere')) == 0
  cfg = config_lib.Config(schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path), target_return=10.0))
  summary = runner.stopped_summary(cfg, 'trainer_died', time.time(), logged)
  assert summary.eval_curve == [{'env_steps': 2560, 'wall_s': 3.0, 'return': 20.0}]
  assert (summary.final_eval_return, summary.env_steps_to_target, summary.wall_s_to_target) == (20.0, 2560, 3.0)
  # no checkpoint: the iterations are counted from 0 at the run's env steps per iteration
  assert summary.env_steps == 5120 and summary.iterations == 5120 // cfg.env_steps_per_iteration
  assert summary.extra['last_metrics'] == logged[1] and summary.extra['last_checkpoint'] is None
