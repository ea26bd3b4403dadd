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

On one rank (`mesh` of one device) it returns `stages.make_train_fn`'s function: the one-rank step, unchanged.
Minibatch m of the global batch is the union of every rank's minibatch m (each rank shuffles its own segments);
with one minibatch per epoch that is the one-rank step on the concatenated batch, to float rounding.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebrl_jax.trainer import stages

RANKS = 'ranks'  # the mesh axis of the trainer ranks


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
  step = functools.partial(stages.train_step,
                           network,
                           optimizer,
                           algo,
                           min_std,
                           group_size=group_size,
                           recompute_proximal=recompute_proximal,
                           axis_name=axis_name)
  replicated, segments = PartitionSpec(), PartitionSpec(None, axis_name)  # batch leaves are [T, S, ...]
  sharded = jax.jit(
      jax.shard_map(step, mesh=mesh, in_specs=(replicated, segments, replicated), out_specs=(replicated, replicated)))
  return DataParallelTrainFn(mesh, sharded, (replicated, segments, replicated))


class DataParallelTrainFn:
  """`(state, local_batch, key) -> (state, metrics)` on host-local arrays around the global program `fn`; like a
  jitted function, `.lower(state, batch, key).compile()` compiles it ahead of time (the same callable, compiled)."""

  def __init__(self, mesh: Mesh, fn, specs):
    self._mesh, self._fn, self._specs = mesh, fn, specs

  def _globals(self, args):
    return [_global(self._mesh, spec, a) for spec, a in zip(self._specs, args)]

  def __call__(self, state, batch, key):
    state, metrics = self._fn(*self._globals((state, batch, key)))
    return _local(state), _local(metrics)

  def lower(self, state, batch, key):
    lowered = self._fn.lower(*self._globals((state, batch, key)))
    return _Lowered(lambda: DataParallelTrainFn(self._mesh, lowered.compile(), self._specs))


class _Lowered:

  def __init__(self, compile_fn):
    self.compile = compile_fn
