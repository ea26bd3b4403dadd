"""Trainer ranks on `jax.distributed`: who this rank is, joining the ranks, and naming a rank that died.

Only trainer ranks join (one per cell); rollout and generation processes never call `initialize`. The
coordinator address, process count and process id come from flags, else from the environment
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), else, under SLURM, from JAX's own SLURM
detection (one task per cell). A 'host:port' that is not one is refused where it is resolved (`resolve`). Before
joining, rank 0 checks that its coordinator's port is free here and every other rank waits, in Python (so that
SIGTERM, Ctrl-C or the trainer's stop end it at once), until the coordinator accepts connections
(`wait_for_coordinator`), within `init_timeout_s`, of which JAX's own wait for every rank gets what is left;
whatever `jax.distributed.initialize` raises comes back as a `JoinFailed` naming the coordinator and where its
address came from.

A rank that dies breaks the next all-reduce on every other rank at once (gloo: "connection closed by peer"), and
the coordination service (in rank 0's process) learns which rank after `heartbeat_timeout_s`. `failed_rank`
turns that into a `RankFailed` that names the rank, its host and pid; when rank 0 itself died, its coordinator
is gone and that is what names it. jax.distributed fate-shares the ranks: a survivor is aborted once the service
sees the failure, so the caller reports and exits (`exit_now`) instead of unwinding through JAX's shutdown.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import socket
import sys
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ebrl_jax.runtime import errors

_KEY = 'ebrl_jax/rank/'
_AGREE_KEY = 'ebrl_jax/agree/'
_JOINED = []  # the spec this process joined with (initialize): at most one
MIN_JAX_WAIT_S = 5  # JAX's own join wait (initialization_timeout) after the Python wait, however late it ended


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """coordinator_address 'host:port' ('' with num_processes 1: one rank, no jax.distributed); process_id: this
  rank; heartbeat_timeout_s: how long the coordination service waits before it declares a silent rank dead;
  init_timeout_s: how long a rank waits for the others to join (`initialize`); address_source: where the address
  came from ('--coordinator_address' or 'JAX_COORDINATOR_ADDRESS', `resolve`), for the messages that name it."""
  coordinator_address: str = ''
  num_processes: int = 1
  process_id: int = 0
  heartbeat_timeout_s: int = 10
  slurm: bool = False  # JAX's SLURM detection supplies all three
  init_timeout_s: int = 120
  address_source: str = '--coordinator_address'

  @property
  def multi(self) -> bool:
    return self.num_processes > 1 or self.slurm


class RankFailed(errors.RunError):
  """A trainer rank (or its host) died; the run stops on every rank."""


class JoinFailed(errors.RunError):
  """This rank could not join the others: rank 0's port is taken, the coordinator never answered, or
  `jax.distributed.initialize` failed (its error, with the coordinator's address)."""


class RanksDisagree(errors.RunError):
  """The trainer ranks were started with different settings (`agree`); every rank stops before training."""


def resolve(coordinator_address: str = '',
            num_processes: int = 0,
            process_id: int = -1,
            heartbeat_timeout_s: int = 10,
            environ: Optional[Dict[str, str]] = None,
            init_timeout_s: int = 120) -> DistributedSpec:
  """The flags' values (0 / -1 / '': unset) completed from the environment; a ValueError names a coordinator
  address that is not 'host:port' and where it came from."""
  env = os.environ if environ is None else environ
  address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS', '')
  source = '--coordinator_address' if coordinator_address else 'JAX_COORDINATOR_ADDRESS'
  num = num_processes or int(env.get('JAX_NUM_PROCESSES', '0') or 0)
  pid = process_id if process_id >= 0 else int(env.get('JAX_PROCESS_ID', '-1') or -1)
  if not address and not num and int(env.get('SLURM_NTASKS', '1') or 1) > 1:
    return DistributedSpec(num_processes=int(env['SLURM_NTASKS']),
                           process_id=int(env.get('SLURM_PROCID', '0')),
                           heartbeat_timeout_s=heartbeat_timeout_s,
                           slurm=True,
                           init_timeout_s=init_timeout_s)
  num = num or 1
  if num > 1 and (not address or pid < 0 or pid >= num):
    raise ValueError(f'--num_processes={num} needs --coordinator_address (host:port of rank 0) and '
                     f'--process_id in [0, {num}); got {address!r} and {pid}.')
  if num > 1:
    split_address(address, source)
  return DistributedSpec(address,
                         num,
                         max(pid, 0),
                         heartbeat_timeout_s,
                         init_timeout_s=init_timeout_s,
                         address_source=source)


def rank_run_dir(run_dir: str, rank: int) -> str:
  """Where cell `rank` writes its metrics, config and summary: --run_dir for rank 0, --run_dir/rank<k>/ else."""
  return run_dir if rank == 0 else os.path.join(run_dir, f'rank{rank}')


def split_address(address: str, source: str = '--coordinator_address') -> Tuple[str, int]:
  """(host, port) of 'host:port' ('[v6 address]:port' too); else a ValueError naming `source` and the value (JAX
  itself crashes on a port-less or out-of-range address)."""
  host, sep, port = address.rpartition(':')
  bracketed = host.startswith('[') and host.endswith(']')
  host = host[1:-1] if bracketed else host
  if not sep or not host or (':' in host and
                             not bracketed) or not (port.isascii() and port.isdigit()) or not (0 < int(port) < 65536):
    raise ValueError(f'{source}={address!r} is not host:port (rank 0\'s host, then a port in 1..65535, e.g. '
                     'host0:12345 or [::1]:12345).')
  return host, int(port)


def check_port_free(address: str, source: str = '--coordinator_address') -> None:
  """Rank 0, before JAX binds its coordinator on every interface: a `JoinFailed` where another process holds the
  port here, or where it needs privileges (JAX's gRPC server would crash the process instead). The IPv6 probe is
  dual-stack (IPV6_V6ONLY off: with net.ipv6.bindv6only=1 a bind to '::' alone misses an IPv4 holder); where that
  probe cannot be made, IPv4 is probed as well."""
  port = split_address(address, source)[1]
  if not _probe_port(socket.AF_INET6, '::', port, address, source):
    _probe_port(socket.AF_INET, '', port, address, source)


def _probe_port(family: int, anywhere: str, port: int, address: str, source: str) -> bool:
  """Binds `port` on every interface of `family`: a `JoinFailed` where it is taken or needs privileges; True where
  the bind covered IPv4 too (a dual-stack IPv6 socket, or IPv4 itself), False where another probe must decide."""
  try:
    sock = socket.socket(family)
  except OSError:  # no IPv6 here
    return False
  with sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to gRPC too
    dual = family == socket.AF_INET
    if family == socket.AF_INET6:
      try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        dual = True
      except (OSError, AttributeError):  # no dual-stack socket here: IPv4 is probed as well
        pass
    try:
      sock.bind((anywhere, port))
    except OSError as e:
      where = f'trainer rank 0 cannot open its coordinator at {address} ({source}): port {port}'
      if e.errno == errno.EACCES:
        raise JoinFailed(f'{where} needs privileges on this host ({e.strerror}; ports below 1024 need root or '
                         'CAP_NET_BIND_SERVICE): choose a port of 1024 or above.') from e
      if e.errno == errno.EADDRINUSE:
        raise JoinFailed(f'{where} is not free on this host ({e.strerror}); another process (a run still '
                         'going?) holds it: choose another port.') from e
      return False  # refused here otherwise (IPv6 disabled): the other probe decides
    return dual


def wait_for_coordinator(address: str,
                         timeout_s: float,
                         rank: int,
                         poll_s: float = 0.25,
                         should_stop: Optional[Callable[[], Optional[str]]] = None,
                         source: str = '--coordinator_address') -> float:
  """Rank `rank` > 0, before it joins: returns the seconds it waited once rank 0's coordinator at `address` (from
  `source`) accepts a TCP connection; a `JoinFailed` after `timeout_s`. A host name that does not resolve (yet: on
  Kubernetes rank 0's name appears once its pod is up) is asked again until then. A Python loop of short connects
  and sleeps, so a signal's handler (SIGTERM, Ctrl-C) ends the wait at once, where JAX's own wait in C++ would
  hold the process until its timeout; so does `should_stop` (asked each poll: a reason, e.g. 'SIGINT', or None),
  as a `KeyboardInterrupt(reason)`."""
  host, port = split_address(address, source)
  t0 = time.monotonic()
  try:
    last = _connect_until(host, port, t0 + timeout_s, poll_s, should_stop)
  except KeyboardInterrupt as stop:  # the handler's stop (SIGTERM, Ctrl-C), or should_stop's: this rank never joined
    print(f'trainer rank {rank}: stopped ({stop}) while waiting for the coordinator at {address}.',
          file=sys.stderr,
          flush=True)
    raise
  if last is None:
    return time.monotonic() - t0
  if isinstance(last, socket.gaierror):
    raise JoinFailed(f'trainer rank {rank}: unknown host: the coordinator\'s host in {source}={address} did not '
                     f'resolve here within {timeout_s:g} s (--init_timeout_s; last: {last.strerror or last}); is '
                     'the name right, and rank 0 (its pod, its node) up?') from last
  raise JoinFailed(f'trainer rank {rank}: the coordinator at {address} (rank 0, {source}) '
                   f'accepted no connection within {timeout_s:g} s (--init_timeout_s; last: '
                   f'{last.strerror or last}); is rank 0 running, and its port reachable from this host?') from last


def _connect_until(host: str,
                   port: int,
                   deadline: float,
                   poll_s: float,
                   should_stop: Optional[Callable[[], Optional[str]]] = None) -> Optional[OSError]:
  """None once (host, port) accepted a connection; else the last error (a `socket.gaierror` too), at `deadline`;
  a `KeyboardInterrupt` with `should_stop`'s reason once it gives one."""
  while True:
    reason = should_stop() if should_stop is not None else None
    if reason:
      raise KeyboardInterrupt(reason)
    try:
      with socket.create_connection((host, port), timeout=min(1.0, max(0.05, deadline - time.monotonic()))):
        return None
    except OSError as e:  # socket.gaierror among them: a name not (yet) known
      last = e
    if time.monotonic() >= deadline:
      return last
    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def initialize(spec: DistributedSpec, should_stop: Optional[Callable[[], Optional[str]]] = None) -> None:
  """Joins the trainer ranks (a no-op for one rank) and records this rank's host and pid for the others. Rank
  k > 0 waits for the coordinator first (`wait_for_coordinator`, ended by `should_stop` too); JAX's own wait then
  gets what is left of `init_timeout_s` (at least MIN_JAX_WAIT_S), so the join takes about init_timeout_s in all."""
  if not spec.multi:
    return
  waited = 0.0
  if not spec.slurm and spec.process_id == 0:
    check_port_free(spec.coordinator_address, spec.address_source)
  elif not spec.slurm:
    waited = wait_for_coordinator(spec.coordinator_address,
                                  spec.init_timeout_s,
                                  spec.process_id,
                                  should_stop=should_stop,
                                  source=spec.address_source)
  import jax  # lazy: a worker sets its environment (apply_worker_env) before JAX is imported
  # Without it the JAX client aborts a survivor (C++ fatal) the moment the service declares a rank dead, which
  # races `failed_rank` asking the same service which rank that was; the run still stops: `exit_now`.
  jax.config.update('jax_enable_recoverability', True)
  timeouts = dict(initialization_timeout=max(MIN_JAX_WAIT_S, math.ceil(spec.init_timeout_s - waited)),
                  heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
                  shutdown_timeout_seconds=max(30, spec.heartbeat_timeout_s))
  where = ('SLURM\'s coordinator'
           if spec.slurm else f'the coordinator at {spec.coordinator_address} ({spec.address_source})')
  try:
    if spec.slurm:
      jax.distributed.initialize(**timeouts)
    else:
      jax.distributed.initialize(spec.coordinator_address, spec.num_processes, spec.process_id, **timeouts)
  except Exception as e:  # pylint: disable=broad-except  (JAX's errors carry no address: name it)
    raise JoinFailed(f'trainer rank {spec.process_id} of {spec.num_processes} could not join the others through '
                     f'{where}, --init_timeout_s={spec.init_timeout_s}: {type(e).__name__}: {_first_line(e)}') from e
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
  try:
    with socket.create_connection(split_address(address), timeout=timeout_s):
      return True
  except (OSError, ValueError):
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
