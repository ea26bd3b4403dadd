"""A resume whose newest checkpoint's data does not read back (bytes changed on disk: only the restore finds it) says
no step it does not use: the controller, which reads only the files' metadata, names the newest checkpoint as such
(before: 'Resuming ... from checkpoint 2', then the trainer fell back to step 1), the trainer names the step it
restored in every schedule (a warning, which a trainer worker shows: its INFO lines are not), and the summary's
`resumed_from` and `last_checkpoint` are that step."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from ebrl_jax import controller

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _config(run_dir, num_timesteps, resume=False):
  return runs_testlib.tiny_pendulum_config(run_dir, num_timesteps=num_timesteps, resume=resume)


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A finished fused run on the pendulum: 2 iterations, checkpoints 1 and 2."""
  run_dir = tmp_path_factory.mktemp('previous') / 'run'
  assert controller.run(_config(run_dir, 2560)).iterations == 2
  return run_dir


def _with_step_2_changed(finished_run, tmp_path):
  """A copy of the run whose step 2 has 0xFF bytes over its largest data file: its metadata stays whole."""
  run_dir = tmp_path / 'run'
  shutil.copytree(finished_run, run_dir)
  name = max(glob.glob(str(run_dir / 'checkpoints' / '2' / 'state' / '**' / 'd' / '*'), recursive=True),
             key=os.path.getsize)
  with open(name, 'r+b') as f:
    for quarter in (1, 2, 3):
      f.seek(os.path.getsize(name) * quarter // 4)
      f.write(b'\xff' * 256)
  return run_dir


def _check_summary(run_dir):
  """The resumed run continued from step 1 and, with 1 iteration to run, ended there: its summary names step 1."""
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['extra']['resumed_from'] == {
      'step': 1,
      'env_steps': 1280,
      'iterations': 1,
      'schedule': 'fused',
      'skipped_damaged': [2]
  }
  assert summary['extra']['last_checkpoint'] == 1 and summary['iterations'] == 1


def test_fused_names_the_newest_checkpoint_and_the_step_it_restored(tmp_path, finished_run, caplog):
  run_dir = _with_step_2_changed(finished_run, tmp_path)
  caplog.set_level('INFO')
  controller.run(_config(run_dir, 1280, resume=True))
  messages = [r.getMessage() for r in caplog.records]
  assert any(
      m.startswith(f'Resuming the run in {run_dir}: newest checkpoint 2 (env step 2560, iteration 2); the '
                   'trainer restores it, or an older one') for m in messages), messages
  assert any(m.startswith('Resumed from checkpoint 1 (past damaged step(s) [2]): env step 1280') for m in messages)
  assert not [m for m in messages if 'from checkpoint 2' in m]
  _check_summary(run_dir)


def test_a_trainer_worker_names_the_step_it_restored(tmp_path, finished_run):
  run_dir = _with_step_2_changed(finished_run, tmp_path)
  result = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', *TINY, '--schedule=sync', '--num_timesteps=1280', '--num_evals=2',
      '--resume', f'--run_dir={run_dir}'
  ],
                          cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          capture_output=True,
                          text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resumed from checkpoint 1 (past damaged step(s) [2]): env step 1280' in result.stderr, result.stderr[-3000:]
  assert 'from checkpoint 2' not in result.stderr
  _check_summary(run_dir)
