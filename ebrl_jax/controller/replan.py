"""Live rollout-quota changes of the process schedules: warm-standby swaps, `--replan` and `--quota_schedule`.

An SM quota (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) is fixed for the life of a process's CUDA context, so a quota
change means a new rollout process. Per env group, a change is a WARM STANDBY swap:
  1. a new rollout process for the group starts at the new quota (the role's next incarnation) and builds its
     envs and compiles with one throw-away collect (the persistent compilation cache helps), then sets `ready`
     and waits on `go`;
  2. once it is ready, the old worker is told to `retire`: it delivers the iteration it is collecting, then exits;
  3. once the old worker has exited, the standby gets the next iteration number and `go`.
Nothing is duplicated (records are keyed by (group, incarnation, iteration)) and nothing is lost: the old
worker's in-flight segment is delivered, the standby's warm-up segment is never sent. The cost of a change is
the group's gap: from the old worker's last segment to the new worker's first (`gap_s`), times the group's
measured env steps/s before the swap (`env_steps_lost`); a group's normal time between segments
(`period_before_s`) is part of the gap, so the excess over it is what the swap itself cost.
NOTE: the env group's state is reset in the new worker (its envs start new episodes); handing MJX or MuJoCo
state across processes is not done. Only rollout quotas change: the trainer holds the training state and is
never swapped, and the number of groups stays fixed for the run.

Triggers: `--quota_schedule` (at trainer iteration N, switch to quota Q; measures a change on demand),
`--slack_quotas` (controller/slack_quotas.py: `resources/slack.py` decides, each candidate validated end to end)
and `--replan` (every `--replan_period_s`, the measured stage times correct the store's profiles through `observe`
and a `planner.Replanner` with the trainer's quota and the group count pinned decides whether a change pays).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import planner
from ebrl_jax.runtime import feedback as fb

_JOIN_S = 10.0
_POLL_S, _SWAP_POLL_S = 0.5, 0.02
_KEEP_DECISIONS = 20  # 'keep' decisions kept in the summary (every change is kept)


def group_env_steps_per_s(snap: fb.FeedbackSnapshot, steps_per_iteration: float) -> Optional[float]:
  """A group's measured production rate: an iteration over the recent time between its segments (an EMA, so the
  first iterations, slowed by compiling, fade), else over its mean collect time; None before any segment."""
  if snap.period_s > 0:
    return steps_per_iteration / snap.period_s
  per = snap.stage_s_since(None)
  return steps_per_iteration / per if per else None


@dataclasses.dataclass
class _Swap:
  """One group's swap in progress (mutable: the phases advance as the controller polls)."""
  group: int
  old: object
  old_control: fb.WorkerControl
  new: object
  new_control: fb.WorkerControl
  old_quota: Optional[int]
  new_quota: int
  started_t: float
  rate_before: Optional[float]
  period_before_s: float
  phase: str = 'standby'  # -> 'retiring' -> 'running' -> done
  old_last_t: float = 0.0


