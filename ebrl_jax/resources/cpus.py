"""A CPU core pool: native-MuJoCo rollout workers get cores of their own, GPU feeder processes one each.

`plan_cores(cores, cpu_roles, feeder_roles)` is pure (tested by hand); a worker applies its share at start with
`runtime.startup.pin` (`os.sched_setaffinity`), before it builds its env pool, whose thread count follows the affinity.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence


def available_cores() -> List[int]:
  return sorted(os.sched_getaffinity(0))


def plan_cores(cores: Sequence[int], cpu_roles: Sequence[str], feeder_roles: Sequence[str]) -> Dict[str, List[int]]:
  """Splits `cores` between roles.

  Each feeder (a process that mostly launches GPU work: trainer, generation, MJX rollout) gets one core while
  there are more cores than roles; the rest go to the CPU-simulating roles in contiguous, near-equal blocks
  (block sizes differ by at most one; earlier roles get the larger ones). With fewer cores than roles, roles
  share cores round-robin, and nobody is pinned to nothing.
  """
  cores = list(cores)
  if not cores:
    raise ValueError('plan_cores needs at least one core.')
  roles = list(cpu_roles) + list(feeder_roles)
  if len(cores) <= len(roles):
    return {role: [cores[i % len(cores)]] for i, role in enumerate(roles)}
  plan: Dict[str, List[int]] = {}
  if not cpu_roles:
    per = len(cores) // len(feeder_roles)
    return {role: cores[i * per:(i + 1) * per] for i, role in enumerate(feeder_roles)}
  feeder_cores = cores[len(cores) - len(feeder_roles):] if feeder_roles else []
  for role, core in zip(feeder_roles, feeder_cores):
    plan[role] = [core]
  sim_cores = cores[:len(cores) - len(feeder_roles)]
  base, extra = divmod(len(sim_cores), len(cpu_roles))
  start = 0
  for i, role in enumerate(cpu_roles):
    size = base + (1 if i < extra else 0)
    plan[role] = sim_cores[start:start + size]
    start += size
  return plan
