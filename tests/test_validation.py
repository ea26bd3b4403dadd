"""Every bad input is one line before anything starts, and a refused run changes no file of the previous run:
flag errors (no flag list, no traceback), a resume of another task's checkpoint (refused by its shapes before any
worker, saying that the checkpoint is intact), a --run_dir that cannot hold a run, a missing --memory_profile,
--sm_quotas naming a role twice or summing past 100 %, --use_mps without MPS, a GPU asked for where there is
none. A truncated newest checkpoint step is named and --resume continues from the one before."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from ebrl_jax import controller
from ebrl_jax.resources import telemetry

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _main(*args, env=None):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', **(env or {})}
  return subprocess.run([sys.executable, '-m', 'ebrl_jax.main', *args],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300)


def _one_fatal_line(result):
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith('FATAL: '), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr + result.stdout
  return lines[0]


def _config(run_dir, **schedule):
  return runs_testlib.tiny_pendulum_config(run_dir, **schedule)


def _snapshot(run_dir):
  """Every file of the run directory: its bytes (hashed) and modification time."""
  out = {}
  for base, _, files in os.walk(run_dir):
    for name in files:
      path = os.path.join(base, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, run_dir)] = (hashlib.sha1(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
  return out


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A finished fused run on the pendulum: 2 iterations, checkpoints 1 and 2."""
  run_dir = tmp_path_factory.mktemp('previous') / 'run'
  summary = controller.run(_config(run_dir))
  assert summary.iterations == 2 and summary.stopped == 'num_timesteps'
  assert sorted(n for n in os.listdir(run_dir / 'checkpoints') if n.isdigit()) == ['1', '2']
  return run_dir


@pytest.mark.parametrize('flag,words', [
    ('--num_envs=abc', "--num_envs=abc: invalid literal for int() with base 10: 'abc'"),
    ('--no_such_flag', "Unknown command line flag 'no_such_flag'"),
    ('--task=antt', "--task='antt' is not valid; allowed values: ant,"),
    ('--sm_quotas=trainer=30,trainer=40', "role 'trainer' is given twice"),
])
def test_a_flag_error_is_one_line_with_a_pointer_to_helpfull(tmp_path, flag, words):
  line = _one_fatal_line(_main(flag, f'--run_dir={tmp_path}/run'))
  assert words in line and '--helpfull' in line
  assert not os.path.exists(tmp_path / 'run')


def test_resuming_another_tasks_checkpoint_is_refused_before_any_worker_and_changes_nothing(finished_run):
  before = _snapshot(finished_run)
  line = _one_fatal_line(
      _main(*TINY, '--task=hopper', '--schedule=async', '--num_groups=2', '--resume', f'--run_dir={finished_run}'))
  assert f'checkpoint 2 in {finished_run}/checkpoints is intact' in line
  assert '--task=inverted_pendulum' in line and 'this run: --task=hopper' in line
  assert 'params.normalizer.mean: (4,) there, (11,) here' in line
  assert _snapshot(finished_run) == before  # config.json, summary.json, metrics, checkpoints: not a byte
  assert not os.path.exists(finished_run / 'workers.json') and not os.path.exists(finished_run / 'phases')


def test_bad_run_state_and_files_are_refused_up_front_and_say_whether_a_checkpoint_exists(tmp_path, finished_run):
  before = _snapshot(finished_run)
  line = _one_fatal_line(_main(*TINY, f'--run_dir={finished_run}'))
  assert 'already holds checkpoints; pass --resume' in line and 'the newest intact one is step 2' in line
  line = _one_fatal_line(_main(*TINY, '--resume', f'--run_dir={tmp_path}/fresh'))
  assert 'holds no checkpoint, so there is nothing to resume' in line
  (tmp_path / 'a_file').write_text('x')
  assert 'is a file, not a directory' in _one_fatal_line(_main(*TINY, f'--run_dir={tmp_path}/a_file'))
  assert 'lies under /proc' in _one_fatal_line(_main(*TINY, '--run_dir=/proc/ebrl_run'))
  line = _one_fatal_line(_main(*TINY, f'--memory_profile={tmp_path}/nope.json', f'--run_dir={tmp_path}/m'))
  assert f'--memory_profile={tmp_path}/nope.json cannot be read' in line
  line = _one_fatal_line(
      _main(*TINY, '--schedule=async', '--num_groups=2', '--use_mps', '--sm_quotas=trainer=50,rollout=30',
            f'--run_dir={tmp_path}/q'))
  assert 'trainer=50 + 2 x rollout=30 = 110 %' in line
  assert not any(os.path.exists(tmp_path / d) for d in ('fresh', 'a_file/checkpoints', 'm', 'q'))
  assert _snapshot(finished_run) == before


