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
