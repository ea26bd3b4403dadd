"""Slack-aware SM quotas (Rose's second stage), as pure logic: a measured timeline -> critical path and slack ->
a candidate quota -> validated end to end (kept only if the measured iteration time improves, else reverted).

A timeline is one iteration's spans (task, process, start, end; seconds). The tasks' order is what the timeline
shows plus the graph's data dependencies: a task waits for its dependencies and for the task before it in the same
process. The classic forward/backward pass over that order with the measured durations gives each task's slack
(how much later it could end without making the iteration longer); the tasks with no slack are the critical path.

`SlackTuner` turns that into decisions, one iteration at a time: measure a baseline over `trial_iterations`
iterations, propose moving `step` quota points from the role with the most slack to the role that holds most of
the critical path, let the caller apply it, measure the same number of iterations, then keep it (the new
baseline) or revert it (and never propose it again). Every decision carries its reason. Nothing here touches a
process or MPS: `controller/replan.py` applies the quotas (warm-standby swaps of the rollout workers).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Span:
  task: str
  process: str
  start: float
  end: float

  @property
  def role(self) -> str:
    """The quota role of the process ('rollout/1' -> 'rollout')."""
    return self.process.split('/')[0]


@dataclasses.dataclass(frozen=True)
class Analysis:
  makespan: float
  slack: Dict[str, float]  # task -> seconds it could end later without lengthening the iteration
  critical_path: Tuple[str, ...]  # in order
  role_slack: Dict[str, float]  # role -> the least slack of its tasks (what it can give up)
  role_critical_s: Dict[str, float]  # role -> seconds of the critical path it runs
  alone: FrozenSet[str] = frozenset()  # roles whose critical spans overlap no other role's span


def analyse(timeline: Sequence[Span], deps: Mapping[str, Sequence[str]] = None, eps: float = 1e-6) -> Analysis:
  """Critical path and slack of one measured iteration. `deps`: task -> tasks it reads from (the iteration
  graph's dependencies; tasks missing from the timeline are ignored)."""
  spans = sorted(timeline, key=lambda s: (s.start, s.end))
  names = [s.task for s in spans]
  if len(set(names)) != len(names):
    raise ValueError(f'a timeline names each task once; got {names}.')
  by_name = {s.task: s for s in spans}
  preds: Dict[str, set] = {s.task: {d for d in (deps or {}).get(s.task, ()) if d in by_name} for s in spans}
  last: Dict[str, str] = {}
  for s in spans:  # a process runs its tasks one after another
    if s.process in last:
      preds[s.task].add(last[s.process])
    last[s.process] = s.task
  t0 = min((s.start for s in spans), default=0.0)
  finish: Dict[str, float] = {}
  for s in spans:  # start order is a topological order: a predecessor started no later
    begin = max([finish[p] for p in preds[s.task]] + [s.start - t0 if not preds[s.task] else 0.0])
    finish[s.task] = begin + (s.end - s.start)
  makespan = max(finish.values(), default=0.0)
  latest: Dict[str, float] = {s.task: makespan for s in spans}
  for s in reversed(spans):
    for p in preds[s.task]:
      latest[p] = min(latest[p], latest[s.task] - (s.end - s.start))
  slack = {t: max(0.0, latest[t] - finish[t]) for t in names}
  critical = tuple(t for t in names if slack[t] <= eps)
  role_slack: Dict[str, float] = {}
  role_critical: Dict[str, float] = {}
  for s in spans:
    role_slack[s.role] = min(role_slack.get(s.role, float('inf')), slack[s.task])
    if s.task in critical:
      role_critical[s.role] = role_critical.get(s.role, 0.0) + (s.end - s.start)
  alone = frozenset(
      r for r in role_critical
      if not any(s.role == r and s.task in critical and o.role != r and o.start < s.end and s.start < o.end
                 for s in spans
                 for o in spans))
  return Analysis(makespan, slack, critical, role_slack, role_critical, alone)


@dataclasses.dataclass(frozen=True)
class Decision:
  iteration: int
  action: str  # 'try' (apply `quotas`), 'keep', 'revert' (apply `quotas`), 'hold' (nothing to try)
  quotas: Dict[str, int]  # the quotas in force after this decision
  reason: str
  baseline_s: Optional[float] = None
  measured_s: Optional[float] = None


def propose(
    quotas: Mapping[str, int],
    analysis: Analysis,
    changeable: FrozenSet[str],
    step: int,
    min_slack_fraction: float = 0.05,
    min_quota: int = 10,
    rejected: FrozenSet[Tuple[Tuple[str, int], ...]] = frozenset()
) -> Tuple[Optional[Dict[str, int]], str]:
  """(candidate quotas or None, why): `step` points off the changeable role with the most slack (at least
  `min_slack_fraction` of the iteration, and a quota above `min_quota`), onto the changeable role that runs the
  most of the critical path (up to 100); with no such donor, `step` more for a critical role whose critical work
  overlaps no other role's (the SMs it gains sit idle otherwise). A role not in `quotas` has no quota to move;
  candidates in `rejected` are not proposed again."""
  span = max(analysis.makespan, 1e-9)
  donors = sorted(((s, r) for r, s in analysis.role_slack.items() if r in changeable and r in quotas), reverse=True)
  donors = [(s, r) for s, r in donors if s >= min_slack_fraction * span and quotas[r] - step >= min_quota]
  takers = sorted(((t, r) for r, t in analysis.role_critical_s.items() if r in changeable and r in quotas),
                  reverse=True)
  path = ' -> '.join(analysis.critical_path)
  if not donors:  # a critical role that runs alone on the GPU takes SMs from nobody
    for crit_s, taker in takers:
      candidate = dict(quotas, **{taker: min(100, quotas[taker] + step)})
      if taker in analysis.alone and quotas[taker] < 100 and tuple(sorted(candidate.items())) not in rejected:
        return candidate, (f'{taker} runs {crit_s:.3f} s of the critical path with nothing beside it: '
                           f'{taker} {quotas[taker]} -> {candidate[taker]} %; critical path {path}')
    return None, (f'no quota role has slack >= {min_slack_fraction:.0%} of the {span:.3f} s iteration with a quota '
                  f'above {min_quota} + {step} %, and no critical role below 100 % runs alone (critical path {path})')
  for slack_s, donor in donors:
    candidate = dict(quotas)
    candidate[donor] -= step
    taker = next((r for _, r in takers if r != donor and quotas[r] < 100), None)
    if taker is not None:
      candidate[taker] = min(100, quotas[taker] + step)
    if tuple(sorted(candidate.items())) in rejected:
      continue
    grow = f', {taker} {quotas[taker]} -> {candidate[taker]} % (it runs {analysis.role_critical_s[taker]:.3f} s ' \
           f'of the critical path)' if taker else ''
    return candidate, (f'{donor} has {slack_s:.3f} s of slack ({slack_s / span:.0%} of the iteration): '
                       f'{donor} {quotas[donor]} -> {candidate[donor]} %{grow}; critical path {path}')
  return None, 'every candidate was tried and reverted'


class SlackTuner:
  """The validation loop: baseline -> try -> keep or revert, `trial_iterations` measured iterations each.

  `step(iteration, iteration_s, timeline)` takes one finished iteration and returns the decision it led to, or
  None while measuring. The caller applies `decision.quotas` on 'try' and 'revert' and should not feed the
  iterations during which a change is being applied (they mix the old and the new quotas)."""

  def __init__(self,
               quotas: Mapping[str, int],
               changeable: Sequence[str],
               deps: Mapping[str, Sequence[str]] = None,
               step: int = 10,
               trial_iterations: int = 5,
               min_gain: float = 0.02,
               min_slack_fraction: float = 0.05,
               min_quota: int = 10):
    self.quotas = dict(quotas)
    self._changeable = frozenset(changeable)
    self._deps = dict(deps or {})
    self._step, self._n, self._min_gain = step, trial_iterations, min_gain
    self._min_slack, self._min_quota = min_slack_fraction, min_quota
    self._times: List[float] = []
    self._timelines: List[Sequence[Span]] = []
    self._baseline: Optional[float] = None
    self._trial: Optional[Tuple[Dict[str, int], Dict[str, int]]] = None  # (previous quotas, candidate)
    self._rejected: set = set()
    self.decisions: List[Decision] = []
    self.done = False

  def step(self, iteration: int, iteration_s: float, timeline: Sequence[Span]) -> Optional[Decision]:
    if self.done:
      return None
    self._times.append(iteration_s)
    self._timelines.append(timeline)
    if len(self._times) < self._n:
      return None
    measured = sorted(self._times)[len(self._times) // 2]  # the median: one slow iteration does not decide
    timelines, self._times, self._timelines = self._timelines, [], []
    if self._trial is not None:
      return self._judge(iteration, measured)
    self._baseline = measured
    return self._try(iteration, timelines[-1])

  def _judge(self, iteration: int, measured: float) -> Decision:
    previous, candidate = self._trial
    self._trial = None
    gain = 1.0 - measured / self._baseline
    if gain > self._min_gain:
      reason = (f'{self._baseline:.4f} -> {measured:.4f} s per iteration ({gain:+.1%}, more than the '
                f'{self._min_gain:.0%} required): kept')
      decision = Decision(iteration, 'keep', dict(candidate), reason, self._baseline, measured)
      self._baseline = measured
    else:
      self._rejected.add(tuple(sorted(candidate.items())))
      self.quotas = dict(previous)
      reason = (f'{self._baseline:.4f} -> {measured:.4f} s per iteration ({gain:+.1%}, not more than '
                f'{self._min_gain:.0%}): reverted to {previous}')
      decision = Decision(iteration, 'revert', dict(previous), reason, self._baseline, measured)
    self.decisions.append(decision)
    return decision

  def _try(self, iteration: int, timeline: Sequence[Span]) -> Decision:
    analysis = analyse(timeline, self._deps)
    candidate, why = propose(self.quotas, analysis, self._changeable, self._step, self._min_slack, self._min_quota,
                             frozenset(self._rejected))
    if candidate is None:
      self.done = True
      decision = Decision(iteration, 'hold', dict(self.quotas), why, self._baseline)
    else:
      self._trial = (dict(self.quotas), candidate)
      self.quotas = dict(candidate)
      decision = Decision(iteration, 'try', dict(candidate), why, self._baseline)
    self.decisions.append(decision)
    return decision
