"""`--schedule=auto`: fused, sync or async, chosen from the same stage profiles as `--plan`.

Each schedule is predicted with the planner's iteration model (planner.py's docstring):
  fused  one process: every stage in turn at the whole GPU, on all envs at once, no hand-off:
         T = S * (t_sim(N, 100) + t_gen(N, 100)) + T_t(100);
  sync   the best `planner.plan` layout for the barrier schedule, with the hand-off below;
  async  the same for the overlapping schedule.
The process schedules pay a hand-off the fused program does not: every iteration the segments cross shared memory
(written once, read once) and the new parameters are published and read, `handoff_s` (the caller estimates it
from the topology's bytes and the host copy bandwidth measured here, see autoplan.HOST_COPY_BYTES_PER_S).
A process schedule is chosen only if its prediction beats fused by more than `margin` (default 5 %): the model
leaves out what more processes cost beyond the hand-off (their start-up, contention for host cores and memory
bandwidth), and within that margin the one-process program is the safer choice. Between sync and async the faster
prediction wins; a tie goes to sync (on-policy).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, NamedTuple, Optional

from ebrl_jax.resources import planner

MARGIN = 0.05


class Choice(NamedTuple):
  schedule: str  # 'fused', 'sync' or 'async'
  plan: Optional[planner.Plan]  # the process schedule's layout and quotas; None for fused
  predicted: Dict[str, float]  # schedule -> predicted env steps/s
  reason: str


def predict_fused(profiles: Mapping, space: planner.PlanSpace) -> planner.Plan:
  """The fused program's prediction: one group of all envs, each stage at 100 %, no hand-off."""
  alone = dataclasses.replace(space, quota_limit=False, iteration_handoff_s=0.0, step_handoff_s=0.0)
  plan = planner.evaluate(profiles, alone, 1, {}, 'sync', shared=True)
  return dataclasses.replace(plan, schedule='fused', reason='one process, in turn')


def choose(profiles: Mapping,
           space: planner.PlanSpace,
           handoff_s: float,
           pinned: Optional[Mapping[str, int]] = None,
           margin: float = MARGIN) -> Choice:
  """The schedule with the best prediction (see the module docstring); `reason` gives every prediction."""
  if margin < 0 or handoff_s < 0:
    raise ValueError(f'margin={margin} and handoff_s={handoff_s} must be >= 0.')
  fused = predict_fused(profiles, space)
  with_handoff = dataclasses.replace(space, iteration_handoff_s=space.iteration_handoff_s + handoff_s)
  plans = {name: planner.plan(profiles, with_handoff, name, pinned) for name in planner.SCHEDULES}
  predicted = {'fused': fused.env_steps_per_s, **{name: p.env_steps_per_s for name, p in plans.items()}}
  best = max(planner.SCHEDULES, key=lambda name: (plans[name].env_steps_per_s, name == 'sync'))
  lines = [
      f'fused {fused.env_steps_per_s:,.0f} env-steps/s (rollout {fused.rollout_s:.3f} s + train '
      f'{fused.train_s:.3f} s)'
  ] + [f'{name} {plans[name].describe()}' for name in planner.SCHEDULES]
  gain = plans[best].env_steps_per_s / fused.env_steps_per_s - 1
  text = '; '.join(lines) + f'; hand-off {handoff_s * 1e3:.2f} ms per iteration'
  if gain > margin:
    return Choice(best, plans[best], predicted, f'{best}: predicted {gain:+.1%} over fused (> {margin:.0%}); {text}')
  return Choice(
      'fused', None, predicted,
      f'fused: the best process schedule ({best}) is predicted {gain:+.1%} over it, within the '
      f'{margin:.0%} margin; {text}')