class QuotaChanger:
  """Applies rollout-quota changes by warm-standby swaps and records them; `poll` runs on the watch loop."""

  def __init__(self, cfg: config_lib.Config, workers, trigger):
    self._cfg, self._workers, self._trigger = cfg, workers, trigger
    self._steps_per_group_iteration = cfg.env_steps_per_iteration / cfg.schedule.num_groups
    self.quota: Optional[int] = cfg.resources.quotas.get('rollout')
    self.active: List[_Swap] = []
    self.retired: List[object] = []
    self.swaps: List[dict] = []

  @property
  def busy(self) -> bool:
    return bool(self.active)

  def change(self, quota: int, why: str) -> None:
    """Starts one warm standby per group at `quota`."""
    logging.info('rollout quota %s -> %d %% (%s): starting a warm standby per group.', self.quota, quota, why)
    for g in range(self._cfg.schedule.num_groups):
      role = f'rollout/{g}'
      old, old_control = self._workers.workers[role], self._workers.controls[role]
      snap = old_control.feedback.snapshot()
      rate = group_env_steps_per_s(snap, self._steps_per_group_iteration)
      new, control = self._workers.start_rollout(g, quota=quota, standby=True)
      self.active.append(_Swap(g, old, old_control, new, control, self.quota, quota, time.time(), rate, snap.period_s))
      self._workers.rollout_quota[role] = quota
    self.quota = quota

  def poll(self) -> None:
    for swap in list(self.active):
      self._advance(swap)
    if not self.active:
      self._trigger.poll(self)
    # While a swap is on, the watch loop looks often: each phase waits on the previous one's event.
    self._workers.poll_s = _SWAP_POLL_S if self.active else _POLL_S

  def _advance(self, swap: _Swap) -> None:
    role = f'rollout/{swap.group}'
    if swap.phase == 'standby':
      if swap.new_control.ready.is_set():
        swap.old_control.retire.set()
        self._workers.swap_in(role, swap.new, swap.new_control)  # the watch loop now minds the standby
        self.retired.append(swap.old)
        swap.phase = 'retiring'
      elif not swap.new.is_alive():
        logging.warning('%s: the warm standby at quota %d %% died before it was ready; keeping the old worker.', role,
                        swap.new_quota)
        self._workers.rollout_quota[role] = swap.old_quota
        self._finish(swap, failed=True)
    elif swap.phase == 'retiring' and not swap.old.is_alive():
      old = swap.old_control.feedback.snapshot()
      swap.old_last_t = old.last_t or swap.started_t
      swap.new_control.feedback[fb.START_ITERATION] = old.last_iteration + 1 if old.iterations else 0
      swap.new_control.go.set()
      swap.phase = 'running'
    elif swap.phase == 'running':
      new = swap.new_control.feedback.snapshot()
      if new.iterations >= 1:
        self._finish(swap, first_t=new.first_t, ready_t=new.ready_t, quota_seen=new.quota)
      elif not swap.new.is_alive():  # died after go: the watch loop restarts it; the swap itself is over
        self._finish(swap, failed=True)

  def _finish(self,
              swap: _Swap,
              failed: bool = False,
              first_t: float = 0.0,
              ready_t: float = 0.0,
              quota_seen: float = 0.0) -> None:
    self.active.remove(swap)
    gap = first_t - swap.old_last_t if not failed else float('nan')
    lost = gap * swap.rate_before if swap.rate_before is not None else float('nan')
    record = {
        'group': swap.group,
        'old_quota': swap.old_quota,
        'new_quota': swap.new_quota,
        'standby_ready_s': ready_t - swap.started_t if ready_t else float('nan'),
        'gap_s': gap,
        'env_steps_lost': lost,
        'env_steps_per_s_before': swap.rate_before,
        'period_before_s': swap.period_before_s,
        'quota_seen_by_worker': int(quota_seen),
        'failed': failed
    }
    self.swaps.append(record)
    if failed:
      logging.warning('rollout/%d: the swap to quota %d %% failed in its %s phase.', swap.group, swap.new_quota,
                      swap.phase)
    else:
      logging.info('rollout/%d swapped to quota %d %%: standby ready in %.2f s, gap %.2f s, %.0f env steps lost.',
                   swap.group, swap.new_quota, record['standby_ready_s'], gap, lost)
    if not self.active:
      self._trigger.swapped(self.swaps[-self._cfg.schedule.num_groups:])

  def close(self) -> None:
    """Stops what a swap left running (retired workers still delivering, standbys) after the run's stop."""
    join_or_kill(self.retired + [s.new for s in self.active if s.phase == 'standby'], self._workers.use_processes)

  def record(self, now: Optional[float] = None) -> dict:
    """The decisions, the finished swaps, and any swap the run's end cut short ('pending': its phase, e.g. a
    standby still building, and how long it had been on)."""
    now = time.time() if now is None else now
    pending = [{
        'group': s.group,
        'new_quota': s.new_quota,
        'phase': s.phase,
        'elapsed_s': now - s.started_t
    } for s in self.active]
    return {'mode': self._trigger.mode, 'decisions': self._trigger.decisions, 'swaps': self.swaps, 'pending': pending}


