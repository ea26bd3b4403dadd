"""The training driver's cadence (`trainer.driver`): what it counts as the run goes on (`Progress`), the run's
iterations and those between two evaluations (`iteration_plan`), the iterations a chunk ran (`account`), whether
a checkpoint is due (`checkpoint_due`), and how many iterations its next chunk runs (`chunk_size`).

A chunk runs up to the next evaluation, cut at --first_checkpoint_iteration, at half of what the rest of
--max_wall_s (and of --max_train_s) holds at the latest iteration rate (so chunks shrink towards a budget, the last
one a single iteration), and, while signals are held (`runtime.errors.deferred_stops`), at the iterations that fit
the stop latency. Where a budget or held signals bound the chunk and the rate is not known yet (a run's first
chunk, a resumed run's too), the chunk is one iteration, timed: never a whole evaluation interval unseen.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

from ebrl_jax import config_checks


@dataclasses.dataclass
class Progress:
  """What the driver counts as the run goes on (mutable: one instance per run)."""
  env_steps: int
  iterations: int
  last_saved: int  # the iteration of the newest checkpoint (a resumed run's starting point is on disk)
  checkpoint: Optional[int] = None  # the newest checkpoint on disk (None: none yet)
  train_wall: float = 0.0  # seconds of collection + training, start-up excluded
  steps_this_session: int = 0  # env steps counted in the end-to-end rate
  compile_s: Optional[float] = None  # start-up, once it is over
  startup_s: Optional[float] = None  # a process schedule's first iteration, moved into compile_s
  s_per_iteration: Optional[float] = None  # of the latest chunk, start-up included (sizes a chunk to the budget)
  evaluated: Optional[int] = None  # the iteration whose evaluation was asked for last (None: none yet)
  target_hit: Optional[Tuple[int, float, float]] = None  # (env steps, wall s, train s) when the target was hit
  failure: Optional[str] = None  # what stopped a DIVERGED or OUT_OF_MEMORY run: no checkpoint is saved after it
  eval_curve: list = dataclasses.field(default_factory=list)


def account(progress: Progress, source, num: int, elapsed: float, per_iteration: int, logger,
            clock) -> Tuple[int, float]:
  """Counts `num` finished iterations that took `elapsed` s (on the driver's `logger` and run `clock`); a process
  schedule's first iteration is start-up (its seconds go into compile_s, its steps out of the rate; see
  `trainer.worker.ChannelSource.take_startup_s`). Returns (iterations counted in the rate, their seconds)."""
  progress.s_per_iteration = elapsed / max(num, 1)
  startup = source.take_startup_s() if hasattr(source, 'take_startup_s') else None
  counted = num
  if startup is not None:
    progress.startup_s = startup
    clock.mark('first_iteration', seconds=startup)
    progress.compile_s += startup
    elapsed -= startup
    counted -= 1
    logger.log(progress.env_steps, {'time/compile_s': progress.compile_s})
  progress.train_wall += elapsed
  progress.iterations += num
  progress.env_steps += num * per_iteration
  progress.steps_this_session += counted * per_iteration
  return counted, elapsed


def iteration_plan(schedule, env_steps_per_iteration: int) -> Tuple[int, int, int]:
  """(env steps per iteration, total iterations, iterations per evaluation) of a `config.ScheduleConfig`: whole
  chunks only, since a shorter last chunk would be a second program to compile (MJX) mid-run."""
  total, per_eval = config_checks.planned_iterations(schedule.num_timesteps, env_steps_per_iteration,
                                                     schedule.num_evals)
  return env_steps_per_iteration, total, per_eval


def checkpoint_due(progress: Progress, per_eval: int, every: int, total: int) -> bool:
  """Whether the evaluation at the iteration reached is one of the --checkpoint_every cadence (every `every`
  evaluation intervals, counted from iteration 0, so a resumed run keeps an uninterrupted run's cadence), the run's
  last or the target's."""
  on_cadence = progress.iterations % per_eval == 0 and (progress.iterations // per_eval) % every == 0
  return on_cadence or progress.iterations >= total or progress.target_hit is not None


def _fit(n: int, room: float, s_per_iteration: Optional[float]) -> int:
  """`n` cut at the iterations `room` seconds hold at `s_per_iteration` (at least one; one while it is unknown)."""
  if not s_per_iteration:
    return 1
  return min(n, max(1, math.ceil(room / s_per_iteration)))


def chunk_size(schedule: Any,
               progress: Progress,
               per_eval: int,
               total: int,
               now: float,
               held_latency_s: Optional[float] = None) -> int:
  """Iterations of the next chunk (see the module's docstring). `schedule`: the `config.ScheduleConfig`; `now`: the
  run clock's seconds (--max_wall_s counts from process start); `held_latency_s`: while signals are held, the
  seconds of work a stop may wait for (`errors.STOP_LATENCY_S`; None: signals are not held)."""
  n = min(per_eval - progress.iterations % per_eval, total - progress.iterations)
  rate = progress.s_per_iteration
  if held_latency_s is not None:  # whole iterations that fit the latency (floor: a stop waits no longer)
    n = min(n, max(1, math.floor(held_latency_s / rate)) if rate else 1)
  first = schedule.first_checkpoint_iteration
  if schedule.checkpoint_every and progress.last_saved < first and progress.iterations < first:
    n = min(n, first - progress.iterations)
  # Half the rest of each budget at the latest rate: a rate that drops mid-chunk then overshoots by less.
  if schedule.max_wall_s:
    n = _fit(n, (schedule.max_wall_s - now) / 2, rate)
  if schedule.max_train_s:
    n = _fit(n, (schedule.max_train_s - progress.train_wall) / 2, rate)
  return n
