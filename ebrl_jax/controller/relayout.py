"""Live changes of the env-group layout (`--group_schedule`, `--replan_groups`): the number of env groups, and with
it the envs per group and the shape every rollout worker collects, changed while the run goes on.

The segments travel in fixed env blocks (`ScheduleConfig.block_count`: num_envs / lcm of every layout's group
count envs each; a group of E envs puts E / block records per iteration, numbered by block), so the trainer takes
the same records, in the same env order, whatever the layout. A change from G to G' groups:
  1. G' warm standbys start in the new layout (each builds its envs and compiles with one throw-away collect)
     while the G old workers go on collecting;
  2. once every standby is ready, the changer picks the boundary iteration M = v + bound + 2 (v: the published
     version; no worker can be at an iteration past v + bound, the staleness gate) and writes it as every old
     worker's RETIRE_AT; it reads the version again, and if the trainer moved two versions meanwhile it picks M
     again, so no old worker has started an iteration >= M. The old workers deliver every iteration < M, then
     exit; the standbys are now the watched workers;
  3. once every old worker has exited, the standbys get START_ITERATION = M and `go`.
Every block of every iteration is delivered once: the old layout's below M, the new one's from M. The cost is the
pause between the old layout's last segment and the new one's first (`pause_s`), times the rate before the change
(`env_steps_lost`); the trainer's iteration period before and after the change is the measured gain (a manual
change has no predicted one; a re-planned one, controller/group_replan.py, has its decision's). NOTE: every env
of the run starts new episodes at the change (env state is not handed across processes), as in a quota swap. An
old worker that dies before delivering its iterations below M stops the run (those blocks cannot be made again in
the old layout): the run ends cleanly with its checkpoint.
Under MPS the new layout's rollout quota keeps the rollout's total share: q' = q G / G' (at least 1 %).
Who asks for a change is the changer's trigger: `GroupScheduleTrigger` (--group_schedule: at trainer iteration N,
G groups) or `group_replan.GroupReplanTrigger` (--replan_groups: from measured windows).
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.controller import group_replan
from ebrl_jax.controller import replan
from ebrl_jax.resources import group_replanner
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import feedback as fb

_POLL_S, _CHANGE_POLL_S = 0.5, 0.02


@dataclasses.dataclass
class _Change:
  """One change in progress (mutable: its phases advance as the controller polls)."""
  old_groups: int
  new_groups: int
  reason: str
  predicted_gain: Optional[float]
  rollout_cfg: object
  quota: Optional[int]
  standbys: list  # [(worker, control)] in group order
  started_t: float
  rate_before: Optional[float]
  period_before_s: float
  old: list = dataclasses.field(default_factory=list)  # [(role, worker, control)] of the old layout
  boundary: int = 0
  phase: str = 'standby'  # -> 'retiring' -> 'running' -> done
  old_last_t: float = 0.0


class GroupScheduleTrigger:
  """`--group_schedule`: at trainer iteration N, switch to G groups."""
  mode = 'group_schedule'

  def __init__(self, changes, workers):
    self._pending, self._workers = list(changes), workers
    self.decisions: List[dict] = []

  def poll(self, changer: 'GroupChanger') -> None:
    if self._pending and replan.trainer_iteration(self._workers) >= self._pending[0][0]:
      at, groups = self._pending.pop(0)
      if groups != self._workers.num_groups:
        changer.start(groups, f'--group_schedule: groups={groups} at iteration {at}')

  def changed(self, change: dict) -> None:
    del change


class GroupChanger:
  """Applies the trigger's changes on the watch loop (`poll`) and records them (`record`)."""

  def __init__(self, cfg: config_lib.Config, workers, trigger):
    self._cfg, self._workers, self._trigger = cfg, workers, trigger
    self._bound = cfg.schedule.staleness_bound
    self.active: Optional[_Change] = None
    self.changes: List[dict] = []
    self.retired: list = []

  def poll(self) -> None:
    if self.active is not None:
      self._advance(self.active)
    else:
      self._trigger.poll(self)
    self._workers.poll_s = _CHANGE_POLL_S if self.active is not None else _POLL_S

  def _rates(self):
    """(env steps/s of the current layout's groups together, or None; the trainer's iteration period)."""
    per_group = self._cfg.env_steps_per_iteration / self._workers.num_groups
    rates = [
        replan.group_env_steps_per_s(self._workers.controls[f'rollout/{g}'].feedback.snapshot(), per_group)
        for g in range(self._workers.num_groups)
    ]
    total = sum(rates) if all(r is not None for r in rates) else None
    return total, self._workers.trainer_feedback.snapshot().period_s

  def start(self, groups: int, reason: str, predicted_gain: Optional[float] = None) -> None:
    """Step 1 of the module's docstring: the new layout's warm standbys start beside the running workers."""
    workers, old_groups = self._workers, self._workers.num_groups
    rollout_cfg = dataclasses.replace(workers.rollout_cfg, group_envs=self._cfg.sim.num_envs // groups)
    quota = workers.rollout_quota.get('rollout/0', self._cfg.resources.quotas.get('rollout'))
    new_quota = group_replanner.quota_for(quota, old_groups, groups)  # the rollout's total share kept
    logging.info('env groups %d -> %d (%s): starting %d warm standbys of %d envs%s.', old_groups, groups, reason,
                 groups, rollout_cfg.group_envs, f' at quota {new_quota} %' if new_quota else '')
    rate, period = self._rates()
    standbys = [workers.start_rollout(g, quota=new_quota, standby=True, rollout_cfg=rollout_cfg) for g in range(groups)]
    self.active = _Change(old_groups, groups, reason, predicted_gain, rollout_cfg, new_quota, standbys, time.time(),
                          rate, period)

  def _advance(self, change: _Change) -> None:
    workers = self._workers
    if change.phase == 'standby':
      if any(not w.is_alive() for w, _ in change.standbys):
        logging.warning('a warm standby for %d groups died before it was ready; keeping %d groups.', change.new_groups,
                        change.old_groups)
        for _, control in change.standbys:  # the others exit now, not at the run's end (their envs, their memory)
          control.retire.set()
        self.retired += [w for w, _ in change.standbys]
        self._finish(change, failed=True)
      elif all(c.ready.is_set() for _, c in change.standbys):
        self._retire_old(change)
    elif change.phase == 'retiring':
      for role, w, control in change.old:
        delivered = control.feedback.snapshot()
        if not w.is_alive() and (delivered.last_iteration < change.boundary - 1 or not delivered.iterations):
          raise errors.WorkerFailure(f'{role} (pid {getattr(w, "pid", None)}) exited with code '
                                     f'{getattr(w, "exitcode", None)} during the change to {change.new_groups} env '
                                     f'groups before delivering its iterations below {change.boundary}; stopping.',
                                     stopped=errors.WORKER_FAILED)  # the trainer still sends its summary so far
      if all(not w.is_alive() for _, w, _ in change.old):
        change.old_last_t = max(c.feedback.snapshot().last_t for _, _, c in change.old)
        for control in self._new_controls(change):
          control.feedback[fb.START_ITERATION] = change.boundary
          if control.go is not None:  # (a standby that died once swapped in was restarted as a plain worker)
            control.go.set()
        change.phase = 'running'
    elif change.phase == 'running':
      snaps = [c.feedback.snapshot() for c in self._new_controls(change)]
      if all(s.iterations >= 1 for s in snaps):
        self._finish(change, first_t=min(s.first_t for s in snaps))

  def _new_controls(self, change: _Change) -> list:
    """The controls of the new layout's roles now: a swapped-in standby's, or its restart's (the watch loop restarts
    one that died, from its START_ITERATION, the boundary)."""
    return [self._workers.controls[f'rollout/{g}'] for g in range(change.new_groups)]

  def _retire_old(self, change: _Change) -> None:
    """Step 2 of the module's docstring: the boundary, the old workers' RETIRE_AT, the standbys watched."""
    workers = self._workers
    change.old = [(f'rollout/{g}', workers.workers[f'rollout/{g}'], workers.controls[f'rollout/{g}'])
                  for g in range(change.old_groups)]
    version = workers.store.version()
    while True:
      change.boundary = version + self._bound + 2
      for _, _, control in change.old:
        control.feedback[fb.RETIRE_AT] = change.boundary
      now = workers.store.version()
      if now < version + 2:
        break
      version = now
    for role, w, _ in change.old:
      self.retired.append(w)
      if int(role.split('/')[1]) >= change.new_groups:
        workers.drop_role(role)
    for g, (w, control) in enumerate(change.standbys):
      control.feedback[fb.START_ITERATION] = change.boundary  # where a restart of it would start (supervisor)
      workers.swap_in(f'rollout/{g}', w, control)
      if change.quota is not None:
        workers.rollout_quota[f'rollout/{g}'] = change.quota
    workers.num_groups, workers.rollout_cfg = change.new_groups, change.rollout_cfg
    change.phase = 'retiring'
    logging.info('env groups %d -> %d: standbys ready in %.2f s; the old layout delivers iterations below %d.',
                 change.old_groups, change.new_groups,
                 time.time() - change.started_t, change.boundary)

  def _finish(self, change: _Change, failed: bool = False, first_t: float = 0.0) -> None:
    self.active = None
    pause = first_t - change.old_last_t if not failed else float('nan')
    lost = pause * change.rate_before if change.rate_before is not None else float('nan')
    self.changes.append({
        'reason': change.reason,
        'old_groups': change.old_groups,
        'new_groups': change.new_groups,
        'envs_per_group': change.rollout_cfg.group_envs,
        'quota': change.quota,
        'boundary_iteration': change.boundary,
        # Until every standby was ready (the layout can change only then; the run's first such figures, e.g.
        # experiments/results/relayout_cpu.json, took the first standby's).
        'standbys_ready_s': (max(c.feedback.snapshot().ready_t for _, c in change.standbys) -
                             change.started_t if not failed else float('nan')),
        'pause_s': pause,
        'env_steps_lost': lost,
        'env_steps_per_s_before': change.rate_before,
        'trainer_period_before_s': change.period_before_s,
        'predicted_gain': change.predicted_gain,  # None: a manual change (--group_schedule)
        'failed': failed
    })
    self._trigger.changed(self.changes[-1])
    if not failed:
      logging.info('env groups %d -> %d done: pause %.2f s, %.0f env steps lost.', change.old_groups, change.new_groups,
                   pause, lost)

  def close(self) -> None:
    """Stops what a change left running (old workers still delivering, standbys never swapped in)."""
    pending = list(self.retired)
    if self.active is not None and self.active.phase == 'standby':
      pending += [w for w, _ in self.active.standbys]
    replan.join_or_kill(pending, self._workers.use_processes)

  def record(self) -> dict:
    """Every change (its cost, and the trainer's iteration period after it: the measured gain), and one the
    run's end cut short."""
    period_now = self._workers.trainer_feedback.snapshot().period_s
    for i, c in enumerate(self.changes):  # the period until the next change (or the end): the change's outcome
      after = period_now if i == len(self.changes) - 1 else self.changes[i + 1]['trainer_period_before_s']
      c['trainer_period_after_s'] = after
      before = c['trainer_period_before_s']
      c['measured_gain'] = before / after - 1 if before and after else None
    pending = None if self.active is None else {'new_groups': self.active.new_groups, 'phase': self.active.phase}
    out = {'mode': self._trigger.mode, 'changes': self.changes, 'pending': pending}
    if self._trigger.mode != 'group_schedule':
      out['decisions'] = self._trigger.decisions
      out['keep_decisions_left_out'] = self._trigger.replanner.left_out
      out['generation_buckets'] = group_replan.BUCKETS_NOTE
    return out


def make_changer(cfg: config_lib.Config,
                 workers,
                 plan_record: Optional[dict] = None,
                 mps_active: bool = False) -> Optional[GroupChanger]:
  """The live group changer the flags ask for (--group_schedule, --replan_groups), or None."""
  if cfg.schedule.group_changes:
    return GroupChanger(cfg, workers, GroupScheduleTrigger(cfg.schedule.group_changes, workers))
  if cfg.schedule.replan_groups:
    return GroupChanger(cfg, workers, group_replan.make_trigger(cfg, workers, plan_record, mps_active))
  return None
