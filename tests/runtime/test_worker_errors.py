"""A worker process's entry point records the error it ends on (`lifecycle.run_worker`), so the controller can
name the cause of a death that otherwise reaches it as an exit code; the error is raised unchanged."""
import os
import time

import pytest

from ebrl_jax.runtime import lifecycle


def _refuse(value):
  raise ValueError(f'--num_envs={value} is too many')


def test_the_error_a_worker_ends_on_is_recorded_by_its_pid_then_raised(tmp_path):
  failures = str(tmp_path / lifecycle.FAILURES_DIR)
  with pytest.raises(ValueError, match='--num_envs=7 is too many'):
    lifecycle.run_worker(None, _refuse, (7,), {}, failures)
  assert lifecycle.last_error(failures, os.getpid()) == {
      'type': 'ValueError',
      'message': '--num_envs=7 is too many',
      'out_of_memory': None  # XLA's line when it refused an allocation (tests/controller/test_worker_verdict.py)
  }
  assert lifecycle.last_error(failures, os.getpid() + 1) is None  # another worker's, or one that was killed
  # An earlier run's record in a reused run directory, its pid come round again, is not this worker's
  assert lifecycle.last_error(failures, os.getpid(), since=time.time() + 1) is None
  assert lifecycle.run_worker(None, lambda a, b=0: a + b, (2,), {'b': 3}, str(tmp_path / 'other')) == 5
  assert not os.path.exists(tmp_path / 'other')  # a worker that returns records nothing
  with pytest.raises(ValueError):  # without a folder: raised as before, nothing written
    lifecycle.run_worker(None, _refuse, (1,), {})
