"""--resume across a flag the train state's layout does not show is refused before any worker starts, one FATAL
line (exit code 2) naming the flag, in every schedule: the driver records --task, --algo and
--normalize_observations in each checkpoint's metadata and the controller compares them (before: a PPO
checkpoint resumed with --algo=grpo silently, and a changed --normalize_observations was refused only inside the
trainer worker of sync/async, its FATAL line after a traceback). A checkpoint whose metadata predates the record
still resumes, with one warning; whether it normalised its observations its statistics' count says, read before
any worker starts without orbax or JAX (before: sync and async refused it in the trainer worker)."""
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from ebrl_jax import controller
from ebrl_jax.controller import resume_check
from ebrl_jax.trainer import checkpoint

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _config(run_dir, resume=False, group_size=1, **kw):
  return runs_testlib.tiny_pendulum_config(run_dir,
                                           sim_kw={'group_size': group_size},
                                           algo_kw=kw,
                                           num_timesteps=1280,
                                           num_evals=1,
                                           resume=resume)


def _main(*args):
  return subprocess.run([sys.executable, '-m', 'ebrl_jax.main', *TINY, *args],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=300)


def _one_fatal_line(result, warned=()):
  """The run's one line (after one warning line containing each of `warned`, in order), exit 2."""
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2, result.stderr[-3000:]
  for words in warned:
    assert lines and lines[0].startswith('W') and words in lines[0], (words, result.stderr[-3000:])
    lines.pop(0)
  assert len(lines) == 1 and lines[0].startswith('FATAL: '), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr + result.stdout
  return lines[0]


def _files(run_dir):
  return {n: (run_dir / n).read_bytes() for n in ('config.json', 'summary.json', 'metrics.jsonl')}


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A finished fused PPO run on the pendulum, observations normalised: checkpoint 1."""
  run_dir = tmp_path_factory.mktemp('previous') / 'run'
  assert controller.run(_config(run_dir)).iterations == 1
  return run_dir


def _copy(finished_run, tmp_path):
  run_dir = tmp_path / 'run'
  shutil.copytree(finished_run, run_dir)
  return run_dir


def test_the_checkpoint_records_what_its_layout_does_not_show(finished_run):
  run = checkpoint.read_extra(str(finished_run / 'checkpoints'), 1)['run']
  assert run['task'] == 'inverted_pendulum' and run['algo'] == 'ppo' and run['normalize_observations'] is True


def test_another_algo_is_refused_before_any_worker_naming_the_flag(tmp_path, finished_run):
  run_dir = _copy(finished_run, tmp_path)
  before = _files(run_dir)
  line = _one_fatal_line(_main('--num_timesteps=2560', '--resume', '--algo=grpo', '--group_size=4',
                               f'--run_dir={run_dir}'),
                         warned=['--batch_size=32 has no effect with --algo=grpo'
                                ])  # the PPO run's flags, kept for the resume
  assert line == (f'FATAL: --resume: checkpoint 1 in {run_dir}/checkpoints was written by a run with --algo=ppo '
                  '(this run: --algo=grpo): its policy and optimizer state were trained with ppo\'s loss, and '
                  '--resume continues a run with its own algorithm. Resume with --algo=ppo, or start a new run in '
                  'another --run_dir.')
  assert _files(run_dir) == before  # nothing of the run changed


@pytest.mark.parametrize('schedule', ['fused', 'sync', 'async'])
def test_a_changed_normalize_observations_is_one_line_in_every_schedule(tmp_path, finished_run, schedule):
  run_dir = _copy(finished_run, tmp_path)
  before = _files(run_dir)
  line = _one_fatal_line(
      _main('--num_timesteps=2560', '--resume', '--nonormalize_observations', f'--schedule={schedule}',
            f'--run_dir={run_dir}'))
  assert line.startswith(f'FATAL: --resume: checkpoint 1 in {run_dir}/checkpoints was written by a run that '
                         'normalised its observations')
  assert 'Resume without --nonormalize_observations' in line
  assert _files(run_dir) == before


def _save(run_dir, run, seen=1280.0):
  """Checkpoint 1 (zeros of this run's train state's shapes, its observation statistics having seen `seen`) with
  `run` as its metadata's record (None: none)."""
  state = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), resume_check.state_template(_config(run_dir)))
  normalizer = state.params.normalizer.replace(count=np.float32(seen))
  state = state.replace(params=state.params.replace(normalizer=normalizer))
  extra = {'env_steps': 1280, 'iterations': 1, **({'run': run} if run is not None else {})}
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    ckpt.save(1, state, extra)


