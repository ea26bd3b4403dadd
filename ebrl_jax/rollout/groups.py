"""Env groups for a rollout worker, behind one `Group` protocol: an MJX group (one jitted program collects the
group's share of an iteration on the device), an MJX group the generation worker acts for (rollout/mjx_remote.py:
a host loop around the jitted simulation step) and a native-MuJoCo group (a host loop around a jitted `act`, or
around requests to the generation worker — one `RemoteAct` per env slice)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import List, Protocol, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import trace_cache
from ebrl_jax.sim import registry

HANDLE_BYTES = 64  # a CUDA IPC memory handle (transport/cuda_ipc.py); zeros on the host path


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """A rollout worker's part of the run: its simulation and policy, how it collects, and what the topology says
  about its env group (envs per group, the staleness bound, env slices served by a generation worker)."""
  process: startup.ProcessConfig
  sim: config_lib.SimConfig
  policy: config_lib.PolicyConfig
  collect: config_lib.CollectSpec
  seed: int
  group_envs: int
  staleness_bound: int
  env_slices: int = 1
  # Overlap windows this worker runs (controller/iteration_graph.py): 'reset_next' resets a native-MuJoCo
  # group's envs for its next episodes right after it hands in a segment.
  windows: Tuple[str, ...] = ()
  # --deterministic: iteration i acts with exactly version max(0, i - staleness_bound), not the newest.
  deterministic: bool = False
  # Envs of one segment record (0: the whole group): with --group_schedule a group's segment travels as
  # group_envs / block_envs records, each one env block of the run's fixed block layout.
  block_envs: int = 0
  # With a separate generation worker: 'host' (the shared-memory mailbox) or, for MJX groups, 'cuda_ipc' (device
  # buffers, transport/cuda_ipc.py); '' with co-located generation.
  generation_transport: str = ''
  cell: int = 0  # the cell (trainer rank) whose envs these are: its own keys (`keys.cell_key`; cell 0: one GPU's)


class Group(Protocol):
  """One env group's simulation and acting. `remote` is True when a generation worker acts for it."""
  remote: bool

  def collect(self, params, version: int, key) -> Tuple[types.Transition, types.EpisodeStats]:
    """One iteration's segments [T, S_g, ...] as numpy arrays, and the episodes that ended in them."""

  def set_min_version(self, version: int) -> None:
    """The oldest policy version a remote act may answer with (a local act is given its parameters)."""

  def prepare_next(self) -> None:
    """Work for the next collect that needs no parameters (the 'reset_next' overlap window), or nothing."""

  def close(self) -> None:
    """Frees the group's envs and threads."""


class MjxGroup:
  """Holds the group's env state on the device between collections."""
  remote = False

  def __init__(self, cfg: RolloutConfig, group: int, network):
    from ebrl_jax.rollout import mjx as mjx_rollout  # lazy: brax and MJX load only in an MJX group's process
    from ebrl_jax.sim import stages as sim_stages  # lazy: as above
    num_envs, sim = cfg.group_envs, cfg.sim
    env = mjx_rollout.make_env(sim, auto_reset=not cfg.collect.episodic)
    key = keys.env_reset_key(keys.cell_key(keys.root(cfg.seed), cfg.cell), group)
    trace_dir = cfg.process.trace_cache_dir
    key_parts = (sim, cfg.policy, cfg.collect, num_envs, trace_cache.env_model_digest(env) if trace_dir else '')
    reset = functools.partial(sim_stages.reset, env, num_envs=num_envs, group_size=sim.group_size)
    self._env_state = trace_cache.jit(trace_dir, 'mjx_reset', reset, key_parts)(key)
    self._program = trace_cache.jit(trace_dir,
                                    'mjx_group_collect',
                                    functools.partial(mjx_rollout.collect_iteration, env, network, cfg.collect,
                                                      num_envs),
                                    key_parts,
                                    donate_argnums=(2,))

  def collect(self, params, version: int, key):
    self._env_state, batch, stats = self._program(params, jnp.int32(version), self._env_state, key)
    batch, stats = jax.device_get((batch, stats))
    return (types.Transition(*(np.asarray(x) for x in batch)),
            types.EpisodeStats(float(stats.return_sum), float(stats.length_sum), float(stats.count)))

  def set_min_version(self, version: int) -> None:
    del version

  def prepare_next(self) -> None:
    pass  # the reset is inside the jitted collect program

  def close(self) -> None:
    pass


