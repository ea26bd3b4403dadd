"""SIGTERM (a harness's time limit) and --max_wall_s stop a run cleanly: exit code 143 (0 for the budget), one
`STOPPED:` line and no traceback, summary.json written with the partial curve and `stopped` saying why, the
checkpoint of the iteration it stopped at, and every time on one clock that starts when the process started
(in `async` too, where the trainer worker counts from the controller's start)."""
import json
import os
import signal
import subprocess
import sys
import time

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--num_timesteps=10000000',
        '--num_evals=2000')


def _launch(run_dir, *flags):
  launched = time.time()
  proc = subprocess.Popen([sys.executable, '-m', 'ebrl_jax.main', *TINY, f'--run_dir={run_dir}', *flags],
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
  return proc, launched


def _wait_for_checkpoint(proc, run_dir, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.isdir(run_dir / 'checkpoints') and any(n.isdigit() for n in os.listdir(run_dir / 'checkpoints')):
      return
    assert proc.poll() is None, f'the run ended early:\n{proc.stdout.read()[-3000:]}'
    time.sleep(0.2)
  raise AssertionError('no checkpoint within the time limit')


def _stopped_by_sigterm(run_dir, *flags):
  """Starts a run, sends SIGTERM once its first checkpoint is in; returns (output, summary, launch time)."""
  proc, launched = _launch(run_dir, *flags)
  try:
    _wait_for_checkpoint(proc, run_dir)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
  lines = [l for l in out.splitlines() if 'SIGTERM' in l]
  assert len(lines) == 1 and lines[0].startswith('STOPPED: SIGTERM at env step'), out[-3000:]
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'SIGTERM' and summary['iterations'] >= 1 and summary['eval_curve']
  step = summary['extra']['last_checkpoint']  # the stop's own: the last iteration the run counted
  assert step == summary['iterations'] and str(step) in os.listdir(run_dir / 'checkpoints'), summary
  assert f'checkpoint {step} in {run_dir}/checkpoints is loadable: continue with --resume' in lines[0]
  # One clock from process start: its origin is the launch (within the interpreter's start), and every
  # evaluation's wall_s is its unix time minus that origin.
  assert launched - 0.02 <= summary['start_unix'] < launched + 1.0  # /proc counts in 10 ms ticks
  for point in summary['eval_curve']:
    assert abs(point['unix'] - point['wall_s'] - summary['start_unix']) < 0.05
  parts = summary['compile_breakdown']
  assert parts['imports'] > 0 and summary['compile_s'] >= parts['imports'] + parts['state_init']
  assert summary['wall_s'] >= summary['compile_s']
  return out, summary


def test_sigterm_stops_a_fused_run_with_its_summary(tmp_path):
  _, summary = _stopped_by_sigterm(tmp_path / 'fused')
  assert summary['schedule'] == 'fused'


def test_sigterm_stops_an_mjx_fused_run_at_a_chunk_boundary_with_its_summary(tmp_path):
  """One MJX process holds the signal until its chunk program returns (errors.deferred_stops: on MJX-Warp an
  exception raised inside the simulator's Python callback aborts the process), then stops there: same contract."""
  out, summary = _stopped_by_sigterm(tmp_path / 'mjx', '--backend=mjx', '--episode_length=100')
  assert summary['schedule'] == 'fused' and summary['backend'] == 'mjx'
  assert 'stop signal came during the last chunk: stopping at iteration' in out  # the driver's, at the boundary


def test_sigterm_stops_an_async_run_with_the_trainers_summary_and_leaves_nothing(tmp_path):
  run_dir = tmp_path / 'async'
  _, summary = _stopped_by_sigterm(run_dir, '--schedule=async', '--num_groups=2')
  # The trainer's summary, on the controller's clock: the trainer started well after the process did.
  assert summary['schedule'] == 'async' and summary['extra']['segments_consumed'] >= 2
  assert summary['compile_breakdown']['driver_start'] > 0  # the trainer worker's spawn and imports
  assert summary['eval_curve'][0]['wall_s'] > summary['compile_breakdown']['imports']
  runs_testlib.assert_nothing_left(run_dir)


def test_max_wall_s_stops_cleanly_and_writes_the_summary(tmp_path):
  run_dir = tmp_path / 'budget'
  proc, _ = _launch(run_dir, '--max_wall_s=1', '--telemetry_period_s=0')
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert 'Traceback' not in out and '--max_wall_s=1 reached' in out
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'max_wall_s' and summary['wall_s'] >= 1.0
  assert summary['iterations'] < 7813  # far from --num_timesteps
