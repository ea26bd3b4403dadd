"""The fused schedule's iterations stepped from Python: collect this cell's batch, train on it, count its metrics.

The native-MuJoCo loop (`fused_cpu.CpuFusedLoop`, always) and an MJX cell of several (`fused_mjx.MjxFusedLoop`,
whose one-cell chunk stays one jitted program) share it, so both cells train alike: the rollout keys are the cell's
(`rollout_root`: `keys.cell_key(root, rank)`), the train keys the run's (`root_key`: the same on every rank), and
`train` is, for a cell of several, the step over the ranks (`trainer.ranks.RankStep`), after which the ranks' agreed
stop is checked at every step (`RankStep.check_stop`); one cell's held signal (`errors.deferred_stops`) stops it
after the running iteration (`errors.StopRequested`, that iteration counted and its state whole).

  state, metrics = fused_steps.run_iterations(collect, train, algo_name, root_key, rollout_root, state, n, rank)

`collect(params, iteration, key) -> (batch [T, S, ...], types.EpisodeStats)` collects iteration `iteration` with
`params` from the rollout key `key`; `train(state, batch, key) -> (state, metrics)`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import jax

from ebrl_jax.rollout import keys
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import metrics as metrics_lib


def run_iterations(collect: Callable,
                   train: Callable,
                   algo_name: str,
                   root_key,
                   rollout_root,
                   train_state,
                   num_iterations: int,
                   rank: Optional[Any] = None) -> Tuple[Any, Dict[str, float]]:
  """`num_iterations` iterations (see the module's docstring); returns the state and their metrics (the train
  metrics' means, the return of the episodes this cell finished). `rank`: the cell's `RankStep`, whose agreed stop
  raises `errors.StopRequested` after the step it was agreed at, that iteration counted."""
  acc = metrics_lib.IterationMetrics(algo_name)
  for done in range(num_iterations):
    iteration = int(train_state.policy_version)  # = iterations trained so far
    batch, stats = collect(train_state.params, iteration, keys.rollout_key(rollout_root, iteration, 0))
    train_state, metrics = train(train_state, batch, keys.train_key(root_key, iteration))
    stats = jax.device_get(stats)
    acc.add(jax.device_get(metrics), float(stats.return_sum), float(stats.count))
    if rank is not None:  # the ranks agreed to stop after this step: all of them stop here
      rank.check_stop(train_state, done + 1, acc.result())
    elif errors.pending_stop():  # a signal held (`errors.deferred_stops`): stop after this iteration, counted
      raise errors.StopRequested(errors.pending_stop(), done + 1, train_state, acc.result())
  return train_state, acc.result()
