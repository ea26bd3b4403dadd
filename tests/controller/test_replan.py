"""Live rollout-quota changes: a --quota_schedule swap per group through warm standbys (processes, a stand-in
MPS daemon), a Replanner-driven change from fake feedback, and the flags' errors."""
import os
import stat
import time

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.controller import replan
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import profile_keys
from ebrl_jax.resources import mps
from ebrl_jax.resources import planner
from ebrl_jax.resources import profiles
from ebrl_jax.runtime import feedback

_FAKE_CONTROL = '#!/bin/sh\n[ "$1" != "-d" ] && cat > /dev/null\nexit 0\n'  # stand-in nvidia-cuda-mps-control


def _fake_mps(tmp_path, monkeypatch):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  path = bin_dir / mps.CONTROL
  path.write_text(_FAKE_CONTROL)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv('PATH', f'{bin_dir}:{os.environ["PATH"]}')
  monkeypatch.delenv('CUDA_MPS_PIPE_DIRECTORY', raising=False)


def _config(tmp_path, transport='shm', num_timesteps=64_000, **resources):
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=32,
                                                    num_eval_envs=8,
                                                    num_threads=1),
                           algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                           schedule=config_lib.ScheduleConfig(name='sync',
                                                              num_timesteps=num_timesteps,
                                                              num_evals=2,
                                                              run_dir=str(tmp_path / 'run'),
                                                              compilation_cache_dir='',
                                                              progress_bar=False,
                                                              transport=transport,
                                                              num_groups=2),
                           resources=config_lib.ResourceConfig(**resources))


def test_quota_schedule_swaps_each_group_through_a_warm_standby(tmp_path, monkeypatch):
  _fake_mps(tmp_path, monkeypatch)
  cfg = _config(tmp_path, use_mps=True, sm_quotas='rollout=30,trainer=40', quota_schedule='3:rollout=40')
  summary = controller.run(cfg)
  # 64,000 steps / 1,280 per iteration = 50 iterations of 2 groups: every one trained on two distinct, fresh
  # segments; the retiring workers delivered their in-flight segments, the standbys' warm-ups were never sent.
  assert summary.iterations == 50 and summary.extra['segments_consumed'] == 100
  assert summary.extra['segments_duplicated'] == 0 and summary.extra['segments_dropped_stale'] == 0
  record = summary.extra['replan']
  assert record['mode'] == 'quota_schedule' and [d['quota'] for d in record['decisions']] == [40]
  swaps = sorted(record['swaps'], key=lambda s: s['group'])
  assert [s['group'] for s in swaps] == [0, 1]
  for s in swaps:
    assert not s['failed'] and s['old_quota'] == 30 and s['new_quota'] == 40
    assert s['quota_seen_by_worker'] == 40  # the new process runs with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40
    assert 0 < s['standby_ready_s'] < 120 and 0 < s['gap_s'] < 60
    assert 0 < s['env_steps_lost'] < float('inf') and s['env_steps_per_s_before'] > 0
    assert s['env_steps_lost'] == pytest.approx(s['gap_s'] * s['env_steps_per_s_before'])
    assert s['period_before_s'] == pytest.approx(640 / s['env_steps_per_s_before'])  # 1,280 steps / 2 groups
  assert summary.extra['worker_restarts'] == 0  # a swap is not a restart
  assert record['pending'] == []  # both swaps finished before the run did
  # The standbys reported their own start-up under their incarnation, and went on to collect.
  from ebrl_jax.runtime import lifecycle  # pylint: disable=g-import-not-at-top
  phases = {name: r['phase'] for name, r in lifecycle.read_phases(cfg.schedule.run_dir).items()}
  assert phases == {
      'trainer': 'training',
      'rollout/0': 'collecting',
      'rollout/1': 'collecting',
      'rollout/0#1': 'collecting',
      'rollout/1#1': 'collecting',
      'evaluator': 'evaluating'  # --evaluator=process (the default): never swapped
  }


