"""Data-parallel trainer ranks: the train step over one mesh axis that spans every rank's devices.

Each rank (one process per cell, joined by `jax.distributed`) holds the whole train state and its own cell's
batch. `make_data_parallel_train_fn` runs `stages.train_step` under `shard_map` with the batch's segment axis
split over the ranks and the state replicated; the step's means, normaliser update and (as their transpose) the
gradients are reduced over the ranks by XLA collectives (NCCL on GPUs, gloo on CPU), so every rank ends the step
with the same parameters. Nothing else crosses ranks: no batch, no weights outside that all-reduce.

The function takes and returns this rank's host-local state (arrays on its own device), so the driver, the
evaluator, the parameter store and the checkpoints see what they see on one rank.

  mesh = parallel.rank_mesh()
  train_fn = parallel.make_data_parallel_train_fn(network, optimizer, algo, min_std, group_size, True, mesh)
  state, metrics = train_fn(state, local_batch, key)   # the same key on every rank
  state, metrics, agreed = train_fn.voting(state, local_batch, key, vote)  # with every rank's stop vote

A vote is this rank's wish to stop, an index into `STOP_REASONS` (0: go on): the step also takes the largest vote
over the ranks, so every rank learns the same answer from the same step and they all stop after it, at one
iteration boundary, none left waiting in an all-reduce the others have left. `allreduce_seconds` times one
all-reduce of a pytree's size over the ranks (the gradients': the parameters' shapes) on its own, to set beside
the step's time.

On one rank (`mesh` of one device) it returns `stages.make_train_fn`'s function: the one-rank step, unchanged.
Minibatch m of the global batch is the union of every rank's minibatch m (each rank shuffles its own segments);
with one minibatch per epoch that is the one-rank step on the concatenated batch, to float rounding.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebrl_jax.trainer import stages

RANKS = 'ranks'  # the mesh axis of the trainer ranks
# Why the ranks stop, by vote (its index; 0: go on): the ranks take the largest, so a signal outranks the budget.
STOP_REASONS = ('', 'max_wall_s', 'SIGINT', 'SIGTERM')


def rank_mesh() -> Mesh:
  """One device per rank: the first local device of every process, in process order."""
  first = {}
  for d in jax.devices():
    first.setdefault(d.process_index, d)
  return Mesh(np.array([first[p] for p in sorted(first)]), (RANKS,))


def _global(mesh: Mesh, spec: PartitionSpec, tree: Any) -> Any:
  sharding = NamedSharding(mesh, spec)
  return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def _local(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)


def make_data_parallel_train_fn(network,
                                optimizer,
                                algo,
                                min_std: float,
                                group_size: int,
                                recompute_proximal: bool,
                                mesh: Mesh,
                                axis_name: str = RANKS):
  """`(state, local_batch, key) -> (state, metrics)` over the ranks of `mesh` (see the module's docstring)."""
  if mesh.size == 1:
    return stages.make_train_fn(network, optimizer, algo, min_std, group_size, recompute_proximal)
  train_step = functools.partial(stages.train_step,
                                 network,
                                 optimizer,
                                 algo,
                                 min_std,
                                 group_size=group_size,
                                 recompute_proximal=recompute_proximal,
                                 axis_name=axis_name)

  def step(state, batch, key, vote):
    state, metrics = train_step(state, batch, key)
    return state, metrics, jax.lax.pmax(vote, axis_name)

  replicated, segments, ranks = PartitionSpec(), PartitionSpec(None, axis_name), PartitionSpec(axis_name)
  specs = (replicated, segments, replicated, ranks)  # batch leaves are [T, S, ...]; a vote [1] per rank
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(replicated,) * 3))
  return DataParallelTrainFn(mesh, sharded, specs)


def _vote(vote: int) -> np.ndarray:
  return np.full((1,), vote, np.int32)


class DataParallelTrainFn:
  """`(state, local_batch, key) -> (state, metrics)` on host-local arrays around the global program `fn`; like a
  jitted function, `.lower(state, batch, key).compile()` compiles it ahead of time (the same callable, compiled)."""

  def __init__(self, mesh: Mesh, fn, specs):
    self._mesh, self._fn, self._specs = mesh, fn, specs

  def _globals(self, args):
    return [_global(self._mesh, spec, a) for spec, a in zip(self._specs, args)]

  def __call__(self, state, batch, key):
    state, metrics, _ = self.voting(state, batch, key, 0)
    return state, metrics

  def voting(self, state, batch, key, vote: int) -> Tuple[Any, Any, int]:
    """The step with this rank's stop vote; also returns the largest vote of the ranks (the same on each)."""
    state, metrics, agreed = self._fn(*self._globals((state, batch, key, _vote(vote))))
    return _local(state), _local(metrics), int(np.asarray(_local(agreed))[0])

  def lower(self, state, batch, key):
    lowered = self._fn.lower(*self._globals((state, batch, key, _vote(0))))
    return _Lowered(lambda: DataParallelTrainFn(self._mesh, lowered.compile(), self._specs))


class _Lowered:

  def __init__(self, compile_fn):
    self.compile = compile_fn


def allreduce_seconds(mesh: Mesh, tree: Any, reps: int = 3, axis_name: str = RANKS) -> Tuple[float, int]:
  """(median seconds, bytes) of one all-reduce (a sum over the ranks of `mesh`) of float32 arrays shaped like
  `tree`'s leaves, as its own jitted program. The first call (its compile, and the ranks' meeting) is not timed;
  every rank must call it at the same point of the run, as every collective."""
  local = jax.tree_util.tree_map(lambda x: np.zeros((1,) + np.shape(x), np.float32), tree)
  reduce_fn = jax.jit(
      jax.shard_map(lambda t: jax.lax.psum(t, axis_name),
                    mesh=mesh,
                    in_specs=PartitionSpec(axis_name),
                    out_specs=PartitionSpec()))
  operand = _global(mesh, PartitionSpec(axis_name), local)
  jax.block_until_ready(reduce_fn(operand))
  seconds = []
  for _ in range(max(1, reps)):
    t0 = time.perf_counter()
    jax.block_until_ready(reduce_fn(operand))
    seconds.append(time.perf_counter() - t0)
  return float(np.median(seconds)), int(sum(x.nbytes for x in jax.tree_util.tree_leaves(local)))