def test_another_task_of_the_same_sizes_is_refused(tmp_path):
  _save(tmp_path, {'task': 'other_pendulum', 'policy': 'mlp', 'algo': 'ppo', 'normalize_observations': True})
  with pytest.raises(ValueError) as refused:
    resume_check.check_checkpoints(_config(tmp_path, resume=True))
  assert 'was written for --task=other_pendulum (this run: --task=inverted_pendulum)' in str(refused.value)
  assert 'Resume with --task=other_pendulum, or start a new run in another --run_dir.' in str(refused.value)


OLD_RUN = {'task': 'inverted_pendulum', 'policy': 'mlp', 'critic': 'mlp'}  # metadata from before the record


@pytest.mark.parametrize('run', [None, OLD_RUN])
def test_a_checkpoint_from_before_the_record_still_resumes_with_a_warning(tmp_path, run, caplog):
  _save(tmp_path, run)
  assert resume_check.check_checkpoints(_config(tmp_path, resume=True, name='grpo', group_size=4))['step'] == 1
  warned = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
  assert len(warned) == 1 and 'records no --algo (it predates that record)' in warned[0], warned


def test_a_checkpoint_from_before_the_record_is_checked_by_its_statistics(tmp_path):
  """Its statistics' count says whether the run that wrote it normalised, read without orbax or JAX."""
  _save(tmp_path, OLD_RUN, seen=0.0)
  assert resume_check.read_scalar(str(tmp_path / 'checkpoints'), 1, ('params', 'normalizer', 'count')) == 0.0
  with pytest.raises(ValueError,
                     match=r'written by a run with --nonormalize_observations \(its observation '
                     r'statistics are empty\), and this run normalises.*Resume with --nonormalize_observations'):
    resume_check.check_checkpoints(_config(tmp_path, resume=True))
  cfg = _config(tmp_path, resume=True)
  raw = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, normalize_observations=False))
  assert resume_check.check_checkpoints(raw)['step'] == 1


def test_a_record_and_statistics_that_cannot_be_read_leave_both_unknown(tmp_path, caplog):
  _save(tmp_path, OLD_RUN)
  for data in glob.glob(str(tmp_path / 'checkpoints' / '1' / 'state' / '**' / 'd' / '*'), recursive=True):
    os.remove(data)  # only the restore would find this: the pre-check warns, and the trainer's restore falls back
  assert resume_check.read_scalar(str(tmp_path / 'checkpoints'), 1, ('params', 'normalizer', 'count')) is None
  assert resume_check.check_checkpoints(_config(tmp_path, resume=True))['step'] == 1
  assert any('records no --algo or --normalize_observations' in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize('schedule', ['sync', 'async'])
def test_an_old_checkpoint_across_normalize_observations_is_one_line_in_the_process_schedules(
    tmp_path, finished_run, schedule):
  """Before, sync and async refused it in the trainer worker: its FATAL line after a traceback, exit code 3."""
  run_dir = _copy(finished_run, tmp_path)
  metadata = run_dir / 'checkpoints' / '1' / 'extra' / 'metadata'
  extra = json.loads(metadata.read_text())
  extra['run'] = OLD_RUN
  metadata.write_text(json.dumps(extra))
  line = _one_fatal_line(
      _main('--num_timesteps=2560', '--resume', '--nonormalize_observations', f'--schedule={schedule}',
            f'--run_dir={run_dir}'))
  assert line.startswith(f'FATAL: --resume: checkpoint 1 in {run_dir}/checkpoints was written by a run that '
                         'normalised its observations (its statistics have seen 1280), and this run has '
                         '--nonormalize_observations')


def test_a_matching_record_resumes_without_a_warning(tmp_path, caplog):
  _save(tmp_path, {'task': 'inverted_pendulum', 'policy': 'mlp', 'algo': 'ppo', 'normalize_observations': True})
  assert resume_check.check_checkpoints(_config(tmp_path, resume=True))['step'] == 1
  assert not [r for r in caplog.records if r.levelname == 'WARNING']
  assert json.loads((tmp_path / 'checkpoints' / '1' / 'extra' / 'metadata').read_text())['run']['algo'] == 'ppo'
