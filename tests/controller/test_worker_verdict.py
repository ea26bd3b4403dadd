"""A worker beside the trainer that dies is restarted, or stops the run when a restart would meet the same end
(`supervisor.death_verdict`): with --worker_fault=stop, past --max_restarts, and at once when the error it recorded
(`lifecycle.run_worker`) is its configuration refused (a ValueError) or an allocation XLA refused it. Before, a
rollout worker that ran out of memory was restarted like a crash, into the same allocation, --max_restarts times.
The refused allocation here is a real one: a worker process that asks XLA for 1 TiB of host memory."""
import dataclasses
import multiprocessing

import jax
import jax.numpy as jnp
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import supervisor
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle

SCHEDULE = config_lib.ScheduleConfig()  # --worker_fault=restart, --max_restarts=3


def _ask_too_much():
  return jax.jit(lambda: jnp.zeros((1 << 38,), jnp.float32))().block_until_ready()  # 1 TiB of float32


def _refuse():
  raise ValueError('--num_envs=7 is too many')


def _die(tmp_path, target):
  """The record a worker process ending on `target`'s error leaves, its pid and exit code."""
  failures = str(tmp_path / lifecycle.FAILURES_DIR)
  worker = multiprocessing.get_context('spawn').Process(target=lifecycle.run_worker,
                                                        args=(None, target, (), {}, failures))
  worker.start()
  worker.join(timeout=120)
  assert worker.exitcode == 1, worker.exitcode
  return lifecycle.last_error(failures, worker.pid), worker.pid, worker.exitcode


def test_a_worker_that_runs_out_of_memory_stops_the_run_at_once(tmp_path):
  error, pid, code = _die(tmp_path, _ask_too_much)
  assert error['type'] == 'JaxRuntimeError' and error['out_of_memory'].startswith('RESOURCE_EXHAUSTED'), error
  failure = supervisor.death_verdict('rollout/1', pid, code, error, SCHEDULE, deaths=1)  # its first death
  assert isinstance(failure, errors.WorkerFailure) and failure.stopped == errors.OUT_OF_MEMORY
  assert str(failure).startswith(f'rollout/1 (pid {pid}): RESOURCE_EXHAUSTED') and 'a restart would' in str(failure)


def test_a_worker_that_refuses_its_configuration_stops_the_run_at_once(tmp_path):
  error, pid, code = _die(tmp_path, _refuse)
  assert error == {'type': 'ValueError', 'message': '--num_envs=7 is too many', 'out_of_memory': None}
  failure = supervisor.death_verdict('generation', pid, code, error, SCHEDULE, deaths=1)
  assert failure.stopped == errors.WORKER_FAILED
  assert str(failure) == (f'generation (pid {pid}) refused its configuration: ValueError: --num_envs=7 is too many '
                          '(a restart would meet the same)')


@pytest.mark.parametrize('error', [None, {'type': 'RuntimeError', 'message': 'socket closed', 'out_of_memory': None}])
def test_a_crash_is_restarted_until_max_restarts_then_stops_the_run(error):
  for deaths in (1, 2, 3):  # a kill leaves no record (None); another error is taken for a crash
    assert supervisor.death_verdict('rollout/0', 11, -9, error, SCHEDULE, deaths) is None
  failure = supervisor.death_verdict('rollout/0', 11, -9, error, SCHEDULE, deaths=4)
  assert failure.stopped == errors.WORKER_FAILED
  assert str(failure).startswith('rollout/0 died 4 times (last exit code -9') and '--max_restarts=3' in str(failure)
  assert ('socket closed' in str(failure)) == (error is not None)


def test_worker_fault_stop_stops_the_run_at_the_first_death():
  failure = supervisor.death_verdict('evaluator',
                                     12,
                                     -9,
                                     None,
                                     dataclasses.replace(SCHEDULE, worker_fault='stop'),
                                     deaths=1)
  assert failure.stopped == errors.WORKER_FAILED
  assert str(failure) == 'evaluator (pid 12) died with exit code -9 (--worker_fault=stop)'
