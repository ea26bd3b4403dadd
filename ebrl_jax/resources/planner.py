"""The planner: picks env groups, group size and SM quotas per role from stage profiles; re-plans with hysteresis.

Roles (processes) and the profile each is predicted from (see profiles.py for t(b, q)):
  'rollout'     G processes, one per env group of E = num_envs / G envs, each at quota q_r: profile 'sim'
                (plus 'generation' at the same quota when generation is co-located and a profile for it exists);
  'generation'  one process at quota q_g when not co-located: profile 'generation';
  'trainer'     one process at quota q_t: profile 'train', called `train_calls_per_iteration` times on
                `train_batch` items.

Iteration model, with S = steps_per_iteration (env steps each env takes per iteration):
  co-located:  step = t_sim(E, q_r) [+ t_gen(E, q_r)]
  separate:    step = max(t_sim(E, q_r) + t_gen(E, q_g) + step_handoff_s,  G * t_gen(E, q_g))
               (a group's own cycle, or the generation process serving all G groups one batch each, if slower)
  T_r = S * step       all G groups run at once, each on its own SMs, so one group's time is the rollout's;
  T_t = train_calls_per_iteration * t_train(train_batch, q_t);
  async: T = max(T_r, T_t) + iteration_handoff_s   (training overlaps the next rollout);
  sync:  T = T_r + T_t + iteration_handoff_s       (barrier; both schedules hand segments and weights over once);
  env-steps/s = num_envs * S / T.
Quotas never oversubscribe the GPU: async G * q_r + q_g + q_t <= 100; sync G * q_r + q_g <= 100 and q_t <= 100
(the trainer runs alone). Beside the quota grid, each layout is also predicted with no quotas at all (`shared`: every
process may use every SM, as in a run without --sm_quotas, and always without MPS): each stage is read at 100 %
and the GPU work of processes that run at once is added up, as if their kernels took turns,
  gpu_r = S * G * (t_sim(E, 100) if the rollout simulates on the GPU, + t_gen(E, 100)),
  async: T = max(T_r, T_t, gpu_r + T_t) + iteration_handoff_s;  sync: T = max(T_r, gpu_r) + T_t + iteration_handoff_s,
which is pessimistic where kernels of two processes do fit on the GPU at once (MPS without quotas lets them).
Rollout processes that only simulate on CPU cores (`rollout_on_gpu=False`) have no quota: G * q_r drops out
and t_sim is read at 100. The search is exhaustive; ties (within 1e-9 relative) go to fewer groups, then to the
lower total quota (G * q_r + q_g + q_t), then to the lower rollout, generation and trainer quotas in that order.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

from absl import logging

ROLLOUT, GENERATION, TRAINER = 'rollout', 'generation', 'trainer'
SCHEDULES = ('sync', 'async')
FIXABLE = ('num_groups', 'envs_per_group', ROLLOUT, GENERATION, TRAINER)
_TIE = 1e-9


@dataclasses.dataclass(frozen=True)
class PlanSpace:
  """The choices the planner searches. `group_sizes` () means every power of two that divides num_envs."""
  num_envs: int
  steps_per_iteration: int = 1
  num_groups: Tuple[int, ...] = (1, 2, 4, 8)
  group_sizes: Tuple[int, ...] = ()
  quotas: Tuple[int, ...] = tuple(range(10, 101, 10))
  colocate_generation: bool = True
  train_batch: int = 0  # 0: num_envs * steps_per_iteration transitions
  train_calls_per_iteration: int = 1
  iteration_handoff_s: float = 0.0
  step_handoff_s: float = 0.0  # a separate generation process's hand-off per env step of one group
  # False without MPS: no quotas to share out (every process at 100 %), so the sum-to-100 % limit is lifted and
  # every plan is predicted as `shared` (the processes' GPU work added up: time-slicing takes turns).
  quota_limit: bool = True
  # With MPS: also predict each layout with no quotas (every process may use every SM; see the module docstring).
  shared_option: bool = True
  # False when the rollout processes only simulate on CPU cores and a separate generation process acts for them
  # (native MuJoCo, --nocolocate_generation): they hold no GPU context, so they get no quota and take none of
  # the 100 %; their sim profile is read at quota 100 (a CPU stage does not depend on it).
  rollout_on_gpu: bool = True
  # False for native MuJoCo: the rollout simulates on CPU cores even where it acts on the GPU (co-located), so its
  # sim time is no GPU work to add up in a `shared` prediction.
  sim_on_gpu: bool = True

  def __post_init__(self):
    for name in ('num_envs', 'steps_per_iteration', 'train_calls_per_iteration'):
      if getattr(self, name) <= 0:
        raise ValueError(f'PlanSpace.{name}={getattr(self, name)} must be > 0.')
    if not self.num_groups or any(g <= 0 for g in self.num_groups):
      raise ValueError(f'PlanSpace.num_groups={self.num_groups} must be non-empty and positive.')
    if any(e <= 0 or e & (e - 1) for e in self.group_sizes):
      raise ValueError(f'PlanSpace.group_sizes={self.group_sizes} must be powers of two (the generation buckets).')
    if not self.quotas or any(not 1 <= q <= 100 for q in self.quotas):
      raise ValueError(f'PlanSpace.quotas={self.quotas} must be non-empty, each in 1..100 (percent of SMs).')
    if self.train_batch < 0 or self.iteration_handoff_s < 0 or self.step_handoff_s < 0:
      raise ValueError('PlanSpace.train_batch, iteration_handoff_s and step_handoff_s must be >= 0.')
    if not self.rollout_on_gpu and self.colocate_generation:
      raise ValueError('PlanSpace.rollout_on_gpu=False needs a separate generation process '
                       '(colocate_generation=False): co-located generation puts the policy in the rollout process.')
    if not self.layouts:
      raise ValueError(f'PlanSpace: no num_groups in {self.num_groups} splits num_envs={self.num_envs} into groups '
                       f'of a size in group_sizes={self.group_sizes or "(powers of two)"}.')

  @property
  def layouts(self) -> Tuple[Tuple[int, int], ...]:
    """The (num_groups, envs_per_group) pairs to search: equal groups whose size is a bucket."""
    out = []
    for g in sorted(set(self.num_groups)):
      e = self.num_envs // g
      ok = e * g == self.num_envs and (e in self.group_sizes if self.group_sizes else e & (e - 1) == 0)
      if ok:
        out.append((g, e))
    return tuple(out)

  @property
  def roles(self) -> Tuple[str, ...]:
    """The roles that hold a GPU context and so get an SM quota."""
    roles = (ROLLOUT, TRAINER) if self.colocate_generation else (ROLLOUT, GENERATION, TRAINER)
    return roles if self.rollout_on_gpu else tuple(r for r in roles if r != ROLLOUT)

  @property
  def effective_train_batch(self) -> int:
    return self.train_batch or self.num_envs * self.steps_per_iteration


@dataclasses.dataclass(frozen=True)
class Plan:
  """One choice of layout and quotas, with the model's predictions and why it was chosen."""
  schedule: str
  num_groups: int
  envs_per_group: int
  quotas: Dict[str, int]  # role -> percent; 'rollout' is each rollout process's quota (absent: on CPU only)
  colocate_generation: bool
  rollout_s: float
  train_s: float
  iteration_s: float
  env_steps_per_s: float
  reason: str = ''
  shared: bool = False  # no quotas set: every process may use every SM (`quotas` then reads 100 for each role)

  @property
  def total_quota(self) -> int:
    return self.num_groups * self.quotas.get(ROLLOUT, 0) + sum(q for r, q in self.quotas.items() if r != ROLLOUT)

  def describe(self) -> str:
    quotas = ('no quotas (SMs shared)' if self.shared else 'quotas ' +
              ' '.join(f'{role} {self.quotas[role]}%' for role in sorted(self.quotas)))
    return (f'{self.num_groups} group(s) x {self.envs_per_group} envs, {quotas}: '
            f'rollout {self.rollout_s:.3f} s, train {self.train_s:.3f} s, iteration {self.iteration_s:.3f} s '
            f'({self.env_steps_per_s:,.0f} env-steps/s)')


