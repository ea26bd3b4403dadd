"""Fused schedule on native MuJoCo: the CPU env pool stepped from a Python loop around jitted `act`/`train_step`.

NOTE: one policy step costs one `act` dispatch plus one threaded env-pool step; the trajectory is written into
preallocated numpy buffers and handed to `train_step` once per iteration.
"""
from __future__ import annotations

import functools
import time
from typing import Dict, Tuple

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.sim import cpu_env
from ebrl_jax.trainer import stages as trainer_stages


def _act_at(network, min_std, deterministic, params, obs, key, index):
  """`act` with the step key folded in on the device, so the host loop does no key arithmetic per step."""
  return gen_stages.act(network, params, obs, jax.random.fold_in(key, index), deterministic=deterministic,
                        min_std=min_std)


class _SegmentBuffer:
  """Preallocated host arrays for one iteration's trajectories: [T, S, ...] (S = segments)."""

  def __init__(self, t: int, s: int, spec: types.EnvSpec, k: int):
    f32 = np.float32
    self.obs = np.zeros((t, s, spec.obs_dim), f32)
    self.next_obs = np.zeros((t, s, spec.obs_dim), f32)
    self.raw_action = np.zeros((t, s, k, spec.action_dim), f32)
    self.log_prob = np.zeros((t, s), f32)
    self.reward = np.zeros((t, s), f32)
    self.termination = np.zeros((t, s), f32)
    self.truncation = np.zeros((t, s), f32)
    self.mask = np.ones((t, s), f32)

  def transition(self, version: int) -> types.Transition:
    return types.Transition(
        obs=self.obs, raw_action=self.raw_action, reward=self.reward, termination=self.termination,
        truncation=self.truncation, next_obs=self.next_obs, behaviour_log_prob=self.log_prob, mask=self.mask,
        policy_version=np.full(self.reward.shape, version, np.int32))


class CpuFusedLoop:
  """Steps `num_envs` native MuJoCo envs; PPO collects U unrolls per env, GRPO one whole episode per env."""

  def __init__(self, cfg: config_lib.Config, spec: types.EnvSpec, network, optimizer):
    self._cfg, self._spec = cfg, spec
    sc, k = cfg.sim, cfg.policy.action_chunk
    episodic = cfg.algo.name == 'grpo'
    self._pool = cpu_env.CpuEnvPool(sc.task, sc.num_envs, sc.episode_length, sc.action_repeat, sc.num_threads,
                                    seed=cfg.schedule.seed, group_size=sc.group_size, auto_reset=not episodic)
    self._eval_pool = cpu_env.CpuEnvPool(sc.task, sc.num_eval_envs, sc.episode_length, sc.action_repeat,
                                         sc.num_threads, seed=cfg.schedule.seed + 10_000, auto_reset=False)
    self._steps = (sc.episode_length if episodic else cfg.algo.unroll_length) // k
    self._unrolls = 1 if episodic else cfg.unrolls_per_env
    self._buffer = _SegmentBuffer(self._steps, self._unrolls * sc.num_envs, spec, k)
    self._obs = None if episodic else self._pool.reset()
    self._act = jax.jit(functools.partial(_act_at, network, cfg.policy.min_std, False))
    self._act_det = jax.jit(functools.partial(_act_at, network, cfg.policy.min_std,
                                              cfg.schedule.deterministic_eval))
    self._train = jax.jit(functools.partial(trainer_stages.train_step, network, optimizer, cfg.algo,
                                            cfg.policy.min_std, group_size=sc.group_size,
                                            recompute_proximal=False), donate_argnums=(0,))

  def compile(self, train_state, num_iterations: int) -> float:
    del num_iterations  # the Python loop compiles per-step programs only
    t0 = time.monotonic()
    obs = np.zeros((self._cfg.sim.num_envs, self._spec.obs_dim), np.float32)
    key = jax.random.PRNGKey(0)
    self._act = self._act.lower(train_state.params, obs, key, 0).compile()
    eval_obs = np.zeros((self._cfg.sim.num_eval_envs, self._spec.obs_dim), np.float32)
    self._act_det = self._act_det.lower(train_state.params, eval_obs, key, 0).compile()
    batch = jax.tree.map(np.asarray, self._buffer.transition(0))
    self._train = self._train.lower(train_state, batch, key).compile()
    return time.monotonic() - t0

  def _collect(self, params, version: int, key) -> Tuple[float, float]:
    """Fills the buffer; returns (sum of finished-episode returns, number of finished episodes)."""
    buf, n = self._buffer, self._cfg.sim.num_envs
    episodic = self._cfg.algo.name == 'grpo'
    if episodic:
      self._obs = self._pool.reset()
      active = np.ones((n,), np.float32)
      buf.mask[:] = 1.0
    ret_sum, count, index = 0.0, 0.0, 0
    for u in range(self._unrolls):
      cols = slice(u * n, (u + 1) * n)
      for t in range(self._steps):
        out = self._act(params, self._obs, key, index)
        index += 1
        raw, log_prob = np.asarray(out.raw_actions), np.asarray(out.log_probs)
        res = self._pool.step(np.asarray(out.actions))
        done = np.asarray(res.done, np.float32)
        trunc = np.asarray(res.truncation, np.float32)
        mask = active if episodic else 1.0
        buf.obs[t, cols] = self._obs
        buf.raw_action[t, cols] = raw
        buf.log_prob[t, cols] = log_prob
        buf.reward[t, cols] = res.reward * mask
        buf.termination[t, cols] = done * (1.0 - trunc)
        buf.truncation[t, cols] = trunc
        buf.next_obs[t, cols] = res.obs
        finished = done * mask
        ret_sum += float(np.sum(res.episode_return * finished))
        count += float(np.sum(finished))
        if episodic:
          buf.mask[t, cols] = active
          active = active * (1.0 - done)
        self._obs = res.obs
    return ret_sum, count

  def run_iterations(self, train_state, num_iterations: int, key) -> Tuple[object, Dict[str, float]]:
    sums: Dict[str, float] = {}
    ret_sum = count = 0.0
    for i in range(num_iterations):
      it_key = jax.random.fold_in(key, i)
      roll_key, train_key = jax.random.split(it_key)
      version = int(train_state.policy_version)
      r, c = self._collect(train_state.params, version, roll_key)
      ret_sum, count = ret_sum + r, count + c
      train_state, metrics = self._train(train_state, self._buffer.transition(version), train_key)
      for name, value in jax.device_get(metrics).items():
        sums[name] = sums.get(name, 0.0) + float(value)
    out = {f'train/{self._cfg.algo.name}/{k}': v / num_iterations for k, v in sums.items()}
    if count:
      out['rollout/episode_return'] = ret_sum / count
    return train_state, out

  def evaluate(self, params, key) -> Dict[str, float]:
    n, k = self._cfg.sim.num_eval_envs, self._cfg.policy.action_chunk
    obs = self._eval_pool.reset()
    active = np.ones((n,), np.float32)
    ret, length = np.zeros((n,), np.float64), np.zeros((n,), np.float64)
    for t in range(self._cfg.sim.episode_length // k):
      out = self._act_det(params, obs, key, t)
      res = self._eval_pool.step(np.asarray(out.actions))
      ret += res.reward * active
      length += k * active
      active = active * (1.0 - np.asarray(res.done, np.float32))
      obs = res.obs
      if not active.any():
        break
    return {'eval/episode_return': float(ret.mean()), 'eval/episode_length': float(length.mean())}

  def close(self) -> None:
    self._pool.close()
    self._eval_pool.close()
