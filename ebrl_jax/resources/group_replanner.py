"""Live env-group re-planning (`--replan_groups`): from measured windows, whether another group count pays.

A window is `--replan_window` trainer iterations of one layout (G groups of E = num_envs / G envs): the run's
env steps/s over them (the trainer's iterations over their wall time), each group's collect seconds per iteration
and the trainer's train seconds per iteration. A window feeds the stage profiles: with `--plan`'s store, each
profile's correction (`StageProfile.observe`, as the quota re-planner does); without one, the window's times are
the samples of an in-run store ('sim' per env step at (E, the rollout quota), 'train' at the training batch), so
each layout the run measured is one more point of the fit (one size measured: time proportional to size, the
profiles' conservative default, `fit_note` says so and goes into every decision).

Each candidate group count G (the --replan_groups and the run's own) is predicted as
  measured  the mean rate of G's windows, if the run has measured G (what was seen beats what is modelled; the
            mean, since one window on a busy machine can be off by tens of per cent);
  model     else the current layout's measured rate times planner.evaluate(current).iteration_s /
            evaluate(G).iteration_s (the planner's iteration model on the profiles; offsets the model does not
            know, such as hand-off time, cancel in the ratio). Under MPS the rollout quota follows the changer's rule q' = q G / G'.
The best candidate (ties: the current layout, then fewer groups) replaces the layout when
  (1) its predicted gain over the current layout's measured rate, r' / r - 1, exceeds `margin`, and
  (2) it pays back its cost within the horizon H = min(horizon_s, the run's remaining seconds): its standbys take
      s seconds to build beside the running layout (the last measured change's; before any, unknown and counted
      as 0: a change the run's end cuts short costs only the standbys' work), then during the pause p (the last
      measured change's pause between the old layout's last segment and the new one's first; `assumed_pause_s`
      before any) nothing is produced, so the change has caught up with staying t = p r' / (r' - r) after the
      standbys are ready; it needs s + t <= H.
Every decision, kept or changed (the latest KEEP_DECISIONS 'keep' ones), is recorded with each candidate's prediction and its source and the reason;
a change's record gets its cost (standby seconds, pause, env steps lost) when the change finishes and its
measured gain (the new layout's first window over the rate before) when that window ends. A layout whose
standbys failed is not proposed again.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence

from absl import logging

from ebrl_jax.resources import planner
from ebrl_jax.resources import profiles

KEEP_DECISIONS = 20  # 'keep' decisions kept in the record, the latest (every change's is kept)


@dataclasses.dataclass(frozen=True)
class Window:
  """What one measured window of a layout saw."""
  groups: int
  iterations: int  # trainer iterations in the window
  seconds: float  # their wall time
  env_steps_per_s: float
  collect_s: Optional[float]  # mean over the groups of collect seconds per iteration (None: none measured)
  train_s: Optional[float]  # train seconds per iteration (None: none measured)
  rollout_quota: Optional[int] = None  # each rollout worker's SM quota (None: none)


def quota_for(quota: Optional[int], groups: int, new_groups: int) -> Optional[int]:
  """The rollout quota of a new layout: the rollout's total share kept, q' = q G / G' (at least 1 %)."""
  return max(1, quota * groups // new_groups) if quota else None


class GroupReplanner:
  """Decides, window by window, whether to change the number of env groups (see the module docstring)."""

  def __init__(self,
               space: planner.PlanSpace,
               schedule: str,
               candidates: Sequence[int],
               trainer_quota: Optional[int] = None,
               store: Optional[Mapping[str, profiles.StageProfile]] = None,
               margin: float = 0.05,
               horizon_s: float = 60.0,
               assumed_pause_s: float = 8.0):  # --replan_group_change_cost_s's default (config_resources.py)
    if margin < 0 or horizon_s <= 0 or assumed_pause_s < 0:
      raise ValueError(f'GroupReplanner: margin ({margin}) and assumed_pause_s ({assumed_pause_s}) must be >= 0 and '
                       f'horizon_s ({horizon_s}) > 0.')
    self.space, self.schedule = space, schedule
    self.candidates = tuple(sorted(set(candidates)))
    self.trainer_quota = trainer_quota
    self.calibrated = store is not None
    self.store = store if store is not None else profiles.ProfileStore('in-run', 'in-run')
    self.margin, self.horizon_s, self.assumed_pause_s = margin, horizon_s, assumed_pause_s
    self.pause_s: Optional[float] = None  # the last measured change's pause
    self.standby_s: Optional[float] = None  # the last measured change's standby build time (None: 0 is counted)
    self.measured: Dict[int, List[float]] = {}  # groups -> env steps/s of each of its windows
    self.failed: Dict[int, str] = {}  # groups -> why its change failed
    self.decisions: List[dict] = []
    self.left_out = 0  # older 'keep' decisions left out of `decisions`
    self.window: Optional[Window] = None
    self._awaiting: Optional[dict] = None  # the decision of a change whose outcome window has not ended

  def observe(self, window: Window) -> Optional[dict]:
    """Feeds a window into the profiles and the measured rates; returns the decision whose outcome it measured
    (the first window of a changed layout), else None."""
    e, steps = self.space.num_envs // window.groups, self.space.steps_per_iteration
    q_r = window.rollout_quota or 100
    if window.collect_s:
      per_step = window.collect_s / steps
      if self.calibrated and self.space.colocate_generation and 'generation' in self.store:
        per_step -= self.store['generation'].predict(e, q_r)  # the model adds it back
      if per_step > 0:
        self._feed('sim', e, q_r, per_step)
    if window.train_s:
      self._feed('train', self.space.effective_train_batch, self.trainer_quota or 100,
                 window.train_s / self.space.train_calls_per_iteration)
    self.measured.setdefault(window.groups, []).append(window.env_steps_per_s)
    self.window = window
    done, self._awaiting = self._awaiting, None
    if done is None or done['new_groups'] != window.groups:
      return None
    done['measured_env_steps_per_s'] = window.env_steps_per_s
    done['measured_gain'] = window.env_steps_per_s / done['env_steps_per_s'] - 1
    logging.info(
        'env groups %d -> %d: predicted %+.1f%%, measured %+.1f%% (%.0f -> %.0f env steps/s over %d '
        'iterations).', done['groups'], done['new_groups'], 100 * done['predicted_gain'], 100 * done['measured_gain'],
        done['env_steps_per_s'], window.env_steps_per_s, window.iterations)
    return done

  def _feed(self, name: str, batch: int, quota: float, seconds: float) -> None:
    if self.calibrated:
      self.store[name].observe(batch, quota, seconds)
    else:
      self.store.profile(name).add_sample(batch, quota, seconds)

  def _iteration_s(self, groups: int) -> float:
    current = self.window
    quotas = {planner.TRAINER: self.trainer_quota or 100}
    q = quota_for(current.rollout_quota, current.groups, groups)
    if q is not None:
      quotas[planner.ROLLOUT] = q
    shared = q is None or self.trainer_quota is None  # no quotas: every process may use every SM
    return planner.evaluate(self.store, self.space, groups, quotas, self.schedule, shared=shared).iteration_s

  def rate(self, groups: int) -> float:
    """The measured env steps/s of a layout: the mean over its windows."""
    rates = self.measured[groups]
    return sum(rates) / len(rates)

  def predictions(self) -> Dict[int, dict]:
    """Each candidate's predicted env steps/s and where it came from, against the current layout's rate."""
    current = self.window
    rate, now_s = self.rate(current.groups), self._iteration_s(current.groups)
    out = {}
    for g in self.candidates:
      if g in self.failed:
        continue
      if g in self.measured:
        windows = len(self.measured[g])
        out[g] = {'env_steps_per_s': self.rate(g), 'source': f'measured over {windows} window(s)'}
      else:
        out[g] = {'env_steps_per_s': rate * now_s / self._iteration_s(g), 'source': 'model'}
      out[g]['gain'] = out[g]['env_steps_per_s'] / rate - 1
    return out

  def decide(self, iteration: int, remaining_s: Optional[float] = None) -> dict:
    """The decision after the latest window (call `observe` first): a record with `changed` and, for a change,
    `new_groups`."""
    current = self.window
    if current is None:
      raise ValueError('GroupReplanner.decide: no window observed yet.')
    rate, groups = self.rate(current.groups), current.groups
    missing = [name for name in ('sim', 'train') if name not in self.store]
    if missing:
      record = {
          'iteration': iteration,
          'groups': groups,
          'env_steps_per_s': rate,
          'changed': False,
          'reason': f'keep: no {" or ".join(missing)} time measured yet, so no layout can be predicted'
      }
      self._append(record)
      return record
    options = self.predictions()
    best = max(options, key=lambda g: (options[g]['env_steps_per_s'], g == groups, -g))
    pred = options[best]['env_steps_per_s']
    pause = self.pause_s if self.pause_s is not None else self.assumed_pause_s
    horizon = min(self.horizon_s, remaining_s) if remaining_s is not None else self.horizon_s
    gain = pred / rate - 1
    standby = self.standby_s or 0.0
    payback = pause * pred / (pred - rate) if pred > rate else None  # None: never
    record = {
        'iteration': iteration,
        'groups': groups,
        'env_steps_per_s': rate,
        'window_iterations': current.iterations,
        'candidates': {
            str(g): o for g, o in options.items()
        },
        'best_groups': best,
        'predicted_gain': gain,
        'expected_pause_s': pause,
        'pause_source': 'measured' if self.pause_s is not None else 'assumed (--replan_group_change_cost_s)',
        'expected_standby_s': self.standby_s,  # None: no change measured one yet, 0 counted
        'payback_s': payback,
        'horizon_s': horizon,
        'fits': {
            name: self.store[name].fit_note for name in sorted(self.store)
        },
        'changed': False
    }
    back = 'never' if payback is None else f'in {payback:.1f} s'
    text = (f'{groups} groups measured {rate:,.0f} env steps/s; best {best} groups predicted {pred:,.0f} '
            f'({options[best]["source"]}, {gain:+.1%}); standbys ready in {standby:.1f} s, then a {pause:.2f} s '
            f'pause pays back {back}; horizon {horizon:.1f} s')
    if best == groups:
      record['reason'] = f'keep: the current layout is the best predicted; {text}'
    elif gain <= self.margin:
      record['reason'] = f'keep: gain within the {self.margin:.0%} margin; {text}'
    elif payback is None or standby + payback > horizon:
      record['reason'] = f'keep: the change would not pay back its pause within the horizon; {text}'
    else:
      record.update(changed=True, new_groups=best, reason=f'change to {best} groups: {text}')
      self._awaiting = record
    self._append(record)
    logging.info('group re-planner at iteration %d: %s', iteration, record['reason'])
    return record

  def _append(self, record: dict) -> None:
    self.decisions.append(record)
    keeps = [i for i, d in enumerate(self.decisions) if not d['changed']]
    if len(keeps) > KEEP_DECISIONS:
      del self.decisions[keeps[0]]  # in place: the trigger's record holds this list
      self.left_out += 1

  def changed(self, change: dict) -> None:
    """A change finished (controller/relayout.py's record): its cost joins its decision; a measured pause
    replaces the assumed one; a failed layout is not proposed again."""
    decision = self._awaiting
    if decision is not None and decision['new_groups'] == change['new_groups']:
      decision['cost'] = {k: change.get(k) for k in ('standbys_ready_s', 'pause_s', 'env_steps_lost', 'failed')}
    if change.get('failed'):
      self.failed[change['new_groups']] = 'its warm standbys failed'
      self._awaiting = None
      return
    if _finite(change.get('pause_s')):
      self.pause_s = max(0.0, change['pause_s'])
    if _finite(change.get('standbys_ready_s')):
      self.standby_s = max(0.0, change['standbys_ready_s'])


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)
