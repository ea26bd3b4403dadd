"""Multi-process transport over `multiprocessing.shared_memory`: segment ownership (`ShmRegistry`) and
`ShmChannel`, a ring of fixed-size record slots in one segment.

Signalling (measured in experiments/bench_transport.py): two counting semaphores (free slots, filled slots) and
one lock guarding two small index rings in the segment header (free slot indices, filled slot indices in FIFO
order). A put is: acquire `free`, pop a free index (under the lock, a few integer ops), copy the fields into the
slot with no lock held, push the index onto the filled ring, release `filled`; a get mirrors it. The
semaphores are futex-backed POSIX semaphores, so an uncontended operation is a user-space atomic and a
blocked waiter wakes directly on release; there is no feeder thread and nothing is pickled. Because a slot
index is taken only after the semaphore is held, a timeout leaves no half-claimed slot behind.

Lifetime: one owner process creates each segment (mode 0600) through a `ShmRegistry`, which unlinks them all on
`close()`, at interpreter exit (atexit) and is safe to call twice. Other processes attach by unpickling the
handle (the channel object itself, passed as a `Process` argument at spawn) and never register the segment with
their resource tracker, so no attacher's exit can unlink it under the owner. Signals: the controller calls
`registry.close()` from its SIGTERM/SIGINT handler (or lets SystemExit/KeyboardInterrupt run atexit); a SIGKILLed
owner cannot clean up, so `ShmRegistry.sweep_stale()` removes segments whose creating pid is gone.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import secrets
import sys
import threading
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ebrl_jax.transport import base
from ebrl_jax.transport.specs import RecordSpec, align_up

PREFIX = 'ebrl'
# A peer killed while holding a channel's lock (a handful of integer ops) would block everyone; give up after this.
LOCK_TIMEOUT_S = 10.0
_TRACK_KWARG = sys.version_info >= (3, 13)


def attach(name: str) -> shared_memory.SharedMemory:
  """Maps an existing segment without letting this process's resource tracker unlink it at exit."""
  if _TRACK_KWARG:
    return shared_memory.SharedMemory(name=name, track=False)
  shm = shared_memory.SharedMemory(name=name)
  # NOTE: Python < 3.13 registers every attach; undo it (the owner's registry owns the lifetime).
  resource_tracker.unregister(shm._name, 'shared_memory')  # pylint: disable=protected-access
  return shm


def close_mapping(shm: shared_memory.SharedMemory) -> None:
  """Unmaps, unless numpy views into it are still alive (then the mapping goes when they do)."""
  try:
    shm.close()
  except BufferError:
    pass


class ShmRegistry:
  """Creates shared-memory segments for this (owner) process and unlinks every one of them on `close()`."""

  def __init__(self, prefix: str = PREFIX):
    self.prefix = prefix
    self._segments: Dict[str, shared_memory.SharedMemory] = {}
    self._on_close: List[Callable[[], None]] = []
    self._lock = threading.Lock()
    self._pid = os.getpid()
    atexit.register(self.close)

  def create(self, nbytes: int) -> shared_memory.SharedMemory:
    """A new zero-filled segment of at least `nbytes`, file mode 0600, named `<prefix>_<pid>_<random>`."""
    name = f'{self.prefix}_{self._pid}_{secrets.token_hex(6)}'
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(int(nbytes), 1))
    with self._lock:
      self._segments[shm.name] = shm
    return shm

  def on_close(self, fn: Callable[[], None]) -> None:
    """Runs `fn` (e.g. a channel's close, which wakes waiters) before the segments are unlinked."""
    with self._lock:
      self._on_close.append(fn)

  @property
  def names(self) -> List[str]:
    return list(self._segments)

  def close(self) -> None:
    """Closes registered objects, then unmaps and unlinks every segment created here. Idempotent."""
    if os.getpid() != self._pid:  # a forked child inherited this object: not the owner
      return
    with self._lock:
      hooks, self._on_close = self._on_close, []
      segments, self._segments = self._segments, {}
    for fn in hooks:
      with contextlib.suppress(Exception):
        fn()
    for shm in segments.values():
      close_mapping(shm)
      if not _TRACK_KWARG:
        # An attacher sharing our resource tracker (spawned children do) removed our registration when it
        # unregistered; re-add it so that unlink's own unregister balances.
        resource_tracker.register(shm._name, 'shared_memory')  # pylint: disable=protected-access
      with contextlib.suppress(FileNotFoundError):
        shm.unlink()

  def __enter__(self) -> 'ShmRegistry':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @staticmethod
  def sweep_stale(prefix: str = PREFIX, shm_dir: str = '/dev/shm') -> List[str]:
    """Unlinks segments `<prefix>_<pid>_*` whose creating process no longer exists. Returns their names."""
    removed = []
    for entry in os.listdir(shm_dir) if os.path.isdir(shm_dir) else []:
      parts = entry.split('_')
      if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
        continue
      try:
        os.kill(int(parts[1]), 0)
      except ProcessLookupError:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(os.path.join(shm_dir, entry))
          removed.append(entry)
      except PermissionError:
        pass
    return removed


