"""Rollouts on native MuJoCo: an env pool stepped from a host loop around a jitted `act`.

Used by the fused schedule (one collector over all envs) and by rollout workers (one collector per env group).
With camera observations (`--obs=pixels`) the pool renders stacked frames after each reset and step, and the
policy's observation is a `types.PixelObs` of those pixels beside the state (`observe`).
NOTE: a collector's buffer is reused by the next `collect`; consumers copy it (or hand it on) before then.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Optional, Tuple

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import render


def camera_of(sim: config_lib.SimConfig) -> Optional[render.CameraObs]:
  """The pool's camera for `--obs=pixels` (`render.camera_of`: square RGB or, with --pixel_depth, RGB-D frames of
  the task's 'fixed' camera, stacked), else None.
  On a machine without a display this picks a headless GL backend first (`render.ensure_headless_gl`)."""
  if sim.obs != 'pixels':
    return None
  render.ensure_headless_gl()
  return render.camera_of(sim)


def make_pool(sim: config_lib.SimConfig, num_envs: int, seed: int, auto_reset: bool) -> cpu_env.CpuEnvPool:
  """`num_envs` native-MuJoCo envs of `sim`'s task on `sim.num_threads` threads (rendering with `--obs=pixels`)."""
  return cpu_env.CpuEnvPool(sim.task,
                            num_envs,
                            sim.episode_length,
                            sim.action_repeat,
                            sim.num_threads,
                            seed=seed,
                            group_size=sim.group_size,
                            auto_reset=auto_reset,
                            camera=camera_of(sim),
                            randomization=sim.randomization,
                            solver=(sim.solver_iterations, sim.ls_iterations))


def observe(pool, state: np.ndarray, env_ids=None):
  """The policy's observation of envs `env_ids` (all by default): `state` [n, O] itself, or with a camera a
  `types.PixelObs` of the pool's current pixel stacks [n, H, W, C] uint8 beside it."""
  if not pool.spec.pixel_shape:
    return state
  return types.PixelObs(pixels=pool.pixels(env_ids), state=state)


def zero_obs(spec: types.EnvSpec, num_envs: int):
  """Zero observations of `num_envs` envs, shaped as `observe` gives them (what ahead-of-time compiles take)."""
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                      types.obs_template((num_envs,), spec.obs_dim, spec.pixel_shape))


def _put(dst, index, src) -> None:
  """dst[index] = src for an observation (an array, or each leaf of a `PixelObs`)."""
  for d, v in zip(jax.tree_util.tree_leaves(dst), jax.tree_util.tree_leaves(src)):
    d[index] = v


def _take(obs, lo: int, hi: int):
  return jax.tree.map(lambda x: x[lo:hi], obs)


class SegmentBuffer:
  """Preallocated host arrays for [T, S, ...] trajectories (S segments), shaped by `types.transition_template`."""

  def __init__(self, t: int, s: int, spec: types.EnvSpec, k: int):
    template = types.transition_template(t, s, spec.obs_dim, k, spec.action_dim, spec.pixel_shape)
    self.arrays = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), template)
    self.arrays.mask[...] = 1.0

  def transition(self) -> types.Transition:
    return self.arrays

  def write(self, t: int, cols: slice, obs, out_raw, out_log_prob, res: types.StepResult, next_obs, version: int,
            mask) -> np.ndarray:
    """Stores one policy step (`next_obs`: the observation after it, `res.obs` with pixels if any); returns
    `done` as float32."""
    done = np.asarray(res.done, np.float32)
    trunc = np.asarray(res.truncation, np.float32)
    a = self.arrays
    _put(a.obs, (t, cols), obs)
    a.raw_action[t, cols] = out_raw
    a.behaviour_log_prob[t, cols] = out_log_prob
    a.reward[t, cols] = res.reward * mask
    a.termination[t, cols] = done * (1.0 - trunc)
    a.truncation[t, cols] = trunc
    _put(a.next_obs, (t, cols), next_obs)
    a.mask[t, cols] = mask
    a.policy_version[t, cols] = version
    return done