def join_or_kill(pending, use_processes: bool) -> None:
  """Waits up to _JOIN_S in all for the workers a live change left running, then kills the processes still alive."""
  deadline = time.monotonic() + _JOIN_S
  for w in pending:
    w.join(timeout=max(0.1, deadline - time.monotonic()))
    if use_processes and w.is_alive():
      w.kill()
      w.join(timeout=2.0)


def trainer_iteration(workers) -> int:
  """The trainer's policy version as it reported it last (0 before the first train step)."""
  snap = workers.trainer_feedback.snapshot()
  return int(snap.last_iteration) if snap.iterations else 0


class ScheduleTrigger:
  """`--quota_schedule`: at trainer iteration N, switch the rollout quota to Q."""
  mode = 'quota_schedule'

  def __init__(self, changes, workers):
    self._pending, self._workers = list(changes), workers
    self.decisions: List[dict] = []

  def poll(self, changer: QuotaChanger) -> None:
    iteration = trainer_iteration(self._workers)
    if self._pending and iteration >= self._pending[0][0]:
      at, quota = self._pending.pop(0)
      reason = f'--quota_schedule: rollout={quota} at iteration {at} (trainer at {iteration})'
      self.decisions.append({'iteration': iteration, 'changed': True, 'quota': quota, 'reason': reason})
      changer.change(quota, reason)

  def swapped(self, swaps) -> None:
    del swaps


class ReplanTrigger:
  """`--replan`: corrects the profiles with measured stage times and asks a Replanner whether a change pays."""
  mode = 'replan'

  def __init__(self, cfg: config_lib.Config, workers, store, replanner: planner.Replanner, total_iterations: int):
    self._cfg, self._workers, self._store, self.replanner = cfg, workers, store, replanner
    self._total = total_iterations
    self._period = cfg.resources.replan_period_s
    self._next_t = time.monotonic() + self._period
    self._base: Dict[int, fb.FeedbackSnapshot] = {}  # id(feedback) -> snapshot at the last look
    self._steps = cfg.env_steps_per_iteration // cfg.sim.num_envs
    self.decisions: List[dict] = []

  def _delta(self, feedback) -> Optional[tuple]:
    """(stage seconds per iteration, wall seconds per iteration) since the last look at this worker; the first
    delivered iteration (it compiles) only sets the baseline."""
    snap, base = feedback.snapshot(), self._base.get(id(feedback))
    if snap.iterations < 1:
      return None
    self._base[id(feedback)] = snap
    if base is None or snap.iterations <= base.iterations:
      return None
    n = snap.iterations - base.iterations
    return (snap.stage_s - base.stage_s) / n, (snap.last_t - base.last_t) / n

  def observe(self) -> Optional[float]:
    """Feeds every worker's new stage times into the profiles; returns the trainer's seconds per iteration."""
    plan = self.replanner.plan
    e = plan.envs_per_group
    for control in self._workers.controls.values():
      delta = self._delta(control.feedback)
      if delta is None:
        continue
      quota = control.feedback[fb.QUOTA] or plan.quotas[planner.ROLLOUT]
      per_step = delta[0] / self._steps
      if plan.colocate_generation and 'generation' in self._store:
        per_step -= self._store['generation'].predict(e, quota)
      if per_step > 0:
        self._store['sim'].observe(e, quota, per_step)
    delta = self._delta(self._workers.trainer_feedback)
    if delta is None:
      return None
    self._store['train'].observe(self.replanner.space.effective_train_batch, plan.quotas[planner.TRAINER], delta[0])
    return delta[1]

  def poll(self, changer: QuotaChanger) -> None:
    if time.monotonic() < self._next_t:
      return
    self._next_t = time.monotonic() + self._period
    measured_s = self.observe()
    iteration = trainer_iteration(self._workers)
    new = self.replanner.update(self._store, iteration, measured_s, max(0, self._total - iteration))
    self.decisions.append(decision_record(self.replanner.decisions[-1]))
    self.decisions = _trim(self.decisions)
    if new is not None:
      changer.change(new.quotas[planner.ROLLOUT], self.replanner.decisions[-1].reason)

  def swapped(self, swaps) -> None:
    """A measured change cost replaces the assumed one (the slowest group's gap stalls the trainer)."""
    gaps = [s['gap_s'] for s in swaps if not s['failed']]
    if gaps:
      self.replanner.change_cost_s = max(gaps)
    self._base.clear()  # new workers: new baselines


