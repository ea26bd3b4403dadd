"""A stop asked for (SIGTERM) saves the checkpoint of the last iteration the run counted, and --resume continues
at that iteration. Here a native-MuJoCo `fused` run, whose signals are held to the end of the running iteration
(`controller.fused_steps`; a stop at once left the checkpoint of the last evaluation, up to a whole evaluation
interval behind); the process schedules' trainer (the controller's SIGINT, at an iteration boundary) through
test_signals' async run, and the driver's side with a stand-in source in tests/trainer/test_driver_budget.py."""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 40 iterations between evaluations (and their checkpoints): the stop comes well inside the first interval.
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _main(run_dir, *flags):
  return [sys.executable, '-m', 'ebrl_jax.main', *TINY, f'--run_dir={run_dir}', *flags]


def _steps(run_dir):
  return sorted(int(n) for n in os.listdir(run_dir / 'checkpoints') if n.isdigit())


def test_sigterm_saves_the_last_iteration_of_a_native_fused_run_and_resume_continues_there(tmp_path):
  run_dir = tmp_path / 'fused'
  proc = subprocess.Popen(_main(run_dir, '--num_timesteps=10000000', '--num_evals=200'),
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
  try:
    deadline = time.monotonic() + 240
    while not (os.path.isdir(run_dir / 'checkpoints') and _steps(run_dir)):  # the first, after iteration 1
      assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
      time.sleep(0.1)
    time.sleep(3.0)  # iterations of the first evaluation interval
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    stop_s = time.monotonic() - signalled
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143 and 'Traceback' not in out, out[-3000:]
  summary = json.load(open(run_dir / 'summary.json'))
  stopped_at = summary['iterations']
  assert summary['stopped'] == 'SIGTERM' and 1 < stopped_at < 40, summary
  assert summary['extra']['last_checkpoint'] == stopped_at and _steps(run_dir) == [1, stopped_at]
  assert f'checkpoint {stopped_at} in {run_dir}/checkpoints is loadable' in out
  assert stop_s < 8.0, stop_s  # the running iteration, the save and the summary: not a 10 s chunk
  per_iteration = summary['env_steps'] // stopped_at

  resumed = subprocess.run(_main(run_dir, '--resume', f'--num_timesteps={(stopped_at + 2) * per_iteration}',
                                 '--num_evals=1000'),
                           cwd=ROOT,
                           env=dict(os.environ, JAX_PLATFORMS='cpu'),
                           capture_output=True,
                           text=True,
                           timeout=240)
  assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['extra']['resumed_from']['step'] == stopped_at == summary['extra']['resumed_from']['iterations']
  assert summary['stopped'] == 'num_timesteps' and summary['iterations'] == stopped_at + 2
  assert summary['eval_curve'][0]['version'] == stopped_at  # the resumed run starts at the stop's iteration