@pytest.mark.skipif(shutil.which('nvidia-cuda-mps-control') is not None, reason='this machine has MPS')
def test_use_mps_without_mps_is_an_error_not_a_warning(tmp_path):
  line = _one_fatal_line(_main(*TINY, '--schedule=async', '--num_groups=2', '--use_mps', f'--run_dir={tmp_path}/r'))
  assert 'nvidia-cuda-mps-control is not on PATH' in line and 'run without --use_mps' in line
  assert not os.path.exists(tmp_path / 'r')


@pytest.mark.skipif(telemetry.gpu_absent_reason() is None, reason='NVML sees a GPU here')
@pytest.mark.parametrize('flag,environ,where', [('--platform=gpu', 'cpu', '--platform=gpu'),
                                                ('--platform=', 'cuda,cpu', 'JAX_PLATFORMS=cuda,cpu')])
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line_before_any_file(tmp_path, flag, environ, where):
  """Before the fix: JAX's 'Unable to initialize backend' traceback at the first array, after config.json and
  telemetry.jsonl were written."""
  line = _one_fatal_line(_main(*TINY, flag, f'--run_dir={tmp_path}/r', env={'JAX_PLATFORMS': environ}))
  assert f'{where} asks JAX for an NVIDIA GPU, but this machine has none (NVML' in line, line
  assert 'run with --platform=cpu' in line
  assert not os.path.exists(tmp_path / 'r')


def test_a_truncated_newest_step_is_named_and_resume_continues_from_the_one_before(tmp_path, finished_run, caplog):
  run_dir = tmp_path / 'run'
  shutil.copytree(finished_run, run_dir)
  metadata = run_dir / 'checkpoints' / '2' / 'state' / '_METADATA'
  metadata.write_text(metadata.read_text()[:100])
  line = _one_fatal_line(_main(*TINY, f'--run_dir={run_dir}'))  # without --resume: refused, truthfully
  assert 'the newest intact one is step 1' in line
  caplog.set_level('INFO')
  summary = controller.run(_config(run_dir, num_timesteps=3840, num_evals=1, resume=True))
  messages = [r.getMessage() for r in caplog.records]
  assert any(f'checkpoint 2 ({run_dir}/checkpoints/2) is damaged: {metadata} is not whole' in m for m in messages)
  assert any(f'Resuming the run in {run_dir}: newest checkpoint 1' in m for m in messages)  # said on the console
  assert summary.extra['resumed_from'] == {
      'step': 1,
      'env_steps': 1280,
      'iterations': 1,
      'schedule': 'fused',
      'skipped_damaged': [2]
  }
  assert summary.iterations == 3 and summary.eval_curve[0]['env_steps'] == 1280
  saved = json.load(open(run_dir / 'summary.json'))
  assert saved['extra']['resumed_from']['step'] == 1


def test_a_second_run_in_a_run_dir_in_use_is_refused_before_it_writes(tmp_path):
  """A run holds its --run_dir while it goes (storage.lock_run_dir, a lock on the directory itself): a second one
  started there meanwhile is one line, and writes nothing; once the first has ended the directory is free again."""
  from ebrl_jax.runtime import storage  # pylint: disable=g-import-not-at-top
  run_dir = tmp_path / 'run'
  run_dir.mkdir(mode=0o700)
  held = storage.lock_run_dir(str(run_dir))  # as a run in another process holds it
  try:
    with pytest.raises(ValueError, match=rf'--run_dir={run_dir} is in use by a run that is still going'):
      controller.run(runs_testlib.tiny_pendulum_config(run_dir))
    assert not os.listdir(run_dir)
  finally:
    os.close(held)
  assert controller.run(runs_testlib.tiny_pendulum_config(run_dir)).iterations >= 1