class CpuCollector:
  """Collects `unrolls` segments of `steps` policy steps from every env of `pool` (PPO), or one whole episode per
  env with resets at the start (`episodic`, GRPO). Segment s = u * num_envs + env (unroll-major).

  `act_fn` is one callable, or a list of one per env slice: then the pool's envs are split into that many equal,
  contiguous slices, each run from its own thread — act, step its envs (`pool.step(env_ids=...)`, physics on the
  pool's threads), write its columns of the buffer — so a slice waiting for its actions never holds the others.
  Slices meet only at the end of `collect`; the buffer is the same as without slices.
  NOTE: slices touch disjoint envs, buffer columns and observation rows; the pool allows that concurrently.
  """

  def __init__(self,
               pool,
               spec: types.EnvSpec,
               act_fn,
               unrolls: int,
               steps: int,
               action_chunk: int,
               episodic: bool,
               tracer=None):
    self._pool, self._tracer = pool, tracer
    self._n = pool.num_envs
    sliced = isinstance(act_fn, (list, tuple))
    self._act = None if sliced else act_fn
    self._slice_acts = list(act_fn) if sliced else []
    num_slices = max(1, len(self._slice_acts))
    if self._n % num_slices:
      raise ValueError(f'{num_slices} env slices must divide the pool\'s {self._n} envs.')
    self._slice_envs = self._n // num_slices
    self._executor = (concurrent.futures.ThreadPoolExecutor(num_slices, thread_name_prefix='env_slice')
                      if num_slices > 1 else None)
    self._unrolls, self._steps, self._episodic = unrolls, steps, episodic
    self.buffer = SegmentBuffer(steps, unrolls * self._n, spec, action_chunk)
    self._obs = None if episodic else observe(pool, pool.reset())
    self._prepared = False  # episodic: the next collect's reset has been done ahead (`prepare_next`)

  def set_act(self, act_fn) -> None:
    """Replaces the (unsliced) act, e.g. by its ahead-of-time compiled program."""
    self._act = act_fn

  def reset(self) -> None:
    """Fresh episodes for every env (after a fault, say)."""
    self._obs = None if self._episodic else observe(self._pool, self._pool.reset())

  def prepare_next(self) -> None:
    """Episodic: the next collect's reset, now (the overlap schedule calls it while the trainer trains). The
    pool's reset draws its numbers in call order, so the next episodes start from the same states."""
    if self._episodic and not self._prepared:
      self._obs = observe(self._pool, self._pool.reset())
      self._prepared = True

  def collect(self, params, version: int, key) -> Tuple[types.Transition, types.EpisodeStats]:
    if self._episodic and not self._prepared:
      self._obs = observe(self._pool, self._pool.reset())
    self._prepared = False
    if self._executor is None:
      stats = self._collect_envs(self._act, 0, self._n, params, version, key)
    else:
      m = self._slice_envs
      futures = [
          self._executor.submit(self._collect_envs, act, i * m, (i + 1) * m, params, version, key, i)
          for i, act in enumerate(self._slice_acts)
      ]
      parts = [f.result() for f in futures]  # re-raises a slice's exception (InterruptedError on stop)
      stats = types.EpisodeStats(*(sum(p[i] for p in parts) for i in range(3)))
    return self.buffer.transition(), stats

  def _collect_envs(self,
                    act_fn,
                    lo: int,
                    hi: int,
                    params,
                    version: int,
                    key,
                    slice_index: Optional[int] = None) -> types.EpisodeStats:
    """The policy/env loop over envs [lo, hi) (the whole pool: `slice_index` None), writing their columns."""
    buf, n, whole = self.buffer, self._n, slice_index is None
    env_ids = None if whole else np.arange(lo, hi)
    trace = {} if whole else {'slice': slice_index}
    obs = self._obs if whole else _take(self._obs, lo, hi)
    active = np.ones((hi - lo,), np.float32)
    ret_sum, len_sum, count, index = 0.0, 0.0, 0.0, 0
    for u in range(self._unrolls):
      cols = slice(u * n + lo, u * n + hi)
      for t in range(self._steps):
        t0 = time.time_ns() // 1000
        out = act_fn(params, obs, key, index)
        actions = np.asarray(out.actions)
        t1 = time.time_ns() // 1000
        index += 1
        res = self._pool.step(actions, env_ids)
        next_obs = observe(self._pool, res.obs, env_ids)
        if self._tracer is not None:
          self._tracer.add('gen/act', t0, t1 - t0, **trace)
          self._tracer.add('sim/step', t1, time.time_ns() // 1000 - t1, **trace)
        mask = active if self._episodic else 1.0
        # A remote generation worker reports the version it acted with; a local act uses `version`.
        done = buf.write(t, cols, obs, np.asarray(out.raw_actions), np.asarray(out.log_probs), res, next_obs,
                         int(getattr(out, 'version', version)), mask)
        finished = done * mask
        ret_sum += float(np.sum(res.episode_return * finished))
        len_sum += float(np.sum(res.episode_length * finished))
        count += float(np.sum(finished))
        if self._episodic:
          active = active * (1.0 - done)
        obs = next_obs
    if whole:
      self._obs = obs
    else:
      _put(self._obs, slice(lo, hi), obs)
    return types.EpisodeStats(ret_sum, len_sum, count)

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None


def evaluate(pool, act_fn, params, key, episode_length: int, action_chunk: int) -> Tuple[float, float]:
  """One episode on every env of `pool` (built with auto_reset=False): mean return and mean length."""
  obs = observe(pool, pool.reset())
  n = pool.num_envs
  active = np.ones((n,), np.float32)
  ret, length = np.zeros((n,), np.float64), np.zeros((n,), np.float64)
  for t in range(episode_length // action_chunk):
    out = act_fn(params, obs, key, t)
    res = pool.step(np.asarray(out.actions))
    ret += res.reward * active
    length += action_chunk * active
    active = active * (1.0 - np.asarray(res.done, np.float32))
    obs = observe(pool, res.obs)
    if not active.any():
      break
  return float(ret.mean()), float(length.mean())
