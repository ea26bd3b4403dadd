"""`--slack_quotas`: slack-aware rollout quotas (Rose's second stage) on the warm-standby swaps of
`controller/replan.py`. The decisions are `resources.slack.SlackTuner`'s (pure, tested on synthetic timelines);
this module measures the timelines it decides on and applies its quotas.

NOTE: the timeline is reconstructed from the stage seconds each worker reports in its feedback slots (each
group's collect from 0, then the train step after the slowest group), not traced: enough for a sync or overlap
iteration's critical path at the role level, which is the level a quota acts on.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.controller import replan
from ebrl_jax.resources import slack
from ebrl_jax.runtime import feedback as fb


class SlackTrigger:
  """`--slack_quotas`: each look (every --replan_period_s) turns the stage seconds the workers reported since the
  last look into one iteration's timeline — each group's collect from 0, then the train step after the slowest —
  and hands it, with the measured seconds per trainer iteration, to a `resources.slack.SlackTuner`; its 'try'
  and 'revert' decisions become rollout-quota swaps. Only the rollout quota changes live (the trainer holds the
  train state and is never swapped), so only it is changeable. A trial counts looks, not iterations, and no look
  is taken while a swap is on."""
  mode = 'slack'

  def __init__(self, cfg: config_lib.Config, workers):
    self._workers, self._period = workers, cfg.resources.replan_period_s
    self._next_t = time.monotonic() + self._period
    self._base: Dict[int, fb.FeedbackSnapshot] = {}
    deps = {'train': tuple(f'collect/{g}' for g in range(cfg.schedule.num_groups))}
    self.tuner = slack.SlackTuner(start_quotas(cfg), ['rollout'],
                                  deps,
                                  step=cfg.resources.slack_step,
                                  trial_iterations=cfg.resources.slack_trial_iterations,
                                  min_gain=cfg.resources.replan_hysteresis / 5)
    self.decisions: List[dict] = []

  def _delta(self, feedback) -> Optional[tuple]:
    """(stage seconds per iteration, wall seconds per iteration) since the last look; the first look sets the
    baseline (the first iterations compile)."""
    snap, base = feedback.snapshot(), self._base.get(id(feedback))
    self._base[id(feedback)] = snap
    if base is None or snap.iterations <= base.iterations:
      return None
    n = snap.iterations - base.iterations
    return (snap.stage_s - base.stage_s) / n, (snap.last_t - base.last_t) / n

  def timeline(self) -> Optional[tuple]:
    """(seconds per trainer iteration, the reconstructed timeline) since the last look, or None."""
    collects = {}
    for role, control in self._workers.controls.items():
      delta = self._delta(control.feedback) if role.startswith('rollout/') else None
      if delta is not None:
        collects[role] = delta[0]
    trainer = self._delta(self._workers.trainer_feedback)
    if trainer is None or not collects:
      return None
    end = max(collects.values())
    spans = [slack.Span('collect/' + r.split('/')[1], r, 0.0, c) for r, c in sorted(collects.items())]
    return trainer[1], spans + [slack.Span('train', 'trainer', end, end + trainer[0])]

  def poll(self, changer: replan.QuotaChanger) -> None:
    if time.monotonic() < self._next_t or self.tuner.done:
      return
    self._next_t = time.monotonic() + self._period
    measured = self.timeline()
    if measured is None:
      return
    decision = self.tuner.step(replan.trainer_iteration(self._workers), *measured)
    if decision is None:
      return
    self.decisions.append(dataclasses.asdict(decision))
    logging.info('--slack_quotas: %s at iteration %d: %s', decision.action, decision.iteration, decision.reason)
    quota = decision.quotas.get('rollout')
    if decision.action in ('try', 'revert') and quota is not None and quota != changer.quota:
      changer.change(quota, f'--slack_quotas {decision.action}: {decision.reason}')

  def swapped(self, swaps) -> None:
    del swaps
    self._base.clear()  # new workers: new baselines, and the look after a swap only sets them


def start_quotas(cfg: config_lib.Config) -> Dict[str, int]:
  """The quotas the tuner starts from: --sm_quotas, with a rollout quota of 100 % (MPS's own default: no limit)
  where it gives none, so that `--slack_quotas` alone can take SMs from rollouts with slack. (Before, a run
  without a rollout quota kept its quotas with a warning: the H200's W2 overlap run of w2_slack_1gpu.json.)"""
  return dict({'rollout': 100}, **cfg.resources.quotas)


def make_changer(cfg: config_lib.Config, workers, mps_active: bool) -> Optional[replan.QuotaChanger]:
  """The quota changer of `--slack_quotas`, or None (with a warning) where the run's MPS daemon did not start."""
  if not mps_active:
    logging.warning('--slack_quotas: MPS is not running; the quotas stay as they are.')
    return None
  changer = replan.QuotaChanger(cfg, workers, SlackTrigger(cfg, workers))
  changer.quota = start_quotas(cfg)['rollout']
  return changer