def best_case(profiles: Mapping, space: planner.PlanSpace, handoff_s: float) -> planner.Plan:
  """The fastest any process schedule could be predicted at any SM quotas, from the stages' times at 100 %: each
  layout under sync and async with every process at 100 % of the SMs and none slowing another (no sum-to-100 %
  limit, no shared-GPU adding up). The profile model never makes a stage faster below 100 % (s(q) >= 1,
  profiles.py) and the iteration time grows with each stage's time, so no plan the quotas allow is faster."""
  bound = dataclasses.replace(space, quota_limit=True, iteration_handoff_s=space.iteration_handoff_s + handoff_s)
  full = {role: 100 for role in space.roles}
  plans = [planner.evaluate(profiles, bound, g, full, name) for name in planner.SCHEDULES for g, _ in space.layouts]
  # equal times (to 1e-9 s: sums of the same stage times in another order differ in the last bit) go to the
  # layout of fewer groups, fewer processes
  return min(plans, key=lambda p: (round(p.iteration_s, 9), p.num_groups))


def uncertain(profiles: Mapping,
              space: planner.PlanSpace,
              handoff_s: float,
              margin: float = MARGIN) -> Optional[Choice]:
  """Under MPS, a process schedule without quotas to try where the model cannot tell it from fused: `choose`
  adds the processes' GPU work up (`shared`: right where the GPU time-slices them), but MPS runs their kernels
  side by side, so on a GPU that no stage fills the truth lies between that sum and the same layout with none
  slowing another (`best_case`'s bound). Of the layouts whose bound beats fused by more than `margin`, the one
  with the best sum (the least to lose; fewer groups on a tie) is returned for a trial (auto_trial.py), which
  measures it against fused; None where no layout's bound does. W1 on the H200 (results/README.md,
  w1_matrix_train30_h200.json): every process schedule's sum was below fused, async by hand measured +6.3 %."""
  fused = predict_fused(profiles, space)
  with_handoff = dataclasses.replace(space, iteration_handoff_s=space.iteration_handoff_s + handoff_s)
  bound = dataclasses.replace(with_handoff, quota_limit=True)
  full = {role: 100 for role in space.roles}
  candidates = []
  for name in planner.SCHEDULES:
    for groups, _ in space.layouts:
      best = planner.evaluate(profiles, bound, groups, full, name)
      if best.env_steps_per_s > fused.env_steps_per_s * (1 + margin):
        candidates.append((planner.evaluate(profiles, with_handoff, groups, {}, name, shared=True), best))
  if not candidates:
    return None
  summed, best = max(candidates, key=lambda c: (round(c[0].env_steps_per_s, 6), -c[0].num_groups))
  reason = (f'{best.schedule} ({best.num_groups} group(s), no quotas) on trial: the model puts it between '
            f'{summed.env_steps_per_s:,.0f} env-steps/s (the processes\' GPU work added up) and '
            f'{best.env_steps_per_s:,.0f} (none slowing another, '
            f'{best.env_steps_per_s / fused.env_steps_per_s - 1:+.1%}) against fused\'s '
            f'{fused.env_steps_per_s:,.0f}; MPS runs their kernels side by side, and only a trial tells where')
  predicted = {'fused': fused.env_steps_per_s, best.schedule: summed.env_steps_per_s}
  return Choice(best.schedule, dataclasses.replace(summed, reason=reason), predicted, reason)


def quotas_cannot_win(profiles: Mapping,
                      space: planner.PlanSpace,
                      handoff_s: float,
                      margin: float = MARGIN) -> Optional[str]:
  """Why measuring the stages below 100 % cannot change `choose`'s answer from fused, or None where it might.

  Even `best_case` (every process at full speed, none in another's way) must beat fused by more than `margin`
  for a process schedule to be chosen; where it does not, no quota can (`best_case`'s docstring), so
  `--schedule=auto` skips calibrating them. A training-bound run that async could hide its rollout behind is not
  skipped: only the quotas' profiles say how much training slows beside it."""
  fused = predict_fused(profiles, space)
  best = best_case(profiles, space, handoff_s)
  gain = best.env_steps_per_s / fused.env_steps_per_s - 1
  if gain > margin:
    return None
  return (
      f'with every process at 100 % of the SMs and none slowing another, the best process schedule ({best.schedule}, '
      f'{best.num_groups} group(s): {best.env_steps_per_s:,.0f} env-steps/s) is predicted {gain:+.1%} over fused '
      f'({fused.env_steps_per_s:,.0f}), within the {margin:.0%} margin: no SM quota can make it win')
