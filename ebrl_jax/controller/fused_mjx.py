"""Fused schedule on MJX: each call runs a chunk of iterations (rollout scan + train_step) as one jitted program.

A cell of several (`controller.cells`) splits the chunk at its train step: the collection of one iteration stays
one jitted program on the cell's own envs (`keys.cell_key`: its env resets and rollouts), and the train step is
the step over the ranks (`trainer.ranks.RankStep`, as a native-MuJoCo cell's: the gradients all-reduced, the
stop vote, the parameter chain), the two stepped from Python by `fused_steps.run_iterations`. The one-cell chunk
is unchanged: the iteration inside it collects through the same `_collect`.
"""
from __future__ import annotations

from concurrent import futures
import functools
import time
from typing import Dict, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.controller import fused_steps
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.rollout import mjx as rollout
from ebrl_jax.runtime import trace_cache
from ebrl_jax.sim import stages as sim_stages
from ebrl_jax.trainer import ranks
from ebrl_jax.trainer import stages as trainer_stages


def trace_key(cfg: config_lib.Config, env) -> tuple:
  """What the fused programs' traces depend on beyond their arguments' shapes: the env (its config and its model's
  arrays), the policy, the algorithm and the collection (not the run's directory, length or seed: those reach the
  programs as arguments or not at all)."""
  return (cfg.sim, cfg.policy, cfg.algo, cfg.collect_spec, trace_cache.env_model_digest(env))


def _collect(cfg: config_lib.Config, env, network, params, iteration, env_state, key):
  """One iteration's collection (`rollout.collect_iteration`) for every env as env group 0, from the rollout key
  `key` (`keys.rollout_key` of the iteration, from the run's root or a cell's: `keys.cell_key`)."""
  return rollout.collect_iteration(env, network, cfg.collect_spec, cfg.sim.num_envs, params, iteration, env_state, key)


def _iteration(cfg: config_lib.Config, env, network, optimizer, root_key, carry, _):
  """One iteration: collect, then train; the keys come from the iteration index (`train_state.policy_version`), as
  in every other schedule."""
  train_state, env_state = carry
  iteration = train_state.policy_version
  env_state, batch, stats = _collect(cfg, env, network, train_state.params, iteration, env_state,
                                     keys.rollout_key(root_key, iteration, 0))
  train_state, metrics = trainer_stages.train_step(network,
                                                   optimizer,
                                                   cfg.algo,
                                                   cfg.policy.min_std,
                                                   train_state,
                                                   batch,
                                                   keys.train_key(root_key, iteration),
                                                   group_size=cfg.sim.group_size,
                                                   recompute_proximal=False)
  metrics = dict(metrics)
  metrics['episodes'] = stats.count
  metrics['episode_return_sum'] = stats.return_sum
  return (train_state, env_state), metrics


def _run_chunk(cfg, env, network, optimizer, train_state, env_state, root_key, num_iterations):
  """`num_iterations` iterations (a traced int32: one compiled program runs a chunk of any length, so the driver
  cuts chunks where it likes, at --max_wall_s or a stop, without a compile); returns the states and each metric
  summed over the chunk (means are taken on the host). The iteration is jitted once here and called by the loop:
  its trace for the metrics' shapes is the one the loop's body reuses (JAX caches a jitted function's trace)."""
  step = jax.jit(lambda key, carry: _iteration(cfg, env, network, optimizer, key, carry, None))
  shapes = step.eval_shape(root_key, (train_state, env_state))[1]

  def body(_, carry):
    train_state, env_state, sums = carry
    (train_state, env_state), metrics = step(root_key, (train_state, env_state))
    return train_state, env_state, jax.tree.map(jnp.add, sums, metrics)

  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return jax.lax.fori_loop(0, num_iterations, body, (train_state, env_state, zeros))


