"""Runs that fail stop with one `FATAL:` line that says what to do, exit code 3, and nothing left behind.

A run whose loss becomes NaN/inf (here forced: rewards scaled by 1e30 make the value loss overflow float32 in the
first update) stops with its summary written, `stopped` = 'non_finite' naming the metric, no checkpoint of the
garbage state and no traceback (before, `fused` ended with a Python traceback and no summary). A worker process
that refuses its configuration (a ValueError: here native envs that would not fit the host's memory) is named with
its words and not restarted, since every restart would meet the same (before: three restarts, then 'died 4 times
(last exit code 1)'), and the run's summary so far is written (`stopped` = 'worker_failed')."""
import json
import os
import subprocess
import sys

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fails(run_dir, *flags):
  """Runs the quickstart with `flags` in `run_dir`; checks exit code 3 and one FATAL line; returns that line and the
  whole output."""
  done = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--compilation_cache_dir=',
      '--noprogress_bar', '--telemetry_period_s=0', f'--run_dir={run_dir}', *flags
  ],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=300)
  out = done.stdout + done.stderr
  assert done.returncode == 3, out[-3000:]
  fatal = [line for line in done.stderr.splitlines() if line.startswith('FATAL:')]
  assert len(fatal) == 1, out[-3000:]
  return fatal[0], out


def _diverge(run_dir, *flags):
  fatal, out = _fails(run_dir, '--reward_scaling=1e30', *flags)
  assert 'Traceback' not in out, out[-3000:]
  assert fatal.startswith('FATAL: training diverged: metric train/ppo/') and ' is inf at env step ' in fatal
  assert f'{run_dir}/summary.json holds the run so far' in fatal and '--learning_rate' in fatal
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'non_finite' and summary['env_steps'] > 0
  assert summary['extra']['failure'].startswith('metric train/ppo/') and summary['eval_curve']
  assert summary['extra']['last_checkpoint'] is None  # the first update diverged: nothing before it was saved
  assert 'nothing to resume' in fatal
  return summary


def test_a_diverged_fused_run_writes_its_summary_and_stops_with_one_fatal_line(tmp_path):
  assert _diverge(tmp_path / 'fused')['schedule'] == 'fused'


def test_a_diverged_process_schedule_stops_the_same_way_and_leaves_nothing(tmp_path):
  run_dir = tmp_path / 'async'  # the trainer worker's summary reaches the controller, which raises Diverged
  assert _diverge(run_dir, '--schedule=async', '--num_groups=2')['schedule'] == 'async'
  runs_testlib.assert_nothing_left(run_dir)


def test_a_worker_that_refuses_its_configuration_stops_the_run_at_once_in_its_words(tmp_path):
  run_dir = tmp_path / 'sync'
  fatal, out = _fails(run_dir, '--schedule=sync', '--num_groups=2', '--num_envs=1000000000', '--batch_size=1000000000',
                      '--num_minibatches=1')
  assert ' refused its configuration: ValueError: --num_envs: 500,000,000 native MuJoCo ' in fatal, fatal
  assert fatal.startswith('FATAL: a worker failed: rollout/') and '(a restart would meet the same)' in fatal, fatal
  assert f'{run_dir}/summary.json holds the run so far' in fatal and 'nothing to resume' in fatal, fatal
  assert 'restarting it' not in out, out[-3000:]
  summary = json.load(open(run_dir / 'summary.json'))  # the trainer's so far (or the controller's, had it none)
  assert summary['stopped'] == 'worker_failed' and summary['schedule'] == 'sync'
  assert ' refused its configuration: ValueError: --num_envs: ' in summary['extra']['failure']
  runs_testlib.assert_nothing_left(run_dir)
