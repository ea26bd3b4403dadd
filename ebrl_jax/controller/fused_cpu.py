"""Fused schedule on native MuJoCo: the CPU env pool stepped from a Python loop around jitted `act`/`train_step`.

NOTE: one policy step costs one `act` dispatch plus one env-pool step; the trajectory is written into
preallocated numpy buffers and handed to `train_step` once per iteration. Keys depend only on the iteration
index (`iteration_keys`), so a process schedule with one env group replays exactly this run.
"""
from __future__ import annotations

import functools
import time
from typing import Dict, Tuple

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.controller import metrics as metrics_lib
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.rollout import evaluation
from ebrl_jax.sim import cpu_env
from ebrl_jax.trainer import stages as trainer_stages


def iteration_keys(base_key, iteration: int, group: int = 0):
  """(rollout key of env group `group`, train key) for `iteration`: the same in every schedule."""
  it_key = jax.random.fold_in(base_key, iteration)
  roll_key, train_key = jax.random.split(it_key)
  return jax.random.fold_in(roll_key, group), train_key


def make_pool(cfg: config_lib.Config, num_envs: int, seed: int, auto_reset: bool) -> cpu_env.CpuEnvPool:
  sc = cfg.sim
  return cpu_env.CpuEnvPool(sc.task, num_envs, sc.episode_length, sc.action_repeat, sc.num_threads, seed=seed,
                            group_size=sc.group_size, auto_reset=auto_reset)


def make_train_fn(cfg: config_lib.Config, network, optimizer, recompute_proximal: bool):
  return jax.jit(functools.partial(trainer_stages.train_step, network, optimizer, cfg.algo, cfg.policy.min_std,
                                   group_size=cfg.sim.group_size, recompute_proximal=recompute_proximal),
                 donate_argnums=(0,))


class CpuFusedLoop:
  """Steps `num_envs` native MuJoCo envs; PPO collects U unrolls per env, GRPO one whole episode per env."""

  def __init__(self, cfg: config_lib.Config, spec: types.EnvSpec, network, optimizer):
    self._cfg, self._spec = cfg, spec
    episodic = cfg.algo.name == 'grpo'
    self._pool = make_pool(cfg, cfg.sim.num_envs, cfg.schedule.seed, auto_reset=not episodic)
    self._evaluator = evaluation.CpuEvaluator(cfg, network)
    unrolls, steps = cfg.segment_shape
    self._act = cpu_rollout.make_act(network, cfg.policy.min_std)
    self._collector = cpu_rollout.CpuCollector(self._pool, spec, None, unrolls, steps, cfg.policy.action_chunk,
                                               episodic)
    self._train = make_train_fn(cfg, network, optimizer, recompute_proximal=False)
    self._base_key = jax.random.PRNGKey(cfg.schedule.seed + 1)

  def compile(self, train_state, num_iterations: int) -> float:
    del num_iterations  # the Python loop compiles per-step programs only
    t0 = time.monotonic()
    obs = np.zeros((self._cfg.sim.num_envs, self._spec.obs_dim), np.float32)
    key = jax.random.PRNGKey(0)
    self._act = self._act.lower(train_state.params, obs, key, 0).compile()
    self._collector._act = self._act  # pylint: disable=protected-access
    self._evaluator.lower_and_compile(train_state.params)
    batch = jax.tree.map(np.asarray, self._collector.buffer.transition())
    self._train = self._train.lower(train_state, batch, key).compile()
    return time.monotonic() - t0

  def run_iterations(self, train_state, num_iterations: int, key) -> Tuple[object, Dict[str, float]]:
    del key  # keys come from the iteration index
    acc = metrics_lib.IterationMetrics(self._cfg.algo.name)
    for _ in range(num_iterations):
      version = int(train_state.policy_version)  # = iterations trained so far
      roll_key, train_key = iteration_keys(self._base_key, version)
      batch, stats = self._collector.collect(train_state.params, version, roll_key)
      train_state, metrics = self._train(train_state, batch, train_key)
      acc.add(jax.device_get(metrics), stats.return_sum, stats.count)
    return train_state, acc.result()

  def evaluate(self, params, key) -> Dict[str, float]:
    return self._evaluator.evaluate(params, key)

  def close(self) -> None:
    self._pool.close()
    self._evaluator.close()
