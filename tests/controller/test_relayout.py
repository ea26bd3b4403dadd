"""--group_schedule: the env groups re-laid out while the run goes on, no segment lost or duplicated; a worker that
dies during a change stops the run with the trainer's own summary; a standby that dies once swapped in is restarted
at the change's boundary; a failed change's other standbys exit at once."""
import collections
import json
import threading
import time

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.controller import relayout as relayout_lib
from ebrl_jax.controller import supervisor as supervisor_lib
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.rollout import worker as rollout_worker
from ebrl_jax.runtime import feedback as feedback_lib
from test_pipeline import _config  # pylint: disable=g-bad-import-order


@pytest.mark.parametrize('schedule, transport', [('sync', 'thread'), ('async', 'thread')])
def test_groups_change_twice_without_losing_or_duplicating_a_segment(tmp_path, schedule, transport):
  """2 groups of 16 envs, then 4 of 8 from iteration 4, then 1 of 32 from iteration 8: every iteration's 4 env
  blocks (lcm(2, 4, 1) = 4, 8 envs each) reach the trainer once. In sync a lost block would hang the trainer; a
  duplicated one is counted."""
  cfg = _config(tmp_path / schedule,
                schedule,
                transport,
                num_groups=2,
                num_timesteps=40_960,
                group_schedule='4:groups=4,8:groups=1')
  summary = controller.run(cfg)
  extra = summary.extra
  # 32 iterations: room for the second change's standbys to be ready (on a loaded machine the 16 iterations it
  # had before ended with that change still pending).
  assert summary.iterations == 32 and summary.env_steps == 32 * cfg.env_steps_per_iteration
  assert extra['segments_consumed'] == 4 * summary.iterations
  assert extra['segments_duplicated'] == 0 and extra['segments_dropped_stale'] == 0
  changes = extra['relayout']['changes']
  assert [(c['old_groups'], c['new_groups'], c['envs_per_group']) for c in changes] == [(2, 4, 8), (4, 1, 32)]
  assert not any(c['failed'] for c in changes) and extra['relayout']['pending'] is None
  for c in changes:
    assert c['pause_s'] >= 0 and c['standbys_ready_s'] > 0 and c['boundary_iteration'] >= 4
    assert c['trainer_period_after_s'] is not None
  assert changes[1]['boundary_iteration'] > changes[0]['boundary_iteration']
  # Every layout's workers delivered: 2 + 4 + 1 rollout roles' figures, by role (rollout/0 served by three).
  assert set(extra['rollout']['group_env_steps_per_s']) == {'rollout/0', 'rollout/1', 'rollout/2', 'rollout/3'}
  assert summary.best_eval_return is not None


def test_blocks_and_segment_spec_follow_the_lcm_of_the_layouts(tmp_path):
  """2 groups, then 3: blocks of 48 / lcm(2, 3) = 8 envs, 6 records an iteration (12 slots with staleness 1), each
  a sixth of the one-group segment."""
  sim, algo = config_lib.SimConfig(task='inverted_pendulum', num_envs=48), config_lib.AlgoConfig(batch_size=48,
                                                                                                 num_minibatches=1)

  def topology(**schedule):
    return topology_lib.make_topology(
        config_lib.Config(sim=sim, algo=algo, schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path), **schedule)))

  relaid = topology(name='async', num_groups=2, max_staleness=1, group_schedule='10:groups=3')
  assert relaid.rollout.block_envs == 8 and relaid.segment_capacity == 12
  one = topology(name='async', num_groups=1).segment_spec
  for name in relaid.segment_spec:  # every transition field has a sixth of the one-group segment's columns
    if name.startswith('transition.'):
      assert relaid.segment_spec[name].shape[1] * 6 == one[name].shape[1]
  assert topology(name='sync', num_groups=2).rollout.block_envs == 24  # one record per group without it


@pytest.mark.parametrize('change, words', [
    (dict(group_schedule='4:groups'), 'iteration:groups=G'),
    (dict(group_schedule='4:groups=2,4:groups=1'), 'two changes at one iteration'),
    (dict(group_schedule='4:groups=3'), 'whole blocks'),
    (dict(group_schedule='4:groups=4', deterministic=True), '--deterministic'),
    (dict(group_schedule='4:groups=4', name='fused'), '--schedule=sync or async'),
])
def test_group_schedule_errors_name_the_flag(tmp_path, change, words):
  with pytest.raises(ValueError, match=words.replace('-', r'\-')):
    config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=32),
                      schedule=config_lib.ScheduleConfig(**{
                          'name': 'sync',
                          'run_dir': str(tmp_path),
                          **change
                      }))


def _two_to_four(tmp_path, iterations: int, at: int):
  """`sync` in threads, 2 groups of the pendulum, then 4 from iteration `at`; the trainer evaluates."""
  return _config(tmp_path,
                 'sync',
                 'thread',
                 num_groups=2,
                 num_timesteps=iterations * 1280,
                 num_evals=1,
                 evaluator='trainer',
                 group_schedule=f'{at}:groups=4')


