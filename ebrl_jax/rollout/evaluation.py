"""Policy evaluation on fresh episodes, for every schedule: `make_evaluator(...)` picks the backend.

An evaluator has `lower_and_compile(params)` (ahead-of-time compile, callable from a worker thread),
`evaluate(params, key) -> {'eval/episode_return', 'eval/episode_length'}` and `close()`. It takes the parts of the
config it needs (the simulation and the policy), not the whole `Config`.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

import jax

from ebrl_jax import config as config_lib
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.rollout import keys


class CpuEvaluator:
  """`sim.num_eval_envs` native-MuJoCo envs without auto-reset, one episode each per evaluation."""

  def __init__(self, sim: config_lib.SimConfig, policy: config_lib.PolicyConfig, seed: int, deterministic: bool,
               network):
    self._sim, self._chunk = sim, policy.action_chunk
    self._pool = cpu_rollout.make_pool(sim, sim.num_eval_envs, keys.env_seed(seed, keys.EVAL_ENV), auto_reset=False)
    self._act = gen_stages.make_act(network, policy.min_std, deterministic)

  def lower_and_compile(self, params) -> None:
    obs = cpu_rollout.zero_obs(self._pool.spec, self._sim.num_eval_envs)
    self._act = self._act.lower(params, obs, jax.random.PRNGKey(0), 0).compile()

  def evaluate(self, params, key) -> Dict[str, float]:
    ret, length = cpu_rollout.evaluate(self._pool, self._act, params, key, self._sim.episode_length, self._chunk)
    return {'eval/episode_return': ret, 'eval/episode_length': length}

  def close(self) -> None:
    self._pool.close()


class MjxEvaluator:
  """`sim.num_eval_envs` MJX envs in one jitted episode scan."""

  def __init__(self,
               sim: config_lib.SimConfig,
               policy: config_lib.PolicyConfig,
               seed: int,
               deterministic: bool,
               network,
               lower: Optional[Callable] = None):
    del seed  # the evaluation's key carries its randomness
    from ebrl_jax.rollout import mjx as mjx_rollout  # lazy: brax and MJX load only for an MJX run
    env = mjx_rollout.make_env(sim, auto_reset=False)
    self._fn = functools.partial(mjx_rollout.evaluate_policy,
                                 env,
                                 network,
                                 num_envs=sim.num_eval_envs,
                                 num_steps=sim.episode_length // policy.action_chunk,
                                 min_std=policy.min_std,
                                 deterministic=deterministic)
    self._eval = jax.jit(self._fn)
    self._lower, self._key_parts, self._env = lower, (sim, policy, deterministic), env

  def lower_and_compile(self, params) -> None:
    """Compiles the evaluation scan, lowered by `lower` where given (the trace cache's: `trace_cache.lowerer`)."""
    args = (params, jax.random.PRNGKey(0))
    if self._lower is None:
      lowered = self._eval.lower(*args)
    else:
      lowered = self._lower('mjx_eval', self._fn, args, self._key_parts, env=self._env)
    self._eval = lowered.compile()

  def evaluate(self, params, key) -> Dict[str, float]:
    ret, length = jax.device_get(self._eval(params, key))
    return {'eval/episode_return': float(ret), 'eval/episode_length': float(length)}

  def close(self) -> None:
    pass


def make_evaluator(sim: config_lib.SimConfig,
                   policy: config_lib.PolicyConfig,
                   seed: int,
                   deterministic: bool,
                   network,
                   lower: Optional[Callable] = None):
  """The backend's evaluator; `lower(name, fn, args, key_parts, env=)` (e.g. `trace_cache.lowerer`: the trace cache)
  lowers an MJX evaluation scan where given, `jax.jit(fn).lower(*args)` otherwise."""
  if sim.backend == 'mujoco_cpu':
    return CpuEvaluator(sim, policy, seed, deterministic, network)
  return MjxEvaluator(sim, policy, seed, deterministic, network, lower)