def _profile(profiles: Mapping, name: str):
  if name not in profiles:
    raise ValueError(f'the planner needs a {name!r} profile; profiles present: {sorted(profiles) or "none"}.')
  return profiles[name]


def evaluate(profiles: Mapping,
             space: PlanSpace,
             num_groups: int,
             quotas: Mapping[str, int],
             schedule: str = 'async',
             shared: bool = False) -> Plan:
  """The model's prediction for one layout and set of quotas, or with no quotas (`shared`, and always without
  MPS; `quotas` is then ignored), see the module docstring; `reason` is empty."""
  if schedule not in SCHEDULES:
    raise ValueError(f'schedule={schedule!r} is not plannable; allowed values: {", ".join(SCHEDULES)}.')
  shared = shared or not space.quota_limit
  if shared:
    quotas = {role: 100 for role in space.roles}
  e = space.num_envs // num_groups
  sim = _profile(profiles, 'sim')
  q_r, q_t = quotas.get(ROLLOUT, 100), quotas[TRAINER]
  if space.colocate_generation:
    step = sim.predict(e, q_r) + (profiles['generation'].predict(e, q_r) if 'generation' in profiles else 0.0)
  else:
    gen = _profile(profiles, 'generation').predict(e, quotas[GENERATION])
    step = max(sim.predict(e, q_r) + gen + space.step_handoff_s, num_groups * gen)
  rollout_s = space.steps_per_iteration * step
  train_s = space.train_calls_per_iteration * _profile(profiles, 'train').predict(space.effective_train_batch, q_t)
  if shared:  # the GPU work of processes running at once, added up
    gpu_step = sim.predict(e, 100) if space.rollout_on_gpu and space.sim_on_gpu else 0.0
    if 'generation' in profiles and (space.rollout_on_gpu or not space.colocate_generation):
      gpu_step += profiles['generation'].predict(e, 100)
    gpu_r = space.steps_per_iteration * num_groups * gpu_step
    combined = (max(rollout_s, train_s, gpu_r + train_s) if schedule == 'async' else max(rollout_s, gpu_r) + train_s)
  else:
    combined = max(rollout_s, train_s) if schedule == 'async' else rollout_s + train_s
  iteration_s = combined + space.iteration_handoff_s
  return Plan(schedule,
              num_groups,
              e,
              dict(quotas),
              space.colocate_generation,
              rollout_s,
              train_s,
              iteration_s,
              space.num_envs * space.steps_per_iteration / iteration_s,
              shared=shared)


