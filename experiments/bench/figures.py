"""Figures derived from a run's summary, shared by the harness (run.py) and the report (no plotting here)."""


def steady_env_steps_per_s(summary: dict):
  """Env steps per wall-clock second from the second to the last evaluation (evaluations included): the pace
  once start-up is over. Start-up (worker compiles, the first evaluation) is inside a process schedule's
  end-to-end figure, which dominates short runs. None with fewer than three evaluations."""
  curve = summary.get('eval_curve') or []
  if len(curve) < 3:
    return None
  a, b = curve[1], curve[-1]
  return (b['env_steps'] - a['env_steps']) / (b['wall_s'] - a['wall_s']) if b['wall_s'] > a['wall_s'] else None


def rollout_env_steps_per_s(summary: dict):
  """Env steps per second while collecting, as a process schedule reports it (`extra.rollout`); None else."""
  return ((summary.get('extra') or {}).get('rollout') or {}).get('env_steps_per_s')


def quota_swaps(summary: dict) -> list:
  """The run's finished SM-quota swaps (`extra.replan.swaps`, failed ones left out)."""
  swaps = ((summary.get('extra') or {}).get('replan') or {}).get('swaps', [])
  return [w for w in swaps if not w.get('failed')]


def counts_first_iteration(summary: dict) -> bool:
  """True for a process-schedule run kept before 29df545 (no `extra.startup_s`): its end-to-end rate counts the
  session's first iteration (worker start-up and compiles) as throughput. Since then that iteration is start-up,
  as BENCHMARKS defines the figure; the two are not to be averaged together."""
  extra = summary.get('extra') or {}
  return 'segments_consumed' in extra and 'startup_s' not in extra


def _spread(values: list):
  """(mean, sample standard deviation or None below two values, count); (None, None, 0) when empty."""
  values = [v for v in values if isinstance(v, (int, float))]
  if not values:
    return None, None, 0
  mean = sum(values) / len(values)
  sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else None
  return mean, sd, len(values)


def end_to_end(summaries: list) -> dict:
  """The end-to-end env steps/s over seeds of one definition: the runs measured with start-up excluded where
  any are (older runs left out, `seeds` says how many count), else the older runs' figure, flagged
  `counts_first_iteration`. Mean, sample standard deviation (None for one seed) and seed count."""
  current = [s for s in summaries if not counts_first_iteration(s)]
  chosen = current or summaries
  mean, sd, n = _spread([s.get('env_steps_per_s') for s in chosen])
  return {'mean': mean, 'sd': sd, 'seeds': n, 'counts_first_iteration': bool(chosen) and not current}


def steady(summaries: list) -> dict:
  """`steady_env_steps_per_s` over seeds (comparable across both definitions): mean, sample sd, count."""
  mean, sd, n = _spread([steady_env_steps_per_s(s) for s in summaries])
  return {'mean': mean, 'sd': sd, 'seeds': n}
