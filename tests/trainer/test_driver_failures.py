"""A run that fails inside training stops as a stop does, with its summary: an allocation XLA refuses (a real one
here: 1 TiB asked of the host, `RESOURCE_EXHAUSTED`) part-way through the run, or before the driver's loop began;
the controller then writes summary.json and raises `errors.OutOfMemory` naming the request and the flags that size
the run's memory. Any other error still propagates as it is."""
import json
import os

import jax
import jax.numpy as jnp
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import runner
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import startup
from ebrl_jax.trainer import driver

TOO_MUCH = 1 << 38  # float32 values: 1 TiB


def _allocate_too_much():
  return jax.jit(lambda: jnp.zeros((TOO_MUCH,), jnp.float32))().block_until_ready()


class _Source:
  """Iterations that do nothing until the `fail_at`-th, which asks XLA for 1 TiB (or raises `other`)."""

  def __init__(self, fail_at, other=None):
    self.done, self.fail_at, self.other = 0, fail_at, other

  def compile(self, state, n):
    del state, n
    return 0.0

  def evaluate(self, params, key):
    del params, key
    return {'eval/episode_return': 1.0}

  def run_iterations(self, state, n):
    for _ in range(n):
      if self.done + 1 == self.fail_at:
        if self.other is not None:
          raise self.other
        _allocate_too_much()
      self.done += 1
    return state, {}

  def close(self):
    pass


def _config(tmp_path):
  return config_lib.Config(sim=config_lib.SimConfig(num_envs=4, num_eval_envs=2, episode_length=50),
                           algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1, unroll_length=5),
                           schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path),
                                                              progress_bar=False,
                                                              num_timesteps=20 * 12,
                                                              num_evals=3,
                                                              compilation_cache_dir=''))


def test_xlas_refused_allocation_is_named_and_every_other_error_is_not():
  with pytest.raises(Exception) as refused:
    _allocate_too_much()
  assert errors.out_of_memory(refused.value).startswith('RESOURCE_EXHAUSTED')
  assert errors.out_of_memory(ValueError('bad shape')) is None
  assert errors.out_of_memory(MemoryError()) is None  # numpy's, on the host: not XLA's


def test_an_allocation_refused_mid_run_stops_it_with_its_summary(tmp_path):

  def trainer(name):
    return driver.trainer_config(_config(tmp_path / name), startup.ProcessConfig(run_dir=str(tmp_path / name)))

  summary = driver.run_training(trainer('oom'), lambda *args: _Source(fail_at=6))
  assert summary.stopped == driver.OUT_OF_MEMORY and summary.extra['failure'].startswith('RESOURCE_EXHAUSTED')
  assert summary.iterations == 4  # 1 + 3 (the first checkpoint, then the evaluation); the failing chunk not counted
  assert [e['env_steps'] for e in summary.eval_curve] == [0, 80]  # the curve up to the failure
  assert summary.extra['last_checkpoint'] == 4  # the one saved before: none of the failed chunk's state
  with pytest.raises(ZeroDivisionError):  # not an allocation: as it was
    driver.run_training(trainer('other'), lambda *args: _Source(fail_at=2, other=ZeroDivisionError('x')))


def test_the_controller_writes_the_summary_then_raises_out_of_memory_naming_the_flags(tmp_path, monkeypatch):
  cfg = _config(tmp_path)

  def fused_that_fails_to_build(cfg, pids, start):  # as a too large --num_envs on the GPU would, building envs
    del cfg, pids, start
    _allocate_too_much()

  monkeypatch.setitem(runner.SCHEDULES, 'fused', fused_that_fails_to_build)
  with pytest.raises(errors.OutOfMemory) as stopped:
    runner.run(cfg)
  message = str(stopped.value)
  assert message.startswith('out of memory: RESOURCE_EXHAUSTED') and '--num_envs' in message
  assert f'{tmp_path}/summary.json holds the run so far' in message and 'nothing to resume' in message
  summary = json.load(open(os.path.join(tmp_path, 'summary.json')))
  assert summary['stopped'] == 'out_of_memory' and summary['extra']['failure'].startswith('RESOURCE_EXHAUSTED')
