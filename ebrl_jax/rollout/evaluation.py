"""Policy evaluation on fresh episodes, for every schedule: `make_evaluator(cfg, network)` picks the backend.

An evaluator has `lower_and_compile(params)` (ahead-of-time compile, callable from a worker thread),
`evaluate(params, key) -> {'eval/episode_return', 'eval/episode_length'}` and `close()`.
"""
from __future__ import annotations

import functools
from typing import Dict

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax.rollout import cpu as cpu_rollout


class CpuEvaluator:
  """`num_eval_envs` native-MuJoCo envs without auto-reset, one episode each per evaluation."""

  def __init__(self, cfg: config_lib.Config, network):
    from ebrl_jax.sim import cpu_env  # pylint: disable=g-import-not-at-top
    sc = cfg.sim
    self._cfg = cfg
    self._pool = cpu_env.CpuEnvPool(sc.task, sc.num_eval_envs, sc.episode_length, sc.action_repeat, sc.num_threads,
                                    seed=cfg.schedule.seed + 10_000, auto_reset=False)
    self._act = cpu_rollout.make_act(network, cfg.policy.min_std, cfg.schedule.deterministic_eval)

  def lower_and_compile(self, params) -> None:
    obs = np.zeros((self._cfg.sim.num_eval_envs, self._pool.spec.obs_dim), np.float32)
    self._act = self._act.lower(params, obs, jax.random.PRNGKey(0), 0).compile()

  def evaluate(self, params, key) -> Dict[str, float]:
    ret, length = cpu_rollout.evaluate(self._pool, self._act, params, key, self._cfg.sim.episode_length,
                                       self._cfg.policy.action_chunk)
    return {'eval/episode_return': ret, 'eval/episode_length': length}

  def close(self) -> None:
    self._pool.close()


class MjxEvaluator:
  """`num_eval_envs` MJX envs in one jitted episode scan."""

  def __init__(self, cfg: config_lib.Config, network):
    from ebrl_jax.rollout import mjx as mjx_rollout  # pylint: disable=g-import-not-at-top
    from ebrl_jax.sim import stages as sim_stages  # pylint: disable=g-import-not-at-top
    env = sim_stages.make_mjx_env(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat, auto_reset=False)
    self._eval = jax.jit(functools.partial(
        mjx_rollout.evaluate_policy, env, network, num_envs=cfg.sim.num_eval_envs,
        num_steps=cfg.sim.episode_length // cfg.policy.action_chunk, min_std=cfg.policy.min_std,
        deterministic=cfg.schedule.deterministic_eval))

  def lower_and_compile(self, params) -> None:
    self._eval = self._eval.lower(params, jax.random.PRNGKey(0)).compile()

  def evaluate(self, params, key) -> Dict[str, float]:
    ret, length = jax.device_get(self._eval(params, key))
    return {'eval/episode_return': float(ret), 'eval/episode_length': float(length)}

  def close(self) -> None:
    pass


def make_evaluator(cfg: config_lib.Config, network):
  return MjxEvaluator(cfg, network) if cfg.sim.backend == 'mjx' else CpuEvaluator(cfg, network)
