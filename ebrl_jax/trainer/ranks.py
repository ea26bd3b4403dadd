"""A cell's trainer rank as a batch source steps it: the data-parallel train step with this rank's stop vote, the
parameter chain, and the all-reduce's time beside the step's.

A stop of a run of several cells (SIGTERM, Ctrl-C, --max_wall_s) is agreed, never taken alone: each rank only
votes (`StopVote.wish`: a signal it was sent, or its --max_wall_s budget passed on its clock), the vote rides on
the train step (`parallel.DataParallelTrainFn.voting`), and the step hands every rank the same answer, so all of
them stop after that step, at one iteration boundary, with one state; `RankStep` then raises
`errors.StopRequested` (the iteration counted), after which the driver saves rank 0's checkpoint and the run
ends as a finished one does (`stopped_together`: the end barrier is safe). A source that stopped on its own
instead (a second signal, the controller's stop after a fault) leaves the others to notice a dead rank.

The all-reduce is timed on its own (`parallel.allreduce_seconds`: the gradients' size, psum over the ranks) when
the source compiles and every `PROBE_EVERY` iterations, at the same iteration on every rank; the step's own
seconds are timed around each step (a step that compiles excluded).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import numpy as np

from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.trainer import parallel

PROBE_EVERY = 100  # iterations between two timings of the all-reduce (and one at compile)


class StopVote:
  """This rank's wish to stop: a signal it was sent (`ask`, or the `asked` callable: a reason or None), else
  'max_wall_s' once `budget_s` (> 0) has passed since `start_unix` (the run's clock), else '' (go on)."""

  def __init__(self, budget_s: float = 0.0, start_unix: Optional[float] = None, asked: Optional[Callable] = None):
    self._budget_s, self._start_unix = budget_s, time.time() if start_unix is None else start_unix
    self._asked_fn, self.asked = asked, ''

  def ask(self, reason: str) -> None:
    self.asked = self.asked or reason

  def wish(self) -> str:
    asked = self.asked or (self._asked_fn() if self._asked_fn is not None else None)
    if asked:
      return asked
    if self._budget_s and time.time() - self._start_unix >= self._budget_s:
      return 'max_wall_s'
    return ''


def stopped_together(cell_step: dict) -> bool:
  """Whether the ranks stopped at one agreed step (`RankStep.summary_extra()['cell_step']`, or a summary's
  `extra['cells']`): then every rank reaches the end barrier."""
  return bool(cell_step.get('stop'))


class RankStep:
  """`(state, batch, key) -> (state, metrics)` of the data-parallel `train_fn` (`parallel.make_data_parallel_train_
  fn` over `mesh`) with `vote`'s wish on every step; raises `errors.StopRequested` after the step the ranks agreed
  to stop at (see the module's docstring); `.lower(...).compile()` as a jitted function."""

  def __init__(self, train_fn, mesh, vote: StopVote):
    self._train, self._mesh, self._vote = train_fn, mesh, vote
    self.chain = ''  # every step's parameters, hashed in a chain (equal on every rank)
    self._steps, self._step_s, self._timed = 0, 0.0, 0
    self._allreduce_s, self._allreduce_bytes = [], 0
    self._stop = None
    self._compiled = False

  @classmethod
  def over_ranks(cls, train_args: tuple, vote: Optional[StopVote] = None) -> 'RankStep':
    """The step of `stages.make_train_fn(*train_args)`'s arguments (network, optimizer, algo, min_std, group_size,
    recompute_proximal) over every rank (`parallel.rank_mesh`), with `vote` (None: a vote that never asks)."""
    mesh = parallel.rank_mesh()
    return cls(parallel.make_data_parallel_train_fn(*train_args, mesh), mesh, vote or StopVote())

  def probe(self, params) -> None:
    """Times the all-reduce of the gradients' size (every rank at the same point)."""
    seconds, self._allreduce_bytes = parallel.allreduce_seconds(self._mesh, params)
    self._allreduce_s.append(seconds)

  def compile(self, state, batch, key) -> None:
    self._train = self._train.lower(state, batch, key).compile()
    self._compiled = True

  def __call__(self, state, batch, key):
    iteration = int(state.policy_version)
    if self._steps and self._steps % PROBE_EVERY == 0:
      self.probe(state.params)
    t0 = time.perf_counter()
    state, metrics, agreed = self._train.voting(state, batch, key, parallel.STOP_REASONS.index(self._vote.wish()))
    if self._compiled or self._steps:  # the first step of a source that did not compile ahead compiles
      self._step_s += time.perf_counter() - t0
      self._timed += 1
    self._steps += 1
    self.chain = distributed.chain_digest(self.chain, jax.tree_util.tree_leaves(state.params))
    if agreed:
      self._stop = {'reason': parallel.STOP_REASONS[agreed], 'iteration': iteration + 1}
    return state, metrics

  def check_stop(self, state, done: int, metrics: Optional[dict]) -> None:
    """After the source counted a step: `errors.StopRequested` when the ranks agreed to stop at it."""
    if self._stop is not None:
      raise errors.StopRequested(self._stop['reason'], done, state, metrics)

  def summary_extra(self) -> dict:
    allreduce = float(np.median(self._allreduce_s)) if self._allreduce_s else None
    step = self._step_s / self._timed if self._timed else None
    return {
        'params_chain': self.chain,
        'cell_step': {
            'allreduce_s': allreduce,  # one all-reduce of the gradients' size, alone (median of the timings)
            'allreduce_bytes': self._allreduce_bytes,
            'allreduce_timings': len(self._allreduce_s),
            'train_step_s': step,  # one train step (its all-reduce inside), mean of the steps timed
            'allreduce_fraction': allreduce / step if allreduce is not None and step else None,
            'stop': self._stop
        }
    }
