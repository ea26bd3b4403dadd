"""An MJX env group that the generation worker acts for (`--nocolocate_generation` with --backend=mjx or mjx_warp).

Each policy step the rollout worker hands the group's observations to the generation worker with the step's
sampling key, gets the action chunk back, and steps its jitted simulation stage (`rollout.mjx.step_transition`,
the same function the co-located program scans over) writing the step's transition into device buffers in place.
The keys are the co-located program's (`collect_iteration`: the iteration's rollout key split into unrolls, each
split into steps; GRPO first splits off its reset key), and the generation worker samples each request with the
key it carries (`gen_stages.make_act_per_request`), so a served group collects the segment the co-located group
would, up to float rounding of a batched matmul. The one difference: `policy_version` is the version the reply
says acted (the newest the generation worker holds, at least the group's due version), not the one the
co-located worker read before the iteration.

The hand-off (`RolloutConfig.generation_transport`): 'host' sends the observations through the shared-memory
mailbox (device_get here, device_put there, and back); 'cuda_ipc' writes them into this slice's device buffer
(`transport.cuda_ipc.OwnedSlot`) and sends only the small request record.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import keys
from ebrl_jax.rollout import mjx as mjx_rollout
from ebrl_jax.sim import stages as sim_stages
from ebrl_jax.transport import cuda_ipc


def _step(env, episodic, env_state, active, buffers, stats, t, actions, raw_actions, log_probs, version):
  """One served step: the env steps the chunk; its transition goes into row t of `buffers` [U * T, B, ...]."""
  out = gen_stages.ActOutput(actions=actions, raw_actions=raw_actions, log_probs=log_probs, values=None)
  env_state, active, transition, step_stats = mjx_rollout.step_transition(env, env_state, active, out, version,
                                                                          episodic)
  buffers = jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), t, 0), buffers,
                         transition)
  stats = jax.tree.map(jnp.add, stats, step_stats)
  return env_state, active, buffers, stats


def _finish(unrolls: int, buffers):
  """[U * T, B, ...] -> [T, U * B, ...], the co-located program's segment layout."""
  return mjx_rollout.merge_unrolls(jax.tree.map(lambda x: x.reshape((unrolls, -1) + x.shape[1:]), buffers))


class MjxServedGroup:
  """Holds the group's env state on the device; the generation worker acts for it. `make_remote(handle=...)`
  gives the `rollout.groups.RemoteAct` of its one slice."""
  remote = True

  def __init__(self, cfg: Any, group: int, make_remote: Callable, tracer=None):
    del tracer
    s, spec = cfg.sim, cfg.collect
    self._spec, self._n = spec, cfg.group_envs
    env = mjx_rollout.make_env(s, auto_reset=not spec.episodic)  # the co-located group's env (memoised)
    env_spec = sim.env_spec(s.task, s.episode_length, s.action_repeat)
    o, k, a = env_spec.obs_dim, spec.action_chunk, env_spec.action_dim
    key = keys.env_reset_key(keys.cell_key(keys.root(cfg.seed), cfg.cell), group)
    self._reset = jax.jit(functools.partial(sim_stages.reset, env, num_envs=self._n, group_size=s.group_size))
    self._env_state = self._reset(key)
    self._step = jax.jit(functools.partial(_step, env, spec.episodic), donate_argnums=(0, 2, 3))
    self._finish = jax.jit(functools.partial(_finish, spec.unrolls))
    rows, n = spec.unrolls * spec.steps, self._n
    self._template = types.Transition(obs=((rows, n, o), np.float32),
                                      raw_action=((rows, n, k, a), np.float32),
                                      reward=((rows, n), np.float32),
                                      termination=((rows, n), np.float32),
                                      truncation=((rows, n), np.float32),
                                      next_obs=((rows, n, o), np.float32),
                                      behaviour_log_prob=((rows, n), np.float32),
                                      mask=((rows, n), np.float32),
                                      policy_version=((rows, n), np.int32))
    self.transport = cfg.generation_transport or 'host'
    self._slot = cuda_ipc.OwnedSlot(cuda_ipc.Layout(n, o, k, a)) if self.transport == 'cuda_ipc' else None
    self._remote = make_remote(handle=None if self._slot is None else self._slot.handle)
    self._no_obs = np.zeros((0, o), np.float32)

  def _act(self, obs, key):
    """(actions, raw_actions, log_probs, version) for the step's observations, from the generation worker."""
    if self._slot is None:
      reply = self._remote.request(np.asarray(obs), key)
      return reply.actions, reply.raw_actions, reply.log_probs, reply.version
    self._slot.put_obs(obs)
    reply = self._remote.request(self._no_obs, key)
    return (*self._slot.reply(), reply.version)

  def collect(self, params, version: int, key):
    del params, version  # the generation worker holds the parameters; each step's reply says which version acted
    spec = self._spec
    if spec.episodic:
      reset_key, key = jax.random.split(key)
      self._env_state = self._reset(reset_key)
      unroll_keys = [key]
    else:
      unroll_keys = list(jax.random.split(key, spec.unrolls))
    buffers = types.Transition(*(jnp.zeros(shape, dtype) for shape, dtype in self._template))
    stats = types.EpisodeStats(*(jnp.zeros((), jnp.float32) for _ in range(3)))
    row = 0
    for unroll_key in unroll_keys:
      step_keys = np.asarray(jax.random.split(unroll_key, spec.steps), np.uint32)
      active = jnp.ones((self._n,), jnp.float32)
      for t in range(spec.steps):
        actions, raw, log_probs, acted = self._act(self._env_state.brax_state.obs, step_keys[t])
        self._env_state, active, buffers, stats = self._step(self._env_state, active, buffers, stats, np.int32(row),
                                                             actions, raw, log_probs, np.int32(acted))
        row += 1
    batch, stats = jax.device_get((self._finish(buffers), stats))
    return (types.Transition(*(np.asarray(x) for x in batch)),
            types.EpisodeStats(float(stats.return_sum), float(stats.length_sum), float(stats.count)))

  def set_min_version(self, version: int) -> None:
    self._remote.min_version = version

  def prepare_next(self) -> None:
    pass  # the reset is part of the next collect (GRPO) or not needed (auto-reset)

  def close(self) -> None:
    if self._slot is not None:
      self._slot.close()
