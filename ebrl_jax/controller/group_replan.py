"""`--replan_groups`: the re-planner changes the number of env groups (and with it the envs per group) while the
run goes on, from measured step times; controller/relayout.py's GroupChanger applies each change.

The trigger measures windows of `--replan_window` trainer iterations of the layout in force (after the start and
after each change one iteration is skipped: it holds compiles and the new layout's first segments), each from the
feedback slots the workers write: the run's env steps/s (trainer iterations over their wall time), every group's
collect seconds per iteration and the trainer's train seconds per iteration. After each window the pure
`resources.group_replanner.GroupReplanner` decides (its docstring: candidates, margin, payback); a change goes to
the GroupChanger with its predicted gain, and its cost and measured gain are recorded in the decision
(`summary.extra.relayout.decisions`).

Generation batch buckets do not change live: see BUCKETS_NOTE.
"""
from __future__ import annotations

from typing import Dict, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import group_replanner

BUCKETS_NOTE = ('not changed live: the generation worker compiles, at its start, one act program for every bucket '
                'from the slice size up to all envs in powers of two, so any mix of ready slices already has its '
                'bucket; the slice size is the shape of the mailbox records in shared memory, made once per run; '
                'and env-group changes need co-located generation (a separate worker serves a fixed set of groups)')


class GroupReplanTrigger:
  """Measures windows of the layout in force and asks the GroupReplanner after each (see the module docstring)."""
  mode = 'replan_groups'

  def __init__(self, cfg: config_lib.Config, workers, replanner: group_replanner.GroupReplanner, total_iterations: int):
    self._cfg, self._workers, self.replanner = cfg, workers, replanner
    self._window, self._total = cfg.resources.replan_window, total_iterations
    self._start_at = 1  # the trainer iterations after which the next window may start (1: skip the compile)
    self._base = None  # (trainer snapshot, {id(control): rollout snapshot}) at the window's start
    self.decisions = replanner.decisions

  def _rollouts(self) -> Dict[int, object]:
    controls = [self._workers.controls.get(f'rollout/{g}') for g in range(self._workers.num_groups)]
    return {id(c): c.feedback.snapshot() for c in controls if c is not None}

  def _measure(self, trainer, rollouts) -> Optional[group_replanner.Window]:
    base_trainer, base_rollouts = self._base
    n = int(trainer.iterations - base_trainer.iterations)
    seconds = trainer.last_t - base_trainer.last_t
    if seconds <= 0:
      return None
    collects = []
    for key, snap in rollouts.items():
      mean = snap.stage_s_since(base_rollouts.get(key)) if key in base_rollouts else None
      if mean is not None:
        collects.append(mean)
    train = trainer.stage_s_since(base_trainer)
    quota = self._workers.rollout_quota.get('rollout/0', self._cfg.resources.quotas.get('rollout'))
    return group_replanner.Window(groups=self._workers.num_groups,
                                  iterations=n,
                                  seconds=seconds,
                                  env_steps_per_s=self._cfg.env_steps_per_iteration * n / seconds,
                                  collect_s=sum(collects) / len(collects) if collects else None,
                                  train_s=train,
                                  rollout_quota=quota)

  def poll(self, changer) -> None:
    trainer = self._workers.trainer_feedback.snapshot()
    if self._start_at is None:  # a change of ours is on (the changer calls `changed` when it is over)
      return
    if self._base is None:
      if trainer.iterations >= self._start_at:
        self._base = (trainer, self._rollouts())
      return
    if trainer.iterations - self._base[0].iterations < self._window:
      return
    rollouts = self._rollouts()
    window = self._measure(trainer, rollouts)
    self._base = (trainer, rollouts)
    if window is None:
      return
    self.replanner.observe(window)
    iteration = int(trainer.last_iteration)
    remaining_s = max(0, self._total - iteration) * window.seconds / window.iterations
    decision = self.replanner.decide(iteration, remaining_s)
    if decision['changed']:
      self._base, self._start_at = None, None
      changer.start(decision['new_groups'], decision['reason'], predicted_gain=decision['predicted_gain'])

  def changed(self, change: dict) -> None:
    """The changer finished a change: its cost into the decision; the next window starts one iteration on."""
    self.replanner.changed(change)
    self._start_at = self._workers.trainer_feedback.snapshot().iterations + 1


def make_trigger(cfg: config_lib.Config, workers, plan_record: Optional[dict], mps_active: bool) -> GroupReplanTrigger:
  """The trigger of `--replan_groups`: over `--plan`'s profile store where the run was planned, else over the
  profiles the run measures itself."""
  store = None
  if plan_record is not None:
    store = autoplan.load_store(cfg, plan_record['profile_store'])
    if not all(name in store for name in ('sim', 'train')):
      logging.warning('--replan_groups: the --plan store %s lacks a sim or train profile; measuring in the run.',
                      plan_record['profile_store'])
      store = None
  schedule = cfg.schedule
  candidates = tuple(sorted(set(schedule.replan_groups) | {schedule.num_groups}))
  space = autoplan.plan_space(cfg, mps_active, num_groups=candidates, quotas=(100,))  # --plan's, over the candidates
  quotas = cfg.resources.quotas if mps_active else {}
  r = cfg.resources
  replanner = group_replanner.GroupReplanner(space,
                                             'async' if schedule.name == 'async' else 'sync',
                                             candidates,
                                             trainer_quota=quotas.get('trainer'),
                                             store=store,
                                             margin=r.replan_hysteresis,
                                             horizon_s=r.replan_horizon_s,
                                             assumed_pause_s=r.replan_group_change_cost_s)
  logging.info(
      '--replan_groups: candidates %s groups, windows of %d iterations, margin %.0f%%, horizon %.0f s, '
      'profiles %s.', candidates, r.replan_window, 100 * r.replan_hysteresis, r.replan_horizon_s,
      'from --plan' if store is not None else 'measured in the run')
  total = -(-schedule.num_timesteps // cfg.env_steps_per_iteration)
  return GroupReplanTrigger(cfg, workers, replanner, total)
