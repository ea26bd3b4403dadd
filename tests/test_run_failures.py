"""Runs that fail stop with one `FATAL:` line that says what to do, exit code 3, and nothing left behind.

A run whose loss becomes NaN/inf (here forced: rewards scaled by 1e30 make the value loss overflow float32 in the
first update) stops with its summary written, `stopped` = 'non_finite' naming the metric, no checkpoint of the
garbage state and no traceback (before, `fused` ended with a Python traceback and no summary). A worker beside the
trainer that fails for good (here killed under --worker_fault=stop; tests/controller/test_worker_verdict.py has the
other ways) ends the run like a stop: the trainer's summary so far is written (`stopped` = 'worker_failed'). Native
envs past the host's memory are refused before any worker starts (before: each rollout worker refused its own
pool, and pools that each fit could together not)."""
import json
import os
import signal
import subprocess
import sys
import time

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from experiments import faults  # pylint: disable=wrong-import-position


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


def test_a_worker_that_fails_for_good_ends_the_run_like_a_stop_with_the_trainers_summary(tmp_path):
  run_dir = tmp_path / 'sync'  # a rollout worker killed under --worker_fault=stop once training is under way
  proc = subprocess.Popen([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--compilation_cache_dir=',
      '--noprogress_bar', '--telemetry_period_s=0', f'--run_dir={run_dir}', '--schedule=sync', '--num_groups=2',
      '--worker_fault=stop', '--num_timesteps=100000000', '--num_evals=100000'
  ],
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE,
                          text=True)
  try:
    deadline = time.monotonic() + 240
    while faults.iterations(str(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    victim = faults.workers(str(run_dir))['rollout/0']
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 3, (out + err)[-3000:]
  fatal = [line for line in err.splitlines() if line.startswith('FATAL:')]
  assert len(fatal) == 1, err[-3000:]
  assert fatal[0].startswith(f'FATAL: a worker failed: rollout/0 (pid {victim}) died with exit code -9 '
                             '(--worker_fault=stop); the run stopped. '), fatal
  assert f'{run_dir}/summary.json holds the run so far' in fatal[0] and 'continue with --resume' in fatal[0], fatal
  summary = json.load(open(run_dir / 'summary.json'))  # the trainer's: what it trained before the stop
  assert summary['stopped'] == 'worker_failed' and summary['extra']['failure'].startswith('rollout/0 (pid ')
  assert summary['iterations'] >= 3 and summary['env_steps'] > 0 and summary['eval_curve']
  assert summary['extra']['worker_restarts'] == 0
  assert summary['extra']['last_checkpoint'] == summary['iterations']  # the trainer saved where it stopped
  runs_testlib.assert_nothing_left(run_dir)


def test_native_envs_past_the_hosts_memory_are_refused_before_any_worker_starts(tmp_path):
  # Each of the two groups' pools checks only itself: the run's envs are checked together first (exit code 2)
  done = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--compilation_cache_dir=',
      '--noprogress_bar', '--telemetry_period_s=0', f'--run_dir={tmp_path / "sync"}', '--schedule=sync',
      '--num_groups=2', '--num_envs=1000000000', '--batch_size=1000000000', '--num_minibatches=1'
  ],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=120)
  assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
  assert done.stderr.startswith(
      'FATAL: --num_envs: 1,000,000,008 native MuJoCo envs of inverted_pendulum (the '
      "run's: --num_envs=1,000,000,000 plus --num_eval_envs=8) would take about "), done.stderr
  assert not (tmp_path / 'sync' / 'workers.json').exists()
