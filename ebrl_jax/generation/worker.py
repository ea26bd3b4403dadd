"""Generation worker: serves actions to every env group from one process, batching whichever slices are ready.

A requester is an env slice: a group's `--env_slices` parts each ask on their own (one slice per group by
default, the whole group). A batch takes every request that is ready, of any group and slice, and is padded to
the smallest bucket that holds it (`batching.make_buckets`: the slice size times powers of two, up to all envs),
so XLA compiles one act program per bucket, all of them when the first parameters arrive. Each reply goes back
to its (group, slice). Parameters are refreshed from the store whenever a newer version is published (async),
and a request is never answered with a version older than its `min_version` (sync: exactly the version of the
group's iteration, which the trainer cannot pass before the group's segment — all its slices — arrives).
How many slices each batch held and which bucket it used is counted, and written to
`<run_dir>/generation_stats_<pid>_<start>.json` when the worker stops; the controller adds them to the summary.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, Optional, Sequence

from absl import logging
import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import batching
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import tracing
from ebrl_jax.transport import ChannelClosed
from ebrl_jax.transport import cuda_ipc

STATS_PREFIX = 'generation_stats_'


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """The generation worker's part of the run: the policy and the task it acts for, and from the topology the
  requesters it serves (`num_requesters` env slices of `slice_envs` envs, `total_envs` in all)."""
  process: startup.ProcessConfig
  sim: config_lib.SimConfig
  policy: config_lib.PolicyConfig
  seed: int
  num_requesters: int
  slice_envs: int
  total_envs: int
  # 'host' (the shared-memory mailbox) or 'cuda_ipc' (MJX groups' device buffers, transport/cuda_ipc.py).
  transport: str = 'host'
  action_chunk: int = 1
  cell: int = 0  # the cell whose groups it serves (its sampling keys: `keys.cell_key`)

  @property
  def per_request_keys(self) -> bool:
    """MJX groups send their step's key: a served step samples what a co-located one would."""
    return self.sim.backend != 'mujoco_cpu'