class RemoteAct:
  """Stands in for a local `act`: sends one slice's observations (the whole group's without slices) to the
  generation worker, waits for its reply. `request(obs, key)` is the same with the step's sampling key (MJX
  groups); `handle` is the slice's CUDA IPC buffer handle (then `obs` has 0 rows: it lies in that buffer).

  NOTE: a request whose reply does not come within `resend_s` is sent again (the generation worker may have
  died and been replaced); replies carry the request's seq, so a late duplicate is recognised and dropped.
  """

  def __init__(self, mailbox, group: int, stop, env_slice: int = 0, resend_s: float = 2.0, handle=None):
    self._mailbox, self._group, self._slice = mailbox, group, env_slice
    self._stop, self._resend_s = stop, resend_s
    self._owner = np.int32(os.getpid())
    self._handle = np.zeros((HANDLE_BYTES,), np.uint8) if handle is None else np.asarray(handle, np.uint8)
    self.min_version, self._seq = 0, 0

  def _ask(self, obs, key) -> None:
    request = types.ActRequest(group=np.int32(self._group),
                               env_slice=np.int32(self._slice),
                               seq=np.int32(self._seq),
                               min_version=np.int32(self.min_version),
                               obs=np.asarray(obs, np.float32),
                               key=key,
                               owner=self._owner,
                               handle=self._handle)
    while not self._stop.is_set():
      try:
        self._mailbox.ask(request, timeout=0.5)
        return
      except TimeoutError:
        continue
    raise InterruptedError('stop requested')

  def request(self, obs, key=None):
    """The reply to `obs` ([B_s, O] numpy), sampled with `key` ([2] uint32; None: the worker's own keys)."""
    key = np.zeros((2,), np.uint32) if key is None else np.asarray(key, np.uint32)
    self._seq += 1
    self._ask(obs, key)
    while not self._stop.is_set():
      try:
        reply = self._mailbox.receive(self._group, timeout=self._resend_s, env_slice=self._slice)
      except TimeoutError:
        self._ask(obs, key)
        continue
      if int(reply.seq) == self._seq:
        return reply
    raise InterruptedError('stop requested')

  def __call__(self, params, obs, key, index):
    del params, key, index  # the generation worker holds the parameters and its own keys
    return self.request(obs)


class CpuGroup:
  """A native-MuJoCo env group and its collector; with a generation worker, one remote act per env slice."""

  def __init__(self, cfg: RolloutConfig, group: int, network, tracer, mailbox=None, stop=None):
    spec = cfg.collect
    env_spec = registry.spec_of(cfg.sim)
    # Group 0's envs are the fused schedule's envs, so one group replays it exactly.
    seed = keys.env_seed(cfg.seed, keys.ENV_RESET, group, cell=cfg.cell)
    self._pool = cpu_rollout.make_pool(cfg.sim, cfg.group_envs, seed, auto_reset=not spec.episodic)
    self.remote_acts: List[RemoteAct] = []
    if mailbox is None:
      act = gen_stages.make_act(network, cfg.policy.min_std)
    else:
      self.remote_acts = [RemoteAct(mailbox, group, stop, s) for s in range(cfg.env_slices)]
      act = self.remote_acts if len(self.remote_acts) > 1 else self.remote_acts[0]
    self.remote = bool(self.remote_acts)
    self.collector = cpu_rollout.CpuCollector(self._pool, env_spec, act, spec.unrolls, spec.steps, spec.action_chunk,
                                              spec.episodic, tracer if tracer.enabled else None)

  def set_min_version(self, version: int) -> None:
    for remote in self.remote_acts:
      remote.min_version = version

  def collect(self, params, version: int, key):
    return self.collector.collect(params, version, key)

  def prepare_next(self) -> None:
    self.collector.prepare_next()

  def close(self) -> None:
    self.collector.close()
    self._pool.close()


def make_group(cfg: RolloutConfig, group: int, network, tracer, mailbox=None, stop=None) -> Group:
  if cfg.sim.backend == 'mujoco_cpu':
    return CpuGroup(cfg, group, network, tracer, mailbox, stop)
  if mailbox is not None:
    from ebrl_jax.rollout import mjx_remote  # lazy: brax and MJX load only in an MJX group's process
    return mjx_remote.MjxServedGroup(cfg, group, functools.partial(RemoteAct, mailbox, group, stop, 0), tracer)
  return MjxGroup(cfg, group, network)
