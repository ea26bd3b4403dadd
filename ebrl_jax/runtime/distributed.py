"""Trainer ranks on `jax.distributed`: who this rank is, joining the ranks, and naming a rank that died.

Only trainer ranks join (one per cell); rollout and generation processes never call `initialize`. The
coordinator address, process count and process id come from flags, else from the environment
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), else, under SLURM, from JAX's own SLURM
detection (one task per cell).

A rank that dies breaks the next all-reduce on every other rank at once (gloo: "connection closed by peer"), and
the coordination service (in rank 0's process) learns which rank after `heartbeat_timeout_s`. `failed_rank`
turns that into a `RankFailed` that names the rank, its host and pid; when rank 0 itself died, its coordinator
is gone and that is what names it. jax.distributed fate-shares the ranks: a survivor is aborted once the service
sees the failure, so the caller reports and exits (`exit_now`) instead of unwinding through JAX's shutdown.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from typing import Dict, Optional, Sequence

import numpy as np

from ebrl_jax.runtime import errors

_KEY = 'ebrl_jax/rank/'
_AGREE_KEY = 'ebrl_jax/agree/'
_JOINED = []  # the spec this process joined with (initialize): at most one


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """coordinator_address 'host:port' ('' with num_processes 1: one rank, no jax.distributed); process_id: this
  rank; heartbeat_timeout_s: how long the coordination service waits before it declares a silent rank dead."""
  coordinator_address: str = ''
  num_processes: int = 1
  process_id: int = 0
  heartbeat_timeout_s: int = 10
  slurm: bool = False  # JAX's SLURM detection supplies all three

  @property
  def multi(self) -> bool:
    return self.num_processes > 1 or self.slurm


class RankFailed(errors.RunError):
  """A trainer rank (or its host) died; the run stops on every rank."""


class RanksDisagree(errors.RunError):
  """The trainer ranks were started with different settings (`agree`); every rank stops before training."""


def resolve(coordinator_address: str = '',
            num_processes: int = 0,
            process_id: int = -1,
            heartbeat_timeout_s: int = 10,
            environ: Optional[Dict[str, str]] = None) -> DistributedSpec:
  """The flags' values (0 / -1 / '': unset) completed from the environment."""
  env = os.environ if environ is None else environ
  address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS', '')
  num = num_processes or int(env.get('JAX_NUM_PROCESSES', '0') or 0)
  pid = process_id if process_id >= 0 else int(env.get('JAX_PROCESS_ID', '-1') or -1)
  if not address and not num and int(env.get('SLURM_NTASKS', '1') or 1) > 1:
    return DistributedSpec(num_processes=int(env['SLURM_NTASKS']),
                           process_id=int(env.get('SLURM_PROCID', '0')),
                           heartbeat_timeout_s=heartbeat_timeout_s,
                           slurm=True)
  num = num or 1
  if num > 1 and (not address or pid < 0 or pid >= num):
    raise ValueError(f'--num_processes={num} needs --coordinator_address (host:port of rank 0) and '
                     f'--process_id in [0, {num}); got {address!r} and {pid}.')
  return DistributedSpec(address, num, max(pid, 0), heartbeat_timeout_s)


def initialize(spec: DistributedSpec) -> None:
  """Joins the trainer ranks (a no-op for one rank) and records this rank's host and pid for the others."""
  if not spec.multi:
    return
  import jax  # lazy: a worker sets its environment (apply_worker_env) before JAX is imported
  # Without it the JAX client aborts a survivor (C++ fatal) the moment the service declares a rank dead, which
  # races `failed_rank` asking the same service which rank that was; the run still stops: `exit_now`.
  jax.config.update('jax_enable_recoverability', True)
  if spec.slurm:
    jax.distributed.initialize(heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
                               shutdown_timeout_seconds=max(30, spec.heartbeat_timeout_s))
  else:
    jax.distributed.initialize(spec.coordinator_address,
                               spec.num_processes,
                               spec.process_id,
                               heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
                               shutdown_timeout_seconds=max(30, spec.heartbeat_timeout_s))
  _JOINED.append(spec)
  client = _client()
  if client is not None:
    client.key_value_set(f'{_KEY}{jax.process_index()}', f'{socket.gethostname()} pid {os.getpid()}')