class MjxFusedLoop:
  """Holds the env state between chunks; compiles the chunk program once, for chunks of any length. With
  a `cell` of several: its own envs, one collection program, and the train step over the ranks with `vote`."""

  def __init__(self, cfg: config_lib.Config, spec: types.EnvSpec, network, optimizer, cell=None, vote=None):
    self._cfg = cfg
    self._env = rollout.make_env(cfg.sim, auto_reset=not cfg.algo.episodic)
    self._network, self._optimizer = network, optimizer
    self._root_key = keys.root(cfg.schedule.seed)
    self._rollout_root = keys.cell_key(self._root_key, cell.rank if cell is not None else 0)
    self._trace_dir = trace_cache.cache_dir_for(cfg.schedule.compilation_cache_dir, cfg.schedule.trace_cache)
    reset = functools.partial(sim_stages.reset, self._env, num_envs=cfg.sim.num_envs, group_size=cfg.sim.group_size)
    reset_key = keys.env_reset_key(self._rollout_root, 0)
    self._trace_key = trace_key(cfg, self._env) if self._trace_dir else ()
    lowered, _ = trace_cache.lower(self._trace_dir, 'mjx_reset', reset, (reset_key,), self._trace_key)
    self._env_state = lowered.compile()(reset_key)
    self._program = None  # the chunk program, compiled (one-cell loop)
    self._evaluator = evaluation.make_evaluator(cfg.sim, cfg.policy, cfg.schedule.seed, cfg.schedule.deterministic_eval,
                                                network, trace_cache.lowerer(self._trace_dir))
    self._rank = None  # a cell of several: the step over the ranks, with this rank's stop vote
    if cell is not None and cell.multi:
      train_args = (network, optimizer, cfg.algo, cfg.policy.min_std, cfg.sim.group_size, False)  # as the chunk's
      self._rank = ranks.RankStep.over_ranks(train_args, vote)
      self._collect = jax.jit(functools.partial(_collect, cfg, self._env, network),
                              donate_argnums=(2,))  # (params, iteration, env_state, key)

  def _lower(self, train_state):
    fn = functools.partial(_run_chunk, self._cfg, self._env, self._network, self._optimizer)
    args = (train_state, self._env_state, self._root_key, jax.ShapeDtypeStruct((), jnp.int32))
    lowered, stats = trace_cache.lower(self._trace_dir,
                                       'fused_chunk',
                                       fn,
                                       args,
                                       key_parts=self._trace_key,
                                       donate_argnums=(0, 1))
    logging.info('Fused chunk program: trace cache %s.', stats.outcome)
    return lowered

  def compile(self, train_state, num_iterations: int) -> float:
    """Compiles the chunk (a cell of several: the collection and the step over the ranks) and evaluation programs
    ahead of time, side by side; returns the seconds it took. The chunk program runs any number of iterations, so
    `num_iterations` (the driver's usual chunk) does not shape it."""
    del num_iterations
    t0 = time.monotonic()
    if self._rank is not None:
      args = (train_state.params, train_state.policy_version, self._env_state, self._rollout_root)
      program, _ = trace_cache.lower(self._trace_dir,
                                     'mjx_cell_collect',
                                     functools.partial(_collect, self._cfg, self._env, self._network),
                                     args,
                                     self._trace_key,
                                     donate_argnums=(2,))
    else:
      program = self._lower(train_state)
    # XLA compiles outside the GIL: the programs build concurrently.
    with futures.ThreadPoolExecutor(2) as pool:
      program_future = pool.submit(program.compile)
      eval_future = pool.submit(self._evaluator.lower_and_compile, train_state.params)
      if self._rank is not None:
        shapes = program.out_info[1]  # the batch's shapes, from the lowering (no second trace)
        batch = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
        self._rank.compile(train_state, batch, keys.train_key(self._root_key, 0))
        self._collect = program_future.result()
      else:
        self._program = program_future.result()
      eval_future.result()
    if self._rank is not None:
      self._rank.probe(train_state.params)  # the all-reduce alone, once at the start (every rank here)
    return time.monotonic() - t0

  def _collect_cell(self, params, iteration, key):
    """`fused_steps`' collection of this cell: one program, the env state kept here between iterations."""
    self._env_state, batch, stats = self._collect(params, jnp.asarray(iteration, jnp.int32), self._env_state, key)
    return batch, stats

  def run_iterations(self, train_state, num_iterations: int) -> Tuple[object, Dict[str, float]]:
    if self._rank is not None:
      return fused_steps.run_iterations(self._collect_cell, self._rank, self._cfg.algo.name, self._root_key,
                                        self._rollout_root, train_state, num_iterations, self._rank)
    if self._program is None:  # a source used without `compile` first
      self._program = self._lower(train_state).compile()
    train_state, self._env_state, sums = self._program(train_state, self._env_state, self._root_key,
                                                       jnp.asarray(num_iterations, jnp.int32))
    sums = jax.device_get(sums)
    out = {
        f'train/{self._cfg.algo.name}/{k}': float(np.mean(v)) / num_iterations  # the chunk's mean
        for k, v in sums.items()
        if k not in ('episodes', 'episode_return_sum')
    }
    episodes = float(np.sum(sums['episodes']))
    if episodes:
      out['rollout/episode_return'] = float(np.sum(sums['episode_return_sum'])) / episodes
    return train_state, out

  def evaluate(self, params, key) -> Dict[str, float]:
    return self._evaluator.evaluate(params, key)

  def summary_extra(self) -> dict:
    return {} if self._rank is None else self._rank.summary_extra()

  def close(self) -> None:
    self._program = None
