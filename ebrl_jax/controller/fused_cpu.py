"""Fused schedule on native MuJoCo: the CPU env pool stepped from a Python loop around jitted `act`/`train_step`.

NOTE: one policy step costs one `act` dispatch plus one env-pool step; the trajectory is written into
preallocated numpy buffers and handed to `train_step` once per iteration. Keys depend only on the iteration
index (`rollout.keys`), so a process schedule with one env group replays exactly this run. A cell of several
(`controller.cells`) steps its own envs (`keys.cell_key`) and trains through `trainer.ranks.RankStep` over the ranks
(the step carries its stop vote: `vote`); the iterations are `fused_steps.run_iterations`, as an MJX cell's.
"""
from __future__ import annotations

import time
from typing import Dict, Tuple

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.controller import fused_steps
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import trace_cache
from ebrl_jax.trainer import ranks
from ebrl_jax.trainer import stages as trainer_stages


class CpuFusedLoop:
  """Steps `num_envs` native MuJoCo envs; PPO collects U unrolls per env, GRPO one whole episode per env."""

  stops_each_iteration = True  # fused_steps checks a held signal after every iteration (driver.BatchSource)

  def __init__(self, cfg: config_lib.Config, spec: types.EnvSpec, network, optimizer, cell=None, vote=None):
    self._cfg, self._spec = cfg, spec
    collect = cfg.collect_spec
    seed, rank = cfg.schedule.seed, cell.rank if cell is not None else 0
    self._pool = cpu_rollout.make_pool(cfg.sim,
                                       cfg.sim.num_envs,
                                       keys.env_seed(seed, keys.ENV_RESET, 0, cell=rank),
                                       auto_reset=not collect.episodic)
    self._evaluator = evaluation.make_evaluator(cfg.sim, cfg.policy, seed, cfg.schedule.deterministic_eval, network)
    self._act = gen_stages.make_act(network, cfg.policy.min_std)
    self._collector = cpu_rollout.CpuCollector(self._pool, spec, self._act, collect.unrolls, collect.steps,
                                               collect.action_chunk, collect.episodic)
    train_args = (network, optimizer, cfg.algo, cfg.policy.min_std, cfg.sim.group_size, False)  # no proximal
    self._rank = None  # a cell of several: the step over the ranks, with this rank's stop vote
    if cell is not None and cell.multi:
      self._rank = self._train = ranks.RankStep.over_ranks(train_args, vote)
    self._train_fn = trainer_stages.train_fn(*train_args)
    if self._rank is None:  # compiled ahead by `compile`, through the trace cache
      self._train = jax.jit(self._train_fn, donate_argnums=(0,))
    self._train_key = (cfg.algo, cfg.policy, cfg.sim.group_size, False)  # the trace cache's, as the trainer's
    self._root_key = keys.root(seed)
    self._rollout_root = keys.cell_key(self._root_key, rank)

  def compile(self, train_state, num_iterations: int) -> float:
    del num_iterations  # the Python loop compiles per-step programs only
    t0 = time.monotonic()
    obs = cpu_rollout.zero_obs(self._spec, self._cfg.sim.num_envs)
    key = jax.random.PRNGKey(0)
    self._act = self._act.lower(train_state.params, obs, key, 0).compile()
    self._collector.set_act(self._act)
    self._evaluator.lower_and_compile(train_state.params)
    batch = jax.tree.map(np.asarray, self._collector.buffer.transition())
    if self._rank is not None:
      self._rank.compile(train_state, batch, key)
      self._rank.probe(train_state.params)  # the all-reduce alone, once at the start (every rank here)
    else:
      trace_dir = trace_cache.cache_dir_for(self._cfg.schedule.compilation_cache_dir, self._cfg.schedule.trace_cache)
      lowered, _ = trace_cache.lower(trace_dir,
                                     'train_step',
                                     self._train_fn, (train_state, batch, key),
                                     self._train_key,
                                     donate_argnums=(0,))
      self._train = lowered.compile()
    return time.monotonic() - t0

  def run_iterations(self, train_state, num_iterations: int) -> Tuple[object, Dict[str, float]]:
    return fused_steps.run_iterations(self._collector.collect, self._train, self._cfg.algo.name, self._root_key,
                                      self._rollout_root, train_state, num_iterations, self._rank)

  def evaluate(self, params, key) -> Dict[str, float]:
    return self._evaluator.evaluate(params, key)

  def summary_extra(self) -> dict:
    return {} if self._rank is None else self._rank.summary_extra()

  def close(self) -> None:
    self._collector.close()
    self._pool.close()
    self._evaluator.close()