class ActServer:
  """Answers batches of act requests: pads the ready slices' observations to a bucket, acts once, replies to
  each request's (group, slice).

  `act(params, obs [B, O], key, index) -> ActOutput`-like (actions, raw_actions, log_probs); `mailbox` is a
  `transport.Mailbox` whose requests are `types.ActRequest`s of `slice_envs` envs each. With `per_request_keys`
  (MJX groups) `act` is `act(params, obs [B, O], keys [B / slice_envs, 2])`: each request samples with the key it
  carries (padding rows get key 0). With `slots` (a `transport.cuda_ipc.PeerSlots`) observations are read from,
  and replies written to, the requesters' device buffers; the records carry no arrays.
  """

  def __init__(self,
               mailbox,
               act: Callable,
               slice_envs: int,
               total_envs: int,
               obs_dim: int,
               tracer=None,
               reply_timeout_s: float = 2.0,
               per_request_keys: bool = False,
               slots=None):
    self._mailbox, self._act, self._m, self._tracer = mailbox, act, slice_envs, tracer
    self._reply_timeout_s = reply_timeout_s
    self._per_request_keys, self._slots = per_request_keys, slots
    self.buckets = batching.make_buckets(slice_envs, total_envs)
    self._obs = {b: np.zeros((b, obs_dim), np.float32) for b in self.buckets}
    self._programs: Dict[int, Callable] = {}
    self.requests_per_batch: collections.Counter = collections.Counter()
    self.batches_per_bucket: collections.Counter = collections.Counter()
    self.rows, self.padded_rows, self.dropped_replies = 0, 0, 0

  def _keys(self, bucket: int, requests=()) -> np.ndarray:
    keys = np.zeros((bucket // self._m, 2), np.uint32)
    for i, (_, request) in enumerate(requests):
      keys[i] = request.key
    return keys

  def compile(self, params, key) -> float:
    """Compiles the act program of every bucket (a jitted `act`); returns the seconds it took."""
    t0 = time.monotonic()
    for bucket in self.buckets:
      extra = (self._keys(bucket),) if self._per_request_keys else (key, 0)
      self._programs[bucket] = self._act.lower(params, self._obs[bucket], *extra).compile()
    return time.monotonic() - t0

  def serve(self, requests: Sequence, params, version: int, key, index: int) -> int:
    """Acts on `requests` ([(group, ActRequest)], from `mailbox.gather`) in one batch and replies to each.
    Returns the bucket (batch rows) used."""
    rows = len(requests) * self._m
    bucket = batching.bucket_for(self.buckets, rows)
    slices = [self._mailbox.slice_of(r) for _, r in requests]
    if self._slots is None:
      obs = batching.pack([r.obs for _, r in requests], self._obs[bucket])
    else:
      obs = self._slots.pack([(g, s, r) for (g, r), s in zip(requests, slices)], bucket)
    act = self._programs.get(bucket, self._act)
    start = time.time_ns() // 1000
    out = act(params, obs, self._keys(bucket, requests)) if self._per_request_keys else act(params, obs, key, index)
    if self._slots is None:
      actions, raw, log_probs = np.asarray(out.actions), np.asarray(out.raw_actions), np.asarray(out.log_probs)
    else:  # the records carry no arrays: each reply is written into its requester's buffer first
      actions = raw = np.zeros((0,) + out.actions.shape[1:], np.float32)
      log_probs = np.zeros((0,), np.float32)
    if self._tracer is not None:
      self._tracer.add('gen/act_batch', start, time.time_ns() // 1000 - start, batch=rows, bucket=bucket)
    for i, ((group, request), env_slice) in enumerate(zip(requests, slices)):
      part = slice(i * self._m, (i + 1) * self._m)
      if self._slots is not None:
        self._slots.write(group, env_slice, request, out.actions[part], out.raw_actions[part], out.log_probs[part])
        part = slice(0, 0)
      reply = types.ActReply(group=np.int32(group),
                             env_slice=np.int32(env_slice),
                             seq=np.int32(request.seq),
                             version=np.int32(version),
                             actions=actions[part],
                             raw_actions=raw[part],
                             log_probs=log_probs[part])
      try:
        self._mailbox.reply(group, reply, timeout=self._reply_timeout_s, env_slice=env_slice)
      except TimeoutError:  # nobody reads that slice's replies (its rollout worker is being restarted)
        self.dropped_replies += 1
        logging.warning('generation worker: dropped a reply to group %d, slice %d (seq %d).', group, env_slice,
                        int(request.seq))
    self.requests_per_batch[len(requests)] += 1
    self.batches_per_bucket[bucket] += 1
    self.rows += rows
    self.padded_rows += bucket - rows
    return bucket

  def stats(self) -> Dict[str, Any]:
    return {
        'slice_envs': self._m,
        'buckets': list(self.buckets),
        'batches': sum(self.requests_per_batch.values()),
        'requests_per_batch': {
            str(k): v for k, v in sorted(self.requests_per_batch.items())
        },
        'batches_per_bucket': {
            str(k): v for k, v in sorted(self.batches_per_bucket.items())
        },
        'rows': self.rows,
        'padded_rows': self.padded_rows,
        'dropped_replies': self.dropped_replies,
        'transport': 'host' if self._slots is None else 'cuda_ipc',
        'ipc_buffers_opened': 0 if self._slots is None else self._slots.opened
    }

  def close(self) -> None:
    if self._slots is not None:
      self._slots.close()


def merge_stats(paths: Sequence[str]) -> Optional[Dict[str, Any]]:
  """Sums the stats files of a run's generation workers (one per start); None if there are none."""
  merged: Optional[Dict[str, Any]] = None
  for path in paths:
    with open(path) as f:
      stats = json.load(f)
    if merged is None:
      merged = stats
      continue
    for name in ('batches', 'rows', 'padded_rows', 'dropped_replies', 'ipc_buffers_opened'):
      merged[name] = merged.get(name, 0) + stats.get(name, 0)
    for name in ('requests_per_batch', 'batches_per_bucket'):
      for k, v in stats[name].items():
        merged[name][k] = merged[name].get(k, 0) + v
  if merged is not None:
    merged['workers'] = len(paths)
  return merged


def make_server(cfg: GenerationConfig, mailbox, network, spec: types.EnvSpec, tracer=None) -> ActServer:
  """The worker's server: per-request keys for MJX groups, their device buffers over CUDA IPC."""
  slots = None
  if cfg.transport == 'cuda_ipc':
    slots = cuda_ipc.PeerSlots(cuda_ipc.Layout(cfg.slice_envs, spec.obs_dim, cfg.action_chunk, spec.action_dim))
  if cfg.per_request_keys:
    act = gen_stages.make_act_per_request(network, cfg.policy.min_std, cfg.slice_envs)
  else:
    act = gen_stages.make_act(network, cfg.policy.min_std)
  return ActServer(mailbox,
                   act,
                   cfg.slice_envs,
                   cfg.total_envs,
                   spec.obs_dim,
                   tracer,
                   per_request_keys=cfg.per_request_keys,
                   slots=slots)


def generation_main(cfg: GenerationConfig, mailbox: Any, store: Any, stop: Any, env: Optional[dict] = None):
  """Process entry point. Runs until the stop event is set (or its parent has gone)."""
  startup.start_process(cfg.process, env)
  stop = lifecycle.ParentWatch(stop)
  phase = lifecycle.Phase(cfg.process.run_dir, 'generation')
  phase('building the policy')
  tracer = tracing.Tracer(cfg.process.trace_dir, 'generation')
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  server = make_server(cfg, mailbox, network, spec, tracer if tracer.enabled else None)
  num_requesters = cfg.num_requesters
  logging.info('generation worker: %d requesters of %d envs; act batches padded to buckets %s (%d programs).',
               num_requesters, cfg.slice_envs, server.buckets, len(server.buckets))
  key = keys.generation_key(keys.cell_key(keys.root(cfg.seed), cfg.cell))
  version, params, calls = -1, None, 0
  stats_path = os.path.join(cfg.process.run_dir, f'{STATS_PREFIX}{os.getpid()}_{time.time_ns()}.json')
  phase(f'waiting for the first act requests of {num_requesters} env slices')
  try:
    while not stop.is_set():
      try:
        requests = mailbox.gather(num_requesters, timeout=0.5)
      except TimeoutError:
        continue
      need = max(int(r.min_version) for _, r in requests)
      if store.version() > version or need > version:
        with tracer.span('gen/refresh_params'):
          if calls == 0:
            phase(f'waiting for policy version {need}')
          if not lifecycle.wait_for_version(store, need, stop):
            break
          version, host = store.latest()
          params = jax.device_put(host)
        if calls == 0:
          phase(f'compiling {len(server.buckets)} act programs')
          logging.info('generation worker: compiled %d act programs in %.2f s.', len(server.buckets),
                       server.compile(params, key))
          startup.pin_after_startup()
          phase.done('serving')
      server.serve(requests, params, version, key, calls)
      calls += 1
  except ChannelClosed:
    pass
  finally:
    tracer.close()
    server.close()
    try:
      with open(stats_path, 'w') as f:
        json.dump(server.stats(), f)
    except OSError as e:  # a full disk: the summary goes without the batching statistics
      logging.warning('generation worker: could not write %s: %s', stats_path, e)