def _feasible(space: PlanSpace, num_groups: int, quotas: Mapping[str, int], schedule: str) -> bool:
  if not space.quota_limit:
    return True
  rollout = num_groups * quotas.get(ROLLOUT, 0) + quotas.get(GENERATION, 0)
  if schedule == 'async':
    return rollout + quotas[TRAINER] <= 100
  return rollout <= 100 and quotas[TRAINER] <= 100


def _order(p: Plan, best_s: float) -> tuple:
  near_best = p.iteration_s <= best_s * (1 + _TIE)
  return (not near_best, p.iteration_s if not near_best else 0.0, p.num_groups, p.total_quota, p.quotas.get(ROLLOUT, 0),
          p.quotas.get(GENERATION, 0), p.quotas[TRAINER])


def candidates(profiles: Mapping,
               space: PlanSpace,
               schedule: str = 'async',
               fixed: Optional[Mapping[str, int]] = None) -> List[Plan]:
  """Every feasible plan in the space that respects `fixed` (keys: num_groups, envs_per_group or a role)."""
  fixed = dict(fixed or {})
  unknown = sorted(set(fixed) - set(FIXABLE))
  if unknown:
    raise ValueError(f'fixed={fixed}: unknown key(s) {unknown}; valid keys: {", ".join(FIXABLE)}.')
  if GENERATION in fixed and space.colocate_generation:
    raise ValueError(f'fixed={fixed} pins a generation quota, but generation is co-located (no such process).')
  if ROLLOUT in fixed and not space.rollout_on_gpu:
    raise ValueError(f'fixed={fixed} pins a rollout quota, but the rollout processes simulate on CPU cores only '
                     '(no GPU context, no quota).')
  for role in set(fixed) & {ROLLOUT, GENERATION, TRAINER}:
    if not 1 <= fixed[role] <= 100:
      raise ValueError(f'fixed[{role!r}]={fixed[role]} must lie in 1..100 (percent of SMs).')
  layouts = space.layouts
  if {'num_groups', 'envs_per_group'} & set(fixed):  # a pinned layout need not be a bucket, only an even split
    g = fixed.get('num_groups') or space.num_envs // max(1, fixed['envs_per_group'])
    e = space.num_envs // max(1, g)
    if g <= 0 or g * e != space.num_envs or fixed.get('envs_per_group', e) != e:
      raise ValueError(f'fixed={fixed} does not split num_envs={space.num_envs} into equal groups.')
    layouts = ((g, e),)
  grids = [[fixed[role]] if role in fixed else list(space.quotas) for role in space.roles]
  plans = []
  for (g, _), values in itertools.product(layouts, itertools.product(*grids)):
    quotas = dict(zip(space.roles, values))
    if _feasible(space, g, quotas, schedule):
      plans.append(evaluate(profiles, space, g, quotas, schedule))
  if space.quota_limit and space.shared_option and not set(fixed) & {ROLLOUT, GENERATION, TRAINER}:
    plans += [evaluate(profiles, space, g, {}, schedule, shared=True) for g, _ in layouts]
  return plans