def agree(spec: DistributedSpec, values: Dict[str, str]) -> None:
  """After `initialize`: every rank publishes `values` (flag -> value) and compares them with every other rank's;
  where any differs, every rank raises the same `RanksDisagree` naming the flags (ranks that trained apart would
  all-reduce different batches, or one would stop first and the others call it dead)."""
  client = _client()
  if client is None or not _JOINED:
    return
  import jax  # lazy: see initialize
  me, count, timeout_ms = jax.process_index(), jax.process_count(), max(60, spec.heartbeat_timeout_s * 3) * 1000
  mine = dict(values)
  client.key_value_set(f'{_AGREE_KEY}{me}', json.dumps(mine, sort_keys=True))
  gone = RankFailed(f'trainer rank {me}: not every rank reached the check of their flags within '
                    f'{timeout_ms / 1000:.0f} s; a rank died or hangs.')
  if not barrier('ebrl_jax/agree', timeout_ms / 1000):
    raise gone
  everyone = [json.loads(client.blocking_key_value_get(f'{_AGREE_KEY}{r}', timeout_ms)) for r in range(count)]
  if not barrier('ebrl_jax/agree_read', timeout_ms / 1000):  # every rank has read before any stops on it
    raise gone
  for rank, theirs in enumerate(everyone):
    if theirs == mine:
      continue
    _leave_after_the_others(client, spec, me, count)
    differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    shown = ', '.join(f'{k}={mine.get(k)} here, {theirs.get(k)} there' for k in differ[:4])
    raise RanksDisagree(f'trainer rank {me} and rank {rank} were started with different settings: {shown}'
                        f'{f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""}; every cell must run '
                        'the same flags (only its rank, run directory, caches and limits may differ).')


def _leave_after_the_others(client, spec: DistributedSpec, me: int, count: int) -> None:
  """Before every rank stops on a check they all made: each other rank says it is leaving (its last call on the
  coordination service) and rank 0, whose process holds the service, ends only once the service has seen them
  go (within 3 heartbeat timeouts): a rank whose service vanishes under it is aborted by JAX with a C++ fatal
  error instead of ending on its one line."""
  if me:
    client.key_value_set(f'{_AGREE_KEY}left/{me}', '1')
    return
  deadline = time.time() + 3 * spec.heartbeat_timeout_s
  try:
    for rank in range(1, count):
      client.blocking_key_value_get(f'{_AGREE_KEY}left/{rank}', 10_000)
    while time.time() < deadline and len(client.get_live_nodes(list(range(count)))) > 1:
      time.sleep(0.2)
  except Exception:  # pylint: disable=broad-except  (a rank that died meanwhile: nothing more to wait for)
    pass


def joined() -> bool:
  """Whether this process joined several ranks (it then ends with `exit_now`: JAX's shutdown at exit waits for
  every rank, and one may be gone)."""
  return bool(_JOINED)


def _client():
  # NOTE: jax.distributed exposes no public call for "which ranks are alive" or a key-value store; both are on
  # the runtime client that jax.experimental.multihost_utils itself uses. Without it, failures name no rank.
  from jax._src import distributed as jax_distributed  # lazy: private, optional (see the note)
  return getattr(jax_distributed.global_state, 'client', None)


def _where(client, rank: int) -> str:
  try:
    return client.key_value_try_get(f'{_KEY}{rank}')
  except Exception:  # pylint: disable=broad-except
    return 'host unknown'


def _coordinator_reachable(address: str, timeout_s: float = 2.0) -> bool:
  host, _, port = address.rpartition(':')
  try:
    with socket.create_connection((host, int(port)), timeout=timeout_s):
      return True
  except OSError:
    return False


def failed_rank(spec: DistributedSpec, cause: BaseException) -> RankFailed:
  """After a collective failed on this rank: which rank died (blocks up to the heartbeat timeout)."""
  import jax  # lazy: see initialize
  me = jax.process_index()
  t0 = time.time()
  client = _client()
  address = spec.coordinator_address or getattr(_jax_state(), 'coordinator_address', '') or ''
  if me != 0 and address and not _coordinator_reachable(address):
    return RankFailed(f'trainer rank 0 (the coordinator at {address}) died; rank {me} stops '
                      f'({time.time() - t0:.1f} s after its all-reduce failed: {_first_line(cause)})')
  dead = []
  if client is not None:
    try:
      live = client.get_live_nodes(list(range(jax.process_count())))
      dead = [r for r in range(jax.process_count()) if r not in live]
    except Exception:  # pylint: disable=broad-except
      dead = []
  named = ', '.join(f'rank {r} ({_where(client, r)})' for r in dead) or 'a peer rank (which one is unknown)'
  return RankFailed(f'trainer {named} died; rank {me} stops ({time.time() - t0:.1f} s after its all-reduce failed: '
                    f'{_first_line(cause)})')


def _jax_state():
  from jax._src import distributed as jax_distributed  # lazy: private, optional (see _client)
  return jax_distributed.global_state


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def chain_digest(previous: str, leaves: Sequence) -> str:
  """sha256 of `previous` and the arrays' bytes (a train state's parameter leaves): chained over the steps, one
  string that two ranks share only if they held the same parameters after every step."""
  h = hashlib.sha256(previous.encode())
  for leaf in leaves:
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def exit_now(code: int) -> None:
  """Ends this rank without JAX's shutdown barrier (which waits for the dead rank, then aborts)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def barrier(name: str, timeout_s: float) -> bool:
  """Waits until every rank reached `name` (False: the barrier failed or timed out, e.g. a rank died)."""
  client = _client()
  if client is None:
    return False
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
    return True
  except Exception:  # pylint: disable=broad-except
    return False