_DEFAULT_REGISTRY: Optional[ShmRegistry] = None


def default_registry() -> ShmRegistry:
  """The process-wide registry used when none is given (closed at exit)."""
  global _DEFAULT_REGISTRY
  if _DEFAULT_REGISTRY is None or _DEFAULT_REGISTRY._pid != os.getpid():  # pylint: disable=protected-access
    _DEFAULT_REGISTRY = ShmRegistry()
  return _DEFAULT_REGISTRY


@contextlib.contextmanager
def _locked(lock):
  if not lock.acquire(True, LOCK_TIMEOUT_S):
    raise TimeoutError(f'channel lock held for over {LOCK_TIMEOUT_S} s: a peer probably died holding it.')
  try:
    yield
  finally:
    lock.release()


# Header words (int64): closed flag, free ring head/tail, filled ring head/tail; then the two rings.
_CLOSED, _FREE_HEAD, _FREE_TAIL, _FILL_HEAD, _FILL_TAIL, _RINGS = 0, 1, 2, 3, 4, 8


class ShmChannel(base.Channel):
  """Bounded multi-producer multi-consumer FIFO of records in one shared-memory segment.

  Construct it in the owner process; pass the object to child processes as a `Process` argument (it pickles
  as a handle: segment name, spec, capacity and the semaphores/lock, which multiprocessing only allows while
  spawning). Unpickling attaches. `get` returns a copy the caller owns.
  """

  def __init__(self, spec: RecordSpec, capacity: int, registry: Optional[ShmRegistry] = None, ctx=None):
    if capacity < 1:
      raise ValueError(f'capacity={capacity} must be >= 1.')
    ctx = ctx or multiprocessing.get_context('spawn')
    registry = registry or default_registry()
    self.spec, self.capacity = spec, capacity
    self._free_sem, self._fill_sem, self._lock = ctx.Semaphore(capacity), ctx.Semaphore(0), ctx.Lock()
    header = align_up((_RINGS + 2 * capacity) * 8)
    shm = registry.create(header + capacity * spec.nbytes)
    self._map(shm)
    self._hdr[_FREE_TAIL] = capacity
    self._hdr[_RINGS:_RINGS + capacity] = np.arange(capacity)
    self.owner = True
    registry.on_close(self._release)

  def _map(self, shm: shared_memory.SharedMemory) -> None:
    self._shm = shm
    self.name = shm.name
    n = self.capacity
    header = align_up((_RINGS + 2 * n) * 8)
    self._hdr = np.ndarray((_RINGS + 2 * n,), np.int64, buffer=shm.buf)
    self._views = [
        tuple(
            np.ndarray(s.shape, s.dtype, buffer=shm.buf, offset=header + i * self.spec.nbytes + self.spec.offsets[k])
            for k, s in self.spec.items())
        for i in range(n)
    ]

  def __getstate__(self):
    return dict(name=self.name,
                spec=self.spec,
                capacity=self.capacity,
                free_sem=self._free_sem,
                fill_sem=self._fill_sem,
                lock=self._lock)

  def __setstate__(self, state):
    self.spec, self.capacity = state['spec'], state['capacity']
    self._free_sem, self._fill_sem, self._lock = state['free_sem'], state['fill_sem'], state['lock']
    self.owner = False
    self._map(attach(state['name']))

  # NOTE: ring ops run under self._lock; head/tail only grow, indices are taken modulo capacity.
  def _pop(self, head: int, tail: int, ring: int) -> int:
    assert self._hdr[tail] > self._hdr[head], 'ring underflow: semaphore and ring disagree'
    slot = int(self._hdr[_RINGS + ring * self.capacity + self._hdr[head] % self.capacity])
    self._hdr[head] += 1
    return slot

  def _push(self, tail: int, ring: int, slot: int) -> None:
    self._hdr[_RINGS + ring * self.capacity + self._hdr[tail] % self.capacity] = slot
    self._hdr[tail] += 1

  @staticmethod
  def _acquire(sem, timeout: Optional[float], what: str) -> None:
    ok = sem.acquire(False) if timeout is not None and timeout <= 0 else sem.acquire(True, timeout)
    if not ok:
      raise TimeoutError(f'{what} timed out after {timeout} s.')

  def put(self, record: Any, timeout: Optional[float] = None) -> None:
    arrays = self.spec.check(record)
    if self._hdr[_CLOSED]:
      raise base.ChannelClosed('put on a closed channel.')
    self._acquire(self._free_sem, timeout, 'put')
    with _locked(self._lock):
      if self._hdr[_CLOSED]:
        self._free_sem.release()  # pass the wake-up on to the next waiter
        raise base.ChannelClosed('put on a closed channel.')
      slot = self._pop(_FREE_HEAD, _FREE_TAIL, 0)
    for view, array in zip(self._views[slot], arrays):
      np.copyto(view, array)
    with _locked(self._lock):
      self._push(_FILL_TAIL, 1, slot)
    self._fill_sem.release()

  def get(self, timeout: Optional[float] = None) -> Any:
    if self._views is None:
      raise base.ChannelClosed('get on a detached channel.')
    self._acquire(self._fill_sem, timeout, 'get')
    with _locked(self._lock):
      if self._hdr[_FILL_TAIL] == self._hdr[_FILL_HEAD]:  # only a close() token is left
        self._fill_sem.release()
        raise base.ChannelClosed('get on a closed, empty channel.')
      slot = self._pop(_FILL_HEAD, _FILL_TAIL, 1)
    record = self.spec.build(view.copy() for view in self._views[slot])
    with _locked(self._lock):
      self._push(_FREE_TAIL, 0, slot)
    self._free_sem.release()
    return record

  def qsize(self) -> int:
    return int(self._hdr[_FILL_TAIL] - self._hdr[_FILL_HEAD])

  def close(self) -> None:
    """Marks the channel closed for every process and wakes blocked callers (each passes the token on)."""
    if self._views is None:
      return
    with _locked(self._lock):
      if self._hdr[_CLOSED]:
        return
      self._hdr[_CLOSED] = 1
    self._free_sem.release()
    self._fill_sem.release()

  @property
  def closed(self) -> bool:
    return self._views is None or bool(self._hdr[_CLOSED])

  def _release(self) -> None:
    """Owner's registry hook: close, then drop the views so the mapping can go."""
    with contextlib.suppress(Exception):
      self.close()
    self.detach()

  def detach(self) -> None:
    """Unmaps this process's view of the segment (does not close the channel for others)."""
    self._views, self._hdr = None, np.zeros(_RINGS, np.int64)
    self._hdr[_CLOSED] = 1
    close_mapping(self._shm)