def plan(profiles: Mapping,
         space: PlanSpace,
         schedule: str = 'async',
         fixed: Optional[Mapping[str, int]] = None) -> Plan:
  """The plan with the least predicted iteration time; `reason` compares it with the runner-up (the best plan
  with another number of groups, or else the next plan in order)."""
  plans = candidates(profiles, space, schedule, fixed)
  if not plans:
    raise ValueError(f'no feasible {schedule} plan: fixed={dict(fixed or {})} leaves no layout in '
                     f'{space.layouts} with quotas from {space.quotas} summing to <= 100 %.')
  best_s = min(p.iteration_s for p in plans)
  plans.sort(key=lambda p: _order(p, best_s))
  best = plans[0]
  others = [p for p in plans[1:] if p.num_groups != best.num_groups] or plans[1:]
  reason = f'{schedule}: {best.describe()}'
  if others:
    runner_up = others[0]
    reason += (f'; runner-up {runner_up.describe()} ({runner_up.iteration_s / best.iteration_s - 1:+.1%} '
               'iteration time)')
  if fixed:
    reason += f'; pinned {dict(fixed)}'
  return dataclasses.replace(best, reason=reason)


class Decision(NamedTuple):
  """One re-planning decision. Gains are throughput gains: time_before / time_after - 1."""
  iteration: int
  changed: bool
  plan: Plan  # the plan in force after the decision
  current_s: float  # the current plan's iteration time predicted from the updated profiles
  best_s: float
  predicted_gain: float
  measured_s: Optional[float]  # EMA of measured iteration seconds under the plan in force before the decision
  measured_gain: Optional[float]  # of the last change: measured before it / measured since - 1
  reason: str


