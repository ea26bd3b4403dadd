"""The driver's evaluation curve: each evaluation recorded in order, in line or off the critical path.

`record` appends one point to a run's curve (and notes the target); every point is keyed by the policy version
evaluated (the trainer iteration it was asked for at, which also picks its key) and the env steps trained then.
`OffPath` is the overlap schedule's 'evaluate' window (controller/iteration_graph.py): version v's evaluation runs
in one background thread on a device copy of its parameters (the next train step donates the train state) while
training goes on, and its point is recorded, in order, before the next evaluation and at the end, with the step
counts of the moment it was asked for. The same parameters and key as in line: the same return, bit for bit.
`trainer.remote_eval.RemoteEvaluations` (the evaluator process) has the same interface: `in_line_first`,
`submit`, `poll`, `finish`, `close`, `summary_extra`.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, List, Optional, Tuple

import jax


def record(progress,
           logger,
           target: Optional[float],
           eval_metrics,
           env_steps: int,
           wall_s: float,
           train_s: float,
           version: int,
           unix: Optional[float] = None,
           *,
           reached_s: float) -> float:
  """Appends the evaluation of policy `version` to `progress.eval_curve` (and `progress.target_hit` once `target`
  is reached); logs it at `env_steps`. `wall_s` (run clock) and `unix` (`time.time()`, default now) say when it
  finished, `reached_s` (run clock) when training had reached the version and asked for its
  evaluation: the pace of training is read between those (an evaluation off the path finishes late, by how far
  its evaluator lags). Returns the evaluation's return."""
  eval_return = eval_metrics['eval/episode_return']
  progress.eval_curve.append({
      'version': int(version),
      'env_steps': env_steps,
      'wall_s': round(wall_s, 3),
      'reached_s': round(reached_s, 3),
      'train_s': round(train_s, 3),
      'return': eval_return,
      'unix': round(time.time() if unix is None else unix, 3)
  })
  logger.log(env_steps, eval_metrics)
  if target is not None and progress.target_hit is None and eval_return >= target:
    progress.target_hit = (env_steps, wall_s, train_s)
  return eval_return


def device_copy(tree):
  """A copy of every array of `tree` that a later donation of the original leaves intact."""
  return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


class OffPath:
  """Evaluations in one background thread, recorded in the order they were asked for. The run's first one runs
  in line (`in_line_first`: it compiles the evaluation); `poll` waits for the one asked for before, so at most one
  runs beside training (sync's semantics: the curve is sync's)."""
  in_line_first = True

  def __init__(self, target: Optional[float]):
    self._target = target
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='evaluate')
    self._pending: List[Tuple[concurrent.futures.Future, int, int, float, float]] = []

  def submit(self, source, params, key, progress, reached_s: float) -> None:
    """`source.evaluate(params, key)` in the background, for the point at `progress`'s step counts now
    (`reached_s`: the run clock now)."""
    future = self._executor.submit(source.evaluate, device_copy(params), key)
    self._pending.append((future, progress.iterations, progress.env_steps, progress.train_wall, reached_s))

  def poll(self, progress, logger, now: Callable[[], float]) -> Optional[float]:
    """Waits for every pending evaluation and records it; returns the last return (None: none pending)."""
    eval_return = None
    while self._pending:
      future, version, env_steps, train_s, reached_s = self._pending.pop(0)
      eval_return = record(progress,
                           logger,
                           self._target,
                           future.result(),
                           env_steps,
                           now(),
                           train_s,
                           version,
                           reached_s=reached_s)
    return eval_return

  finish = poll  # at the run's end: the same wait

  def close(self, progress, logger, now: Callable[[], float], quiet: Tuple[type, ...] = ()) -> None:
    """Records what is still pending (an evaluation that raised one of `quiet`, a stop request say, ends it
    without a word), then stops the thread."""
    try:
      self.poll(progress, logger, now)
    except quiet:
      pass
    finally:
      self._executor.shutdown(wait=True, cancel_futures=True)

  def summary_extra(self) -> dict:
    return {}