def test_a_swap_cut_short_by_the_runs_end_is_recorded_as_pending(tmp_path):
  # On the H200 a W2 change asked for at iteration 10 of 32 had no finished swap at the end: the record must say
  # where each group's swap stood instead of nothing.
  cfg = _config(tmp_path, use_mps=True, sm_quotas='rollout=30,trainer=40', quota_schedule='3:rollout=40')
  changer = replan.QuotaChanger(cfg, None, replan.ScheduleTrigger(cfg.resources.quota_changes, None))
  control = feedback.make_control(False, True)
  swap = replan._Swap(1, None, control, None, control, 30, 40, 100.0, None, 0.0)  # pylint: disable=protected-access
  changer.active.append(swap)
  record = changer.record(now=142.5)
  assert record['swaps'] == [] and record['pending'] == [{
      'group': 1,
      'new_quota': 40,
      'phase': 'standby',
      'elapsed_s': 42.5
  }]
  assert not [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{os.getpid()}_')]
  import multiprocessing  # pylint: disable=g-import-not-at-top
  assert not multiprocessing.active_children()


def test_a_standby_that_dies_before_it_is_ready_keeps_the_old_worker(tmp_path, caplog):
  """A worker failing to start at its new quota (on the GPU: a CUDA context refused at that quota): the old worker
  is neither retired nor replaced, the group keeps its old quota, and the swap is recorded as failed."""
  cfg = _config(tmp_path, use_mps=True, sm_quotas='rollout=30,trainer=40', quota_schedule='3:rollout=40')

  class _Workers:
    rollout_quota = {'rollout/1': 40}
    use_processes = False
    swapped_in = []

    def swap_in(self, *args):
      self.swapped_in.append(args)

  class _Dead:

    def is_alive(self):
      return False

  workers = _Workers()
  changer = replan.QuotaChanger(cfg, workers, replan.ScheduleTrigger(cfg.resources.quota_changes, None))
  old_control, new_control = feedback.make_control(False, True), feedback.make_control(False, True)
  swap = replan._Swap(  # pylint: disable=protected-access
      1, object(), old_control, _Dead(), new_control, 30, 40, 100.0, 20_000.0, 1.0)
  changer.active.append(swap)
  with caplog.at_level('WARNING'):
    changer._advance(swap)  # pylint: disable=protected-access  (what poll does for each swap on)
  assert not changer.active and not workers.swapped_in and not old_control.retire.is_set()
  assert workers.rollout_quota['rollout/1'] == 30
  record = changer.swaps[-1]
  assert record['failed'] and record['group'] == 1 and record['new_quota'] == 40
  assert 'the warm standby at quota 40 % died before it was ready; keeping the old worker' in caplog.text
  assert 'the swap to quota 40 % failed' in caplog.text


def _store(cfg):
  """Sim saturates at 80 % of the SMs, training at 50 %; generation is cheap (hand-made samples)."""
  store = profiles.ProfileStore(autoplan.machine_key(), profile_keys.workload_key(cfg))
  for name, per_env, q_sat in (('sim', 2e-6, 80.0), ('generation', 1e-8, 1.0)):
    for e in (16, 32):
      for q in (20, 100):
        store.profile(name).add_sample(e, q, per_env * e * max(1.0, q_sat / q))
  steps = cfg.env_steps_per_iteration
  for q in (20, 100):
    for b in (steps // 2, steps):
      store.profile('train').add_sample(b, q, 1e-3 * b / steps * max(1.0, 50.0 / q))
  return store


class _FakeWorkers:
  """What the trigger reads: the workers' feedback slots (in-thread)."""

  def __init__(self, groups):
    self.controls = {f'rollout/{g}': feedback.make_control(False, False) for g in range(groups)}
    for control in self.controls.values():
      control.feedback[feedback.QUOTA] = 10  # as the workers read CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    self.trainer_feedback = feedback.Feedback(False)

  def iterate(self, collect_s, train_s, version):
    for control in self.controls.values():
      control.feedback.delivered(collect_s, version)
    self.trainer_feedback.delivered(train_s, version)


class _FakeChanger:

  def __init__(self):
    self.changes = []

  def change(self, quota, why):
    self.changes.append((quota, why))


def _trigger(tmp_path, hysteresis):
  cfg = _config(tmp_path,
                num_timesteps=1_280_000,
                use_mps=True,
                plan=True,
                replan=True,
                sm_quotas='rollout=10,trainer=50',
                replan_period_s=0.001,
                replan_hysteresis=hysteresis,
                replan_min_interval=0,
                replan_change_cost_s=0.0)
  store, workers = _store(cfg), _FakeWorkers(2)
  trigger = replan.ReplanTrigger(cfg, workers, store, replan.make_replanner(cfg, store), total_iterations=1000)
  return cfg, store, workers, trigger


def _feed(cfg, store, workers, trigger, changer, iterations):
  """Workers whose measured times agree with the profiles at rollout 10 % and trainer 50 %."""
  steps = cfg.env_steps_per_iteration // cfg.sim.num_envs
  collect_s = steps * (store['sim'].predict(16, 10) + store['generation'].predict(16, 10))
  train_s = store['train'].predict(cfg.env_steps_per_iteration, 50)
  for i in range(iterations):
    workers.iterate(collect_s, train_s, i + 1)
    time.sleep(0.002)
    trigger.poll(changer)


def test_replanner_changes_the_rollout_quota_when_it_pays(tmp_path):
  # At 10 % the sim runs 8x slower than at its 80 % saturation. Sync runs the trainer alone (its 50 % stays
  # pinned), so the 2 groups may take up to 50 % each: the best plan is rollout 50 %, 5x faster sim.
  cfg, store, workers, trigger = _trigger(tmp_path, hysteresis=0.10)
  changer = _FakeChanger()
  _feed(cfg, store, workers, trigger, changer, 3)
  space = autoplan.plan_space(cfg, mps_active=True)
  best = planner.plan(store, space, 'sync', {'num_groups': 2, 'trainer': 50})
  assert len(changer.changes) == 1 and changer.changes[0][0] == best.quotas['rollout'] == 50
  assert 'change:' in changer.changes[0][1]
  changed = [d for d in trigger.decisions if d['changed']]
  assert len(changed) == 1 and changed[0]['predicted_gain'] > 0.10
  assert changed[0]['quotas']['trainer'] == 50  # the trainer is never swapped
  # The measured times agreed with the model: the correction factors stayed near 1.
  assert store['sim'].params['correction'] == pytest.approx(1.0, rel=0.05)


def test_replanner_keeps_the_quota_within_hysteresis(tmp_path):
  cfg, store, workers, trigger = _trigger(tmp_path, hysteresis=1000.0)
  changer = _FakeChanger()
  _feed(cfg, store, workers, trigger, changer, 3)
  assert not changer.changes and trigger.decisions
  assert all(not d['changed'] and 'hysteresis' in d['reason'] for d in trigger.decisions)


@pytest.mark.parametrize('resources,message', [
    (dict(replan=True), '--replan .* needs --plan'),
    (dict(use_mps=True, quota_schedule='3:trainer=40'), 'only the rollout quota changes'),
    (dict(use_mps=True, quota_schedule='3:rollout=140'), r'quota in \[1, 100\] percent \(got 140\)'),
    (dict(use_mps=True, quota_schedule='x'), 'must read iteration:rollout=percent'),
    (dict(quota_schedule='3:rollout=40'), 'needs --use_mps'),
    (dict(use_mps=True, plan=True, replan=True, quota_schedule='3:rollout=40'), 'use one of them'),
])
def test_flag_errors_name_the_flag(resources, message):
  with pytest.raises(ValueError, match=message):
    config_lib.ResourceConfig(**resources)


@pytest.mark.parametrize('use_processes', [False, True], ids=['thread', 'shm'])
def test_feedback_slots_give_stage_seconds_and_the_recent_period(use_processes, monkeypatch):
  clock = iter([100.0, 101.0, 103.0])  # deliveries 1 s, then 2 s apart
  monkeypatch.setattr(feedback.time, 'time', lambda: next(clock))
  slots = feedback.Feedback(use_processes)
  for stage_s, iteration in ((0.5, 7), (0.25, 8), (0.75, 9)):
    slots.delivered(stage_s, iteration)
  snap = slots.snapshot()
  assert (snap.iterations, snap.stage_s, snap.first_t, snap.last_t, snap.last_iteration) == (3, 1.5, 100, 103, 9)
  assert snap.period_s == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)  # EMA (alpha 0.3) of 1 s then 2 s
  assert snap.stage_s_since(None) == 0.5
  assert replan.group_env_steps_per_s(snap, 640) == pytest.approx(640 / 1.3)
