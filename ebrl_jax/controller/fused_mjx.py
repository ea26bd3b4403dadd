"""Fused schedule on MJX: each call runs a chunk of iterations (rollout scan + train_step) as one jitted program."""
from __future__ import annotations

from concurrent import futures
import functools
import time
from typing import Dict, Tuple

import jax

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.rollout import mjx as rollout
from ebrl_jax.sim import stages as sim_stages
from ebrl_jax.trainer import stages as trainer_stages


def _iteration(cfg: config_lib.Config, env, network, optimizer, root_key, carry, _):
  """One iteration: collect (`rollout.collect_iteration`) for every env as env group 0, then train; the keys come
  from the iteration index (`train_state.policy_version`), as in every other schedule."""
  train_state, env_state = carry
  iteration = train_state.policy_version
  env_state, batch, stats = rollout.collect_iteration(env, network, cfg.collect_spec, cfg.sim.num_envs,
                                                      train_state.params, iteration, env_state,
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


def _run_chunk(cfg, env, network, optimizer, num_iterations, train_state, env_state, root_key):
  step = functools.partial(_iteration, cfg, env, network, optimizer, root_key)
  (train_state, env_state), metrics = jax.lax.scan(step, (train_state, env_state), None, length=num_iterations)
  return train_state, env_state, metrics


class MjxFusedLoop:
  """Holds the env state between chunks; compiles the chunk program once (plus a remainder program if needed)."""

  def __init__(self, cfg: config_lib.Config, spec: types.EnvSpec, network, optimizer):
    self._cfg = cfg
    self._env = rollout.make_env(cfg.sim, auto_reset=not cfg.algo.episodic)
    self._network, self._optimizer = network, optimizer
    self._root_key = keys.root(cfg.schedule.seed)
    self._env_state = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))(self._env,
                                                                          keys.env_reset_key(self._root_key, 0),
                                                                          cfg.sim.num_envs, cfg.sim.group_size)
    self._programs: Dict[int, object] = {}
    self._evaluator = evaluation.make_evaluator(cfg.sim, cfg.policy, cfg.schedule.seed, cfg.schedule.deterministic_eval,
                                                network)

  def _lower(self, train_state, num_iterations: int):
    fn = functools.partial(_run_chunk, self._cfg, self._env, self._network, self._optimizer, num_iterations)
    return jax.jit(fn, donate_argnums=(0, 1)).lower(train_state, self._env_state, self._root_key)

  def _program(self, train_state, num_iterations: int):
    if num_iterations not in self._programs:
      self._programs[num_iterations] = self._lower(train_state, num_iterations).compile()
    return self._programs[num_iterations]

  def compile(self, train_state, num_iterations: int) -> float:
    """Compiles the chunk and evaluation programs ahead of time, side by side; returns the seconds it took."""
    t0 = time.monotonic()
    chunk = self._lower(train_state, num_iterations)
    # XLA compiles outside the GIL: the two programs build concurrently.
    with futures.ThreadPoolExecutor(2) as pool:
      chunk_future = pool.submit(chunk.compile)
      eval_future = pool.submit(self._evaluator.lower_and_compile, train_state.params)
      self._programs[num_iterations] = chunk_future.result()
      eval_future.result()
    return time.monotonic() - t0

  def run_iterations(self, train_state, num_iterations: int) -> Tuple[object, Dict[str, float]]:
    program = self._program(train_state, num_iterations)
    train_state, self._env_state, metrics = program(train_state, self._env_state, self._root_key)
    metrics = jax.device_get(metrics)
    out = {
        f'train/{self._cfg.algo.name}/{k}': float(v.mean())
        for k, v in metrics.items()
        if k not in ('episodes', 'episode_return_sum')
    }
    episodes = float(metrics['episodes'].sum())
    if episodes:
      out['rollout/episode_return'] = float(metrics['episode_return_sum'].sum()) / episodes
    return train_state, out

  def evaluate(self, params, key) -> Dict[str, float]:
    return self._evaluator.evaluate(params, key)

  def close(self) -> None:
    self._programs.clear()
