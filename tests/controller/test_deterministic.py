"""--deterministic: two runs with the same seed give the same curve, parameters and target stop whatever the
timing."""
import random
import threading
import time

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax import sim
from ebrl_jax.generation import policies
from ebrl_jax.rollout import evaluator as evaluator_lib
from ebrl_jax.rollout import groups
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import remote_eval
from ebrl_jax.trainer import stages

DETERMINISTIC = True


def _config(run_dir, transport, **schedule_kw):
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=16,
                                                    num_eval_envs=8,
                                                    num_threads=1),
                           algo=config_lib.AlgoConfig(batch_size=16, num_minibatches=4),
                           schedule=config_lib.ScheduleConfig(name='async',
                                                              run_dir=str(run_dir),
                                                              compilation_cache_dir='',
                                                              progress_bar=False,
                                                              transport=transport,
                                                              num_groups=2,
                                                              max_staleness=2,
                                                              deterministic=DETERMINISTIC,
                                                              **{
                                                                  'num_timesteps': 6_400,
                                                                  'num_evals': 2,
                                                                  **schedule_kw
                                                              }))


class _Jittery:
  """A group whose collect takes a random extra 0-40 ms (group 0 slower on average): the order in which
  segments reach the trainer and the versions in the store when a group starts an iteration vary."""

  def __init__(self, inner, group, rng):
    self._inner, self._group, self._rng = inner, group, rng

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def collect(self, params, version, key):
    time.sleep(self._rng.uniform(0.0, 0.04 if self._group == 0 else 0.01))
    return self._inner.collect(params, version, key)


def _final_params(cfg, run_dir):
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  template = stages.init_train_state(network, stages.make_optimizer(cfg.algo), jax.random.PRNGKey(0), spec.obs_dim)
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    state, _, _ = ckpt.restore(template)
  return jax.device_get(state.params)


def test_deterministic_async_repeats_its_curve_and_parameters_under_different_timing(tmp_path, monkeypatch):
  """One run in worker processes over shared memory, one in threads with a jittery group: the same eval curve and
  the same final parameters to the last bit; every segment trained on is exactly `--max_staleness` behind
  (after the first iterations), none dropped."""
  cfg_a = _config(tmp_path / 'a', 'shm')
  a = controller.run(cfg_a)
  make_group, rng = groups.make_group, random.Random(7)
  monkeypatch.setattr(groups, 'make_group',
                      lambda cfg, group, *args: _Jittery(make_group(cfg, group, *args), group, rng))
  cfg_b = _config(tmp_path / 'b', 'thread')
  b = controller.run(cfg_b)
  assert [e['return'] for e in a.eval_curve] == [e['return'] for e in b.eval_curve]
  assert [e['env_steps'] for e in a.eval_curve] == [e['env_steps'] for e in b.eval_curve]
  for s in (a, b):
    assert s.env_steps == a.env_steps >= 6_400 and s.extra['segments_consumed'] == 2 * s.iterations
    assert s.extra['segments_dropped_stale'] == 0 and s.extra['segments_duplicated'] == 0
    assert s.extra['max_staleness_seen'] == 2
  same = jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), _final_params(cfg_a, tmp_path / 'a'),
                      _final_params(cfg_b, tmp_path / 'b'))
  assert all(jax.tree_util.tree_leaves(same)), same


def test_a_target_stop_comes_at_the_same_iteration_whatever_the_evaluators_pace(tmp_path, monkeypatch):
  """--target_return with the evaluator process: each evaluation point waits for the versions asked for before,
  so the stop comes at the point after version 0 reached the target (0.0) in both runs. The second run's evaluator
  holds each version until the trainer waits for it at an evaluation point, then 1.5 s more: however loaded the
  machine, the trainer is made to wait (without the wait it stopped iterations later there)."""
  target = dict(num_timesteps=40 * 320, num_evals=20, target_return=0.0)
  a = controller.run(_config(tmp_path / 'a', 'thread', **target))
  evaluate, poll, waiting = evaluator_lib.evaluate_version, remote_eval.RemoteEvaluations.poll, threading.Event()

  def slow(*args):
    waiting.wait(60.0)  # a trainer that never waits gets its result a minute late: it stops iterations later
    time.sleep(1.5)
    return evaluate(*args)

  def noting_poll(self, *args):
    if not self._all_reported():  # pylint: disable=protected-access
      waiting.set()
    return poll(self, *args)

  monkeypatch.setattr(evaluator_lib, 'evaluate_version', slow)
  monkeypatch.setattr(remote_eval.RemoteEvaluations, 'poll', noting_poll)
  b = controller.run(_config(tmp_path / 'b', 'thread', **target))
  per_eval = 2  # 40 iterations, 20 evaluations
  for s in (a, b):
    assert s.stopped == 'target_return' and s.iterations == per_eval, (s.stopped, s.iterations)
  assert [e['return'] for e in a.eval_curve] == [e['return'] for e in b.eval_curve]
  assert b.extra['evaluator']['settle_s'] >= 1.0, (a.extra['evaluator'], b.extra['evaluator'], b.eval_curve)


@pytest.mark.parametrize('change, words', [
    (dict(schedule='fused'), '--schedule=sync or async'),
    (dict(schedule='overlap'), '--schedule=sync or async'),
    (dict(colocate_generation=False), '--colocate_generation'),
    (dict(quota_schedule='10:rollout=40'), '--quota_schedule'),
])
def test_deterministic_refuses_what_timing_would_decide(tmp_path, change, words):
  schedule = dict(name=change.pop('schedule', 'async'), run_dir=str(tmp_path), deterministic=True, **change)
  quota = schedule.pop('quota_schedule', '')
  with pytest.raises(ValueError, match=words.replace('-', r'\-')):
    config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=16),
                      schedule=config_lib.ScheduleConfig(**schedule),
                      resources=config_lib.ResourceConfig(quota_schedule=quota, use_mps=bool(quota)))
