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
