"""Co-located or separate generation for an MJX workload, chosen from the stage profiles (`--plan_generation` with
`--plan` or `--schedule=auto`), with the reason.

Both layouts are predicted with the planner's iteration model (planner.py's docstring) on the same profiles:
  co-located  each rollout process steps its envs and acts on them: step = t_sim(E, q_r) + t_gen(E, q_r);
  separate    one generation process acts for every group; a group's step pays the hand-off both ways:
              step = max(t_sim(E, q_r) + t_gen(E, q_g) + h,  G * t_gen(E, q_g)),
where h is the hand-off of one group per env step: one act round trip through the mailbox (`step_handoff_s`),
plus, on the host path, the observations and actions copied device -> host -> device in each process (estimated
at the run's --num_groups group size for every layout the search tries: the planner takes one hand-off per space),
over the K x R env steps one act serves (--action_chunk, --action_repeat; the profiles' t_sim and t_gen are per
env step). The separate
layout is chosen only if its prediction beats co-located by more than `margin` (default 5 %): it costs a process
more (start-up, a GPU context) than the model counts. Without a 'generation' profile the model cannot tell the
two apart and generation stays co-located.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, NamedTuple, Optional

from ebrl_jax.resources import planner

MARGIN = 0.05
# One act round trip of an env group through the shared-memory mailbox between two processes, p50 on the H200 host
# (experiments/results/transport_h200_host.json, round_trip.shm_mailbox: 57.7 us for a [64, 27] observation record
# and a [64, 8] action record). The IPC path sends only the records' flags through the same mailbox, so the same
# figure is its base; experiments/ipc_generation_check.py measures both paths' round trips on the GPU.
MAILBOX_ROUND_TRIP_S = 57.7e-6
# The host's copy bandwidth (autoplan.HOST_COPY_BYTES_PER_S, measured through the same shared memory).
HOST_COPY_BYTES_PER_S = 2.3e9
# Each side of the IPC path synchronises the stream that wrote its buffer before it sends its record.
IPC_SYNCS_PER_STEP = 2


class GenerationChoice(NamedTuple):
  colocate: bool
  plan: planner.Plan  # the chosen layout's plan
  predicted: Dict[str, float]  # 'colocated' / 'separate' -> predicted env steps/s
  step_handoff_s: float
  reason: str


def step_handoff_s(transport: str,
                   group_envs: int,
                   obs_dim: int,
                   action_dim: int,
                   chunk: int = 1,
                   sync_s: float = 10e-6) -> float:
  """The per-step hand-off h of one group of `group_envs` envs: the mailbox round trip, plus on the host path
  the observations [E, O] and actions, raw actions [E, K, A] and log-probs [E] each copied device -> host and
  host -> device once per process pair (4 copies at the host's bandwidth); on the CUDA IPC path the stream
  synchronisations (`sync_s` each) instead."""
  if transport not in ('host', 'cuda_ipc'):
    raise ValueError(f'transport={transport!r}: expected host or cuda_ipc.')
  if transport == 'cuda_ipc':
    return MAILBOX_ROUND_TRIP_S + IPC_SYNCS_PER_STEP * sync_s
  nbytes = 4 * group_envs * (obs_dim + 2 * chunk * action_dim + 1)
  return MAILBOX_ROUND_TRIP_S + 4 * nbytes / HOST_COPY_BYTES_PER_S


def choose(profiles: Mapping,
           space: planner.PlanSpace,
           schedule: str,
           handoff_s: float,
           pinned: Optional[Mapping[str, int]] = None,
           margin: float = MARGIN) -> GenerationChoice:
  """The better layout by the model (see the module docstring); `reason` gives both predictions."""
  if margin < 0 or handoff_s < 0:
    raise ValueError(f'margin={margin} and handoff_s={handoff_s} must be >= 0.')
  pinned = dict(pinned or {})
  co_space = dataclasses.replace(space, colocate_generation=True)
  co = planner.plan(profiles, co_space, schedule, {r: q for r, q in pinned.items() if r != planner.GENERATION})
  if 'generation' not in profiles:
    return GenerationChoice(True, co, {'colocated': co.env_steps_per_s}, handoff_s,
                            'co-located: no generation profile, so the model cannot weigh a separate process')
  sep_space = dataclasses.replace(space, colocate_generation=False, step_handoff_s=handoff_s)
  sep = planner.plan(profiles, sep_space, schedule, pinned)
  predicted = {'colocated': co.env_steps_per_s, 'separate': sep.env_steps_per_s}
  gain = sep.env_steps_per_s / co.env_steps_per_s - 1
  text = (f'co-located {co.describe()}; separate {sep.describe()}; per-step hand-off {handoff_s * 1e6:.0f} us')
  if gain > margin:
    return GenerationChoice(False, sep, predicted, handoff_s,
                            f'separate: predicted {gain:+.1%} over co-located (> {margin:.0%}); {text}')
  why = 'slower' if gain <= 0 else f'within the {margin:.0%} margin'
  return GenerationChoice(True, co, predicted, handoff_s,
                          f'co-located: separate generation is predicted {gain:+.1%} ({why}); {text}')
