"""A full disk when the summary is written: the FATAL line says how the run ended (before: 'the run finished, but
the disk ... is full' for a SIGTERM stop too)."""
import errno
import time

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import runner
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import storage


@pytest.mark.parametrize('stopped,words', [
    ('num_timesteps', 'the run finished'),
    ('target_return', 'the run finished'),
    ('SIGTERM', 'the run stopped on SIGTERM'),
    ('SIGINT', 'the run stopped on SIGINT'),
    ('max_wall_s', 'the run stopped at its --max_wall_s budget'),
    ('max_train_s', 'the run stopped at its --max_train_s budget'),
    (errors.DIVERGED, 'the run stopped (training diverged)'),
    (errors.OUT_OF_MEMORY, 'the run stopped (out of memory)'),
    (errors.WORKER_FAILED, 'the run stopped (a worker failed)'),
    (errors.TRAINER_DIED, 'the run stopped (the trainer worker died)'),
])
def test_a_full_disk_at_the_summary_names_how_the_run_ended(tmp_path, monkeypatch, stopped, words):
  cfg = config_lib.Config(schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path)))
  summary = runner.stopped_summary(cfg, stopped, time.time())

  def full(path, *args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device', path)

  monkeypatch.setattr(storage, 'write_json', full)
  with pytest.raises(errors.DiskFull) as refused:
    runner.write_summary(cfg, summary)
  assert str(refused.value).startswith(f'{words}, but the disk holding {tmp_path} is full (No space left on device')
  assert f'{tmp_path}/summary.json was not written' in str(refused.value)