def decision_record(d: planner.Decision) -> dict:
  return {
      'iteration': d.iteration,
      'changed': d.changed,
      'quotas': dict(d.plan.quotas),
      'current_s': d.current_s,
      'best_s': d.best_s,
      'predicted_gain': d.predicted_gain,
      'measured_s': d.measured_s,
      'measured_gain': d.measured_gain,
      'reason': d.reason
  }


def _trim(decisions: List[dict]) -> List[dict]:
  keeps = [i for i, d in enumerate(decisions) if not d['changed']]
  drop = set(keeps[:-_KEEP_DECISIONS])
  return [d for i, d in enumerate(decisions) if i not in drop]


def make_replanner(cfg: config_lib.Config, store, start_iteration: int = 0) -> planner.Replanner:
  """A Replanner over `--plan`'s space with the group count and every quota but the rollout's pinned, starting
  from the plan the run was started with (cfg is the planned config)."""
  space = autoplan.plan_space(cfg, mps_active=True)
  quotas = dict(cfg.resources.quotas)
  fixed = {'num_groups': cfg.schedule.num_groups, planner.TRAINER: quotas[planner.TRAINER]}
  if not cfg.schedule.colocate_generation:
    fixed[planner.GENERATION] = quotas[planner.GENERATION]
  schedule = 'async' if cfg.schedule.name == 'async' else 'sync'  # overlap plans as sync (its semantics)
  initial = planner.evaluate(store, space, cfg.schedule.num_groups, quotas, schedule)
  r = cfg.resources
  return planner.Replanner(space,
                           schedule,
                           fixed,
                           plan=initial,
                           hysteresis=r.replan_hysteresis,
                           min_interval_iterations=r.replan_min_interval,
                           change_cost_s=r.replan_change_cost_s,
                           start_iteration=start_iteration)


def make_changer(cfg: config_lib.Config, workers, plan_record: Optional[dict],
                 mps_active: bool) -> Optional[QuotaChanger]:
  """The live quota changer the flags ask for, or None. `cfg` is the config the run goes on with."""
  if cfg.resources.quota_changes:
    return QuotaChanger(cfg, workers, ScheduleTrigger(cfg.resources.quota_changes, workers))
  if not cfg.resources.replan:
    return None
  if not mps_active or plan_record is None or 'rollout' not in cfg.resources.quotas:
    why = ('MPS is not running' if not mps_active else
           'no --plan record' if plan_record is None else 'the plan runs without quotas (SMs shared)'
           if plan_record.get('shared') else 'the rollout workers hold no quota')
    logging.warning('--replan: no rollout quota to re-plan (%s); the quotas stay as planned.', why)
    return None
  store = autoplan.load_store(cfg, plan_record['profile_store'])
  total = -(-cfg.schedule.num_timesteps // cfg.env_steps_per_iteration)
  return QuotaChanger(cfg, workers, ReplanTrigger(cfg, workers, store, make_replanner(cfg, store), total))
