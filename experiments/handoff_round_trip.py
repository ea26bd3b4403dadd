"""The generation hand-off of an MJX env group, one policy step's round trip rollout -> generation -> rollout,
through the project's own pieces: `rollout.groups.RemoteAct` asking, `generation.worker.ActServer` answering over
the shared-memory mailbox, and with `kind='cuda_ipc'` the observations and actions in the slice's device buffer
(`transport.cuda_ipc`: `OwnedSlot` here, `PeerSlots` in the server).

  result = round_trips('host', n=2000)          # {'p50_us', 'p99_us', 'mean_us', 'n', 'mismatches', ...}
  result = round_trips('cuda_ipc', n=2000)      # needs CuPy and a CUDA GPU (transport.cuda_ipc.unavailable_reason)

Each trip's observations are the trip's number plus a fixed pattern, and the server answers
actions = 2 * obs[:, :A] per chunk step, raw = actions + 1, log-probs = obs[:, 0]; every reply is checked
against its own trip's observations after the timing (a stale or torn reply counts as a mismatch). The host path
does what an MJX worker does: device_get of the observations, device_put of the reply (and the server, the
generation worker's own ActServer, puts the observations on its device and gets the actions back). Used by experiments/bench_transport.py, experiments/ipc_generation_check.py and
tests/transport/test_generation_transport.py.
"""
from __future__ import annotations

import multiprocessing
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import transport
from ebrl_jax.controller import topology
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.rollout import groups
from ebrl_jax.transport import cuda_ipc

CTX = multiprocessing.get_context('spawn')


class Shape(NamedTuple):
  envs: int = 1024  # one W1 env group (2048 envs in 2 groups)
  obs_dim: int = 27  # Ant
  chunk: int = 1
  action_dim: int = 8


def specs(shape: Shape, ipc: bool):
  """The act request / reply specs of one slice, as a run lays them out (controller/topology)."""
  return topology.act_record_specs(shape.envs, shape.obs_dim, shape.chunk, shape.action_dim, ipc)


class _Out(NamedTuple):
  actions: jax.Array
  raw_actions: jax.Array
  log_probs: jax.Array


def _make_echo(shape: Shape):

  @jax.jit
  def echo(params, obs, key, index):
    del params, key, index
    actions = jnp.broadcast_to(2.0 * obs[:, None, :shape.action_dim], (obs.shape[0], shape.chunk, shape.action_dim))
    return _Out(actions, actions + 1.0, obs[:, 0])

  return echo


def serve(mailbox, shape: Shape, ipc: bool, stop) -> None:
  """The generation side: an ActServer with the echo act, until `stop` is set or the mailbox closes."""
  slots = cuda_ipc.PeerSlots(cuda_ipc.Layout(*shape)) if ipc else None
  server = generation_worker.ActServer(mailbox, _make_echo(shape), shape.envs, shape.envs, shape.obs_dim, slots=slots)
  try:
    while not stop.is_set():
      try:
        requests = mailbox.gather(1, timeout=0.2)
      except TimeoutError:
        continue
      server.serve(requests, None, 0, None, 0)
  except transport.ChannelClosed:
    pass
  finally:
    server.close()


@jax.jit
def _fresh(arrays):
  return tuple(jnp.copy(x) for x in arrays)


def _expected(obs: np.ndarray, shape: Shape):
  actions = np.broadcast_to(2.0 * obs[:, None, :shape.action_dim], (obs.shape[0], shape.chunk, shape.action_dim))
  return actions, actions + 1.0, obs[:, 0]


def round_trips(kind: str, n: int = 2000, warmup: int = 100, shape: Shape = Shape(), process: bool = True) -> dict:
  """`n` timed round trips (after `warmup`) of one slice through `kind` ('host' or 'cuda_ipc'); the server in a
  spawned process (`process`, always for cuda_ipc: a process cannot open its own IPC handle) or a thread."""
  ipc = kind == 'cuda_ipc'
  if ipc and cuda_ipc.unavailable_reason() is not None:
    raise RuntimeError(f'cuda_ipc: {cuda_ipc.unavailable_reason()}')
  registry = transport.ShmRegistry()
  request_spec, reply_spec = specs(shape, ipc)
  mailbox = transport.make_mailbox('shm', request_spec, reply_spec, num_groups=1, registry=registry)
  stop = CTX.Event() if process or ipc else threading.Event()
  if process or ipc:
    server = CTX.Process(target=serve, args=(mailbox, shape, ipc, stop), daemon=True)
  else:
    server = threading.Thread(target=serve, args=(mailbox, shape, ipc, stop), daemon=True)
  server.start()
  slot = cuda_ipc.OwnedSlot(cuda_ipc.Layout(*shape)) if ipc else None
  remote = groups.RemoteAct(mailbox, 0, threading.Event(), resend_s=60.0, handle=None if slot is None else slot.handle)
  base = jax.device_put(np.random.default_rng(0).standard_normal((shape.envs, shape.obs_dim)).astype(np.float32))
  no_obs = np.zeros((0, shape.obs_dim), np.float32)
  times, mismatches, checked = [], 0, 0
  try:
    for i in range(warmup + n):
      obs = jax.block_until_ready(base + float(i % 1000))
      start = time.perf_counter()
      if slot is None:
        reply = remote.request(np.asarray(obs))
        out = jax.block_until_ready(tuple(jax.device_put(x) for x in reply[4:]))
      else:
        slot.put_obs(obs)
        remote.request(no_obs)
        out = slot.reply()
      times.append(time.perf_counter() - start)
      # Outside the timing: every reply checked against its own trip. The IPC reply is the same zero-copy JAX
      # view every trip, and a jax.Array caches its host value on the first np.asarray, so the check reads it the
      # way the consumer does: through a computation on the device (a copy), whose result is a fresh array.
      got = [np.asarray(x) for x in _fresh(out)]
      want = _expected(np.asarray(obs), shape)
      mismatches += int(not all(np.array_equal(g, w) for g, w in zip(got, want)))
      checked += 1
  finally:
    stop.set()
    server.join(30)
    if slot is not None:
      slot.close()
    mailbox.close()
    registry.close()
  us = np.asarray(times[warmup:]) * 1e6
  return {
      'kind': kind,
      'server': 'process' if process or ipc else 'thread',
      'shape': shape._asdict(),
      'request_bytes': request_spec.nbytes,
      'reply_bytes': reply_spec.nbytes,
      'p50_us': float(np.percentile(us, 50)),
      'p99_us': float(np.percentile(us, 99)),
      'mean_us': float(us.mean()),
      'n': int(us.size),
      'checked': checked,
      'mismatches': mismatches,
      'device': str(jax.devices()[0])
  }