class Replanner:
  """Holds the current plan and changes it only when the change clearly pays.

  A change restarts processes (new quotas), which costs `change_cost_s`. `update` switches to the best plan
  only if (1) its predicted throughput gain, current_s / best_s - 1, exceeds `hysteresis`; (2) the seconds it
  saves per iteration, times the horizon (min(horizon_iterations, remaining_iterations)), exceed
  `change_cost_s`; and (3) at least `min_interval_iterations` passed since the last change (or the start).
  """

  def __init__(self,
               space: PlanSpace,
               schedule: str = 'async',
               fixed: Optional[Mapping[str, int]] = None,
               plan: Optional[Plan] = None,
               hysteresis: float = 0.10,
               min_interval_iterations: int = 20,
               change_cost_s: float = 60.0,
               horizon_iterations: int = 200,
               measured_ema_alpha: float = 0.3,
               start_iteration: int = 0):
    if hysteresis < 0 or min_interval_iterations < 0 or change_cost_s < 0 or horizon_iterations <= 0:
      raise ValueError('Replanner: hysteresis, min_interval_iterations and change_cost_s must be >= 0 and '
                       f'horizon_iterations > 0 (got {hysteresis}, {min_interval_iterations}, {change_cost_s}, '
                       f'{horizon_iterations}).')
    self.space, self.schedule, self.fixed = space, schedule, dict(fixed or {})
    self.plan = plan
    self.hysteresis = hysteresis
    self.min_interval_iterations = min_interval_iterations
    self.change_cost_s = change_cost_s
    self.horizon_iterations = horizon_iterations
    self.measured_ema_alpha = measured_ema_alpha
    self.last_change_iteration = start_iteration
    self.decisions: List[Decision] = []
    self._measured: Optional[float] = None  # EMA under the current plan
    self._measured_before: Optional[float] = None  # EMA under the previous plan, frozen at the last change

  def update(self,
             profiles: Mapping,
             iteration: int,
             measured_iteration_s: Optional[float] = None,
             remaining_iterations: Optional[int] = None) -> Optional[Plan]:
    """Re-plans with the updated profiles; returns the new plan if it changed, else None. Logs the decision."""
    if measured_iteration_s is not None:
      a = self.measured_ema_alpha
      self._measured = measured_iteration_s if self._measured is None else ((1 - a) * self._measured +
                                                                            a * measured_iteration_s)
    measured_gain = (self._measured_before / self._measured -
                     1 if self._measured_before is not None and self._measured is not None else None)
    best = plan(profiles, self.space, self.schedule, self.fixed)
    if self.plan is None:
      return self._decide(iteration, best, best.iteration_s, best, measured_gain, f'initial plan: {best.reason}')
    current = evaluate(profiles,
                       self.space,
                       self.plan.num_groups,
                       self.plan.quotas,
                       self.schedule,
                       shared=self.plan.shared)
    gain = current.iteration_s / best.iteration_s - 1
    horizon = min(self.horizon_iterations, remaining_iterations if remaining_iterations is not None else 1 << 62)
    payback_s = (current.iteration_s - best.iteration_s) * horizon
    since = iteration - self.last_change_iteration
    text = (f'current {current.describe()}; best {best.describe()}: predicted gain {gain:+.1%}, saves '
            f'{payback_s:.1f} s over {horizon} iterations vs a {self.change_cost_s:.1f} s change cost')
    if measured_gain is not None:
      text += f'; last change measured {measured_gain:+.1%}'
    if gain <= self.hysteresis:
      return self._decide(iteration, None, current.iteration_s, best, measured_gain,
                          f'keep: gain within the {self.hysteresis:.0%} hysteresis; {text}')
    if payback_s <= self.change_cost_s:
      return self._decide(iteration, None, current.iteration_s, best, measured_gain,
                          f'keep: the change would not pay back its cost; {text}')
    if since < self.min_interval_iterations:
      return self._decide(iteration, None, current.iteration_s, best, measured_gain,
                          f'keep: {since} < {self.min_interval_iterations} iterations since the last change; {text}')
    return self._decide(iteration, best, current.iteration_s, best, measured_gain, f'change: {text}')

  def _decide(self, iteration: int, new: Optional[Plan], current_s: float, best: Plan, measured_gain: Optional[float],
              reason: str) -> Optional[Plan]:
    decision = Decision(iteration, new is not None, new or self.plan, current_s, best.iteration_s,
                        current_s / best.iteration_s - 1, self._measured, measured_gain, reason)
    self.decisions.append(decision)
    logging.info('replanner at iteration %d: %s', iteration, reason)
    if new is not None:
      self.plan = new
      self.last_change_iteration = iteration
      self._measured_before, self._measured = self._measured, None
    return new