def test_an_old_layout_worker_dying_during_a_change_ends_with_the_trainers_own_summary(tmp_path, monkeypatch):
  """A worker of the old layout crashes while it delivers its last iterations: the run stops with a WorkerFailure
  naming the change, and the trainer, alive, is asked for its summary so far (not rebuilt from its metrics log)."""
  retired = rollout_worker._retired  # pylint: disable=protected-access

  def crashes(control, iteration):
    if control is not None and control.feedback[feedback_lib.RETIRE_AT] > 0 and control.go is None:
      raise RuntimeError('an old worker crashed while delivering its last iterations')
    return retired(control, iteration)

  monkeypatch.setattr(rollout_worker, '_retired', crashes)
  cfg = _two_to_four(tmp_path, iterations=16, at=3)
  with pytest.raises(controller.RunError, match='during the change to 4 env groups'):
    controller.run(cfg)
  with open(tmp_path / 'summary.json') as f:
    summary = json.load(f)
  assert summary['stopped'] == 'worker_failed' and 'summary_from' not in summary['extra'], summary['extra']


def _block_deliveries(monkeypatch):
  """[(block, incarnation, iteration)] of every record put, as the run goes on."""
  put_all, seen = rollout_worker._put_all, []  # pylint: disable=protected-access

  def spied(channel, records, stop):
    seen.extend((int(r.group[0]), int(r.incarnation[0]), int(r.iteration[0])) for r in records)
    return put_all(channel, records, stop)

  monkeypatch.setattr(rollout_worker, '_put_all', spied)
  return seen


def test_a_standby_that_dies_once_swapped_in_is_restarted_at_the_boundary_and_the_change_ends(tmp_path, monkeypatch):
  """2 -> 4 groups: a new-layout standby dies after it was swapped in, before its `go`. Its restart collects from
  the change's boundary on (not the iterations the old layout still delivers), and the change finishes."""
  swapped, died = threading.Event(), []
  swap_in, stand_by = supervisor_lib.Supervisor.swap_in, rollout_worker._stand_by  # pylint: disable=protected-access

  def spied_swap_in(self, role, worker, control):
    swap_in(self, role, worker, control)
    swapped.set()

  def dies_once_swapped_in(worker, store, control, stop, key, phase):
    if died:
      return stand_by(worker, store, control, stop, key, phase)
    died.append(1)
    control.ready.set()
    swapped.wait(60)
    time.sleep(0.05)
    raise RuntimeError('a standby died after it was swapped in, before go')

  restarts, start_rollout = [], supervisor_lib.Supervisor.start_rollout

  def spied_start(self, group, quota=None, standby=False, rollout_cfg=None, start_iteration=0):
    out = start_rollout(self, group, quota, standby, rollout_cfg, start_iteration)
    if died and not standby:  # the watch loop's restart of the dead standby
      restarts.append((group, self._incarnations[f'rollout/{group}'], start_iteration))  # pylint: disable=protected-access
    return out

  monkeypatch.setattr(supervisor_lib.Supervisor, 'swap_in', spied_swap_in)
  monkeypatch.setattr(supervisor_lib.Supervisor, 'start_rollout', spied_start)
  monkeypatch.setattr(rollout_worker, '_stand_by', dies_once_swapped_in)
  seen = _block_deliveries(monkeypatch)
  cfg = _two_to_four(tmp_path, iterations=12, at=3)
  summary = controller.run(cfg)
  relayout = summary.extra['relayout']
  assert summary.extra['worker_restarts'] == 1 and relayout['pending'] is None, relayout
  boundary = relayout['changes'][0]['boundary_iteration']
  per_block = collections.Counter((block, iteration) for block, _, iteration in seen)
  assert max(per_block.values()) == 1, [k for k, n in per_block.items() if n > 1]
  [(group, incarnation, start)] = restarts
  restarted = [iteration for block, inc, iteration in seen if (block, inc) == (group, incarnation)]  # block = group
  assert start == boundary and restarted and min(restarted) == boundary, (restarts, boundary, restarted)
  assert summary.extra['segments_duplicated'] == 0 and summary.extra['segments_dropped_stale'] == 0


def test_a_failed_change_stops_its_other_standbys_at_once(tmp_path, monkeypatch):
  """2 -> 4 groups: one standby dies before it is ready, so the change fails and 2 groups stay; the other three
  standbys exit then (their `retire`), not at the run's end."""
  died, standbys = [], []
  stand_by, finish = rollout_worker._stand_by, relayout_lib.GroupChanger._finish  # pylint: disable=protected-access

  def first_dies(worker, store, control, stop, key, phase):
    if not died:
      died.append(1)
      raise RuntimeError('a standby could not start')
    return stand_by(worker, store, control, stop, key, phase)

  def spied_finish(self, change, failed=False, first_t=0.0):
    if failed:
      standbys.extend(w for w, _ in change.standbys)
    return finish(self, change, failed, first_t)

  monkeypatch.setattr(rollout_worker, '_stand_by', first_dies)
  monkeypatch.setattr(relayout_lib.GroupChanger, '_finish', spied_finish)
  alive_later = []
  poll = relayout_lib.GroupChanger.poll

  def spied_poll(self):
    if standbys and not alive_later and self._workers.trainer_feedback.snapshot().iterations >= 12:  # pylint: disable=protected-access
      alive_later.append([w.is_alive() for w in standbys])
    return poll(self)

  monkeypatch.setattr(relayout_lib.GroupChanger, 'poll', spied_poll)
  cfg = _two_to_four(tmp_path, iterations=16, at=2)
  summary = controller.run(cfg)
  assert summary.extra['relayout']['changes'][0]['failed'] and len(standbys) == 4
  assert alive_later == [[False, False, False, False]], alive_later
