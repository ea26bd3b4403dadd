"""Multi-process transport over `multiprocessing.shared_memory`: segment ownership (`ShmRegistry`), a lock no dead
holder can keep (`SegmentLock`) and `ShmChannel`, a pool of fixed-size record slots in one segment.

Slots: each has a state word (FREE, WRITING, FILLED, READING), its holder's pid and a FIFO ticket. A put takes a
FREE slot under the lock, copies the fields in with no lock held, then makes it FILLED with the next ticket; a get
takes the FILLED slot with the lowest ticket, copies it out, makes it FREE. Two counting POSIX semaphores wake
blocked callers (user-space atomics when uncontended; no feeder thread, nothing pickled).

Liveness (a peer may be SIGKILLed at any instruction): the lock is an `flock`, released by the kernel with its
holder, and a slot changes state by one word write, so a kill leaves each slot in one state. A waiter without a
permit after `WAIT_SLICE_S` takes a ready slot anyway (a dead peer may have taken the permit with it) and
recovers dead holders' slots: WRITING -> FREE (that put never happened), READING -> FILLED with its old ticket
(delivered again), counted in `recovered()`. If the channel's creator has died it raises `base.PeerDied`.

Lifetime: the owner creates each segment (mode 0600) through a `ShmRegistry`, which unlinks them on `close()` and
at exit. Attachers (a `Process` argument, unpickled) register nothing with the resource tracker they share with
the owner, so they unlink nothing and the tracker unlinks a SIGKILLed owner's segments once its last child is
gone. `ShmRegistry.sweep` (runs call it at start) removes any segment whose creating pid is gone.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import multiprocessing
import os
import secrets
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ebrl_jax.runtime.lifecycle import pid_alive
from ebrl_jax.transport import base
from ebrl_jax.transport.specs import RecordSpec, align_up

PREFIX = 'ebrl'
SHM_DIR = '/dev/shm'  # where Linux keeps POSIX shared memory
LOCK_TIMEOUT_S = 10.0  # a live holder keeps a lock for a few integer ops; past this it is stopped or hung
WAIT_SLICE_S = 0.1  # a blocked put/get looks for dead peers this often
_TRACK_KWARG = sys.version_info >= (3, 13)
_UNTRACKED = threading.Lock()


def attach(name: str) -> shared_memory.SharedMemory:
  """Maps an existing segment without registering it with this process's resource tracker."""
  if _TRACK_KWARG:
    return shared_memory.SharedMemory(name=name, track=False)
  # NOTE: Python < 3.13 registers every attach with the resource tracker that spawned children share with their
  # parent; unregistering afterwards would drop the owner's registration too (then no unlink after a SIGKILL).
  with _UNTRACKED:
    register = resource_tracker.register
    resource_tracker.register = lambda n, rtype: None if n.lstrip('/') == name else register(n, rtype)
    try:
      return shared_memory.SharedMemory(name=name)
    finally:
      resource_tracker.register = register


def close_mapping(shm: shared_memory.SharedMemory) -> None:
  """Unmaps, unless numpy views into it are still alive (then the mapping goes when they do)."""
  with contextlib.suppress(BufferError):
    shm.close()


class Sweep(NamedTuple):
  """What `ShmRegistry.sweep` removed: segment names, their bytes, and the dead owners' pids."""
  names: List[str]
  nbytes: int
  owners: List[int]


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
      with contextlib.suppress(FileNotFoundError):
        shm.unlink()

  def __enter__(self) -> 'ShmRegistry':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @staticmethod
  def sweep(prefix: str = PREFIX, shm_dir: str = SHM_DIR) -> Sweep:
    """Unlinks the segments `<prefix>_<pid>_*` whose creating process is gone (exited, or a zombie): what a
    SIGKILLed owner left. A live process's segments are never touched. NOTE: pids are this pid namespace's, so
    /dev/shm must not be shared with another one's processes."""
    removed = []
    for entry in sorted(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else []:
      parts = entry.split('_')
      if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit() or pid_alive(int(parts[1])):
        continue
      path = os.path.join(shm_dir, entry)
      try:
        size = os.stat(path).st_size
        os.unlink(path)
      except (FileNotFoundError, PermissionError):  # swept by someone else meanwhile, or another user's
        continue
      removed.append((entry, size, int(parts[1])))
    return Sweep([r[0] for r in removed], sum(r[1] for r in removed), sorted({r[2] for r in removed}))


_DEFAULT_REGISTRY: Optional[ShmRegistry] = None


def default_registry() -> ShmRegistry:
  """The process-wide registry used when none is given (closed at exit)."""
  global _DEFAULT_REGISTRY
  if _DEFAULT_REGISTRY is None or _DEFAULT_REGISTRY._pid != os.getpid():  # pylint: disable=protected-access
    _DEFAULT_REGISTRY = ShmRegistry()
  return _DEFAULT_REGISTRY


def _try_flock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False


class SegmentLock:
  """A segment header's lock: an exclusive `flock` on the segment's file, which the kernel releases when the holder
  dies (a semaphore lock would stay taken for good). NOTE: flock excludes open files, not threads: a thread lock
  serialises this process's threads first. `words`: two header words, the holder's pid (0: free) and how often a
  holder's pid was found still written (it died holding the lock)."""

  def __init__(self, name: str, words: np.ndarray):
    self._fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    self._thread = threading.Lock()
    self._words, self._pid = words, os.getpid()

  def acquire(self, timeout: float = LOCK_TIMEOUT_S) -> None:
    if self._fd < 0:
      raise base.ChannelClosed('this process has detached from the segment.')
    deadline, pause = time.monotonic() + timeout, 1e-5
    if not self._thread.acquire(timeout=timeout):
      raise base.PeerStuck(f'a thread of this process held a shared-memory lock for over {timeout} s.')
    try:
      while not _try_flock(self._fd):
        if time.monotonic() >= deadline:
          raise base.PeerStuck(f'process {int(self._words[0])} held a shared-memory lock for over {timeout} s '
                               '(stopped or hung; a dead holder would have released it).')
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    except BaseException:
      self._thread.release()
      raise
    if self._words[0] != 0:
      self._words[1] += 1
    self._words[0] = self._pid

  def release(self) -> None:
    self._words[0] = 0
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    self._thread.release()

  def __enter__(self) -> None:
    self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

  def close(self) -> None:
    """Drops this process's file (and the view of the header words); idempotent."""
    fd, self._fd, self._words = self._fd, -1, np.zeros(2, np.int64)
    if fd >= 0:
      os.close(fd)


# Header words (int64): closed flag, lock holder pid, dead lock holders seen, next FIFO ticket, slots recovered,
# the creator's pid; from _SLOTS on, per slot: its state, its holder's pid, its ticket.
_CLOSED, _HOLDER, _DEAD_HOLDERS, _NEXT_TICKET, _RECOVERED, _CREATOR, _SLOTS = 0, 1, 2, 3, 4, 5, 8
FREE, WRITING, FILLED, READING = 0, 1, 2, 3


class ShmChannel(base.Channel):
  """Bounded multi-producer multi-consumer FIFO of records in one shared-memory segment. Construct it in the owner
  process; pass it to child processes as a `Process` argument (it pickles as a handle: name, spec, capacity and
  the semaphores, which multiprocessing allows only while spawning); unpickling attaches."""

  def __init__(self, spec: RecordSpec, capacity: int, registry: Optional[ShmRegistry] = None, ctx=None):
    if capacity < 1:
      raise ValueError(f'capacity={capacity} must be >= 1.')
    ctx = ctx or multiprocessing.get_context('spawn')
    registry = registry or default_registry()
    self.spec, self.capacity, self.owner = spec, capacity, True
    self._free_sem, self._fill_sem = ctx.Semaphore(capacity), ctx.Semaphore(0)
    self._map(registry.create(align_up((_SLOTS + 3 * capacity) * 8) + capacity * spec.nbytes))
    self._hdr[_CREATOR] = os.getpid()
    registry.on_close(self._release)

  def _map(self, shm: shared_memory.SharedMemory) -> None:
    self._shm, self.name, n = shm, shm.name, self.capacity
    header = align_up((_SLOTS + 3 * n) * 8)
    self._hdr = np.ndarray((_SLOTS + 3 * n,), np.int64, buffer=shm.buf)
    self._state, self._holder, self._ticket = (self._hdr[_SLOTS + k * n:_SLOTS + (k + 1) * n] for k in range(3))
    self._lock = SegmentLock(shm.name, self._hdr[_HOLDER:_HOLDER + 2])
    self._pid, self._next_look = os.getpid(), 0.0
    self._views = [
        tuple(
            np.ndarray(s.shape, s.dtype, buffer=shm.buf, offset=header + i * self.spec.nbytes + self.spec.offsets[k])
            for k, s in self.spec.items())
        for i in range(n)
    ]

  def __getstate__(self):
    return {'name': self.name, 'spec': self.spec, 'capacity': self.capacity, 'sems': (self._free_sem, self._fill_sem)}

  def __setstate__(self, state):
    self.spec, self.capacity, self.owner = state['spec'], state['capacity'], False
    self._free_sem, self._fill_sem = state['sems']
    self._map(attach(state['name']))

  # NOTE: _locked methods run under self._lock and change a slot's state by one word write, last. Slot words are
  # read as lists: numpy calls on arrays this small cost more than the loops.
  def _take_locked(self, want: int, then: int) -> Optional[int]:
    """A slot in state `want` (FILLED: the oldest ticket), now `then` and held by this process; None if none."""
    states = self._state.tolist()
    if want not in states:
      return None
    tickets = self._ticket.tolist()
    slot = states.index(FREE) if want == FREE else min((tickets[i], i) for i, s in enumerate(states) if s == want)[1]
    self._holder[slot] = self._pid
    self._state[slot] = then
    return slot

  def _recover_locked(self) -> Tuple[int, int]:
    """Slots a dead process held: WRITING -> FREE, READING -> FILLED (ticket kept). Returns (freed, refilled)."""
    freed = refilled = 0
    for slot, state in enumerate(self._state.tolist()):
      pid = int(self._holder[slot])
      if state not in (WRITING, READING) or pid == self._pid or pid_alive(pid):
        continue
      if state == WRITING:
        self._state[slot], freed = FREE, freed + 1
      else:
        self._state[slot], refilled = FILLED, refilled + 1
    self._hdr[_RECOVERED] += freed + refilled
    return freed, refilled

  def _try_take(self, want: int, then: int, permit: bool, look: bool) -> Tuple[Optional[int], bool]:
    """(slot taken or None, closed?); `look`: recover dead peers' slots first. Locks only if a slot may be ready."""
    if not (permit or look or want in self._state.tolist()):
      return None, bool(self._hdr[_CLOSED])
    with self._lock:
      freed, refilled = self._recover_locked() if look else (0, 0)
      closed = bool(self._hdr[_CLOSED])
      slot = None if closed and want == FREE else self._take_locked(want, then)
    for woken in [self._free_sem] * freed + [self._fill_sem] * refilled:
      woken.release()
    return slot, closed

  def _claim(self, sem, want: int, then: int, timeout: Optional[float], what: str) -> int:
    """Waits for a slot in state `want` and takes it. NOTE: a permit only says a slot may be ready, the states are
    the truth; a permit that finds none is spent (its slot went to a waiter without one), so the two agree again.
    Without a permit, a waiter looks for dead peers (their slots, the creator) at most once per WAIT_SLICE_S."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    while True:
      wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
      permit = sem.acquire(True, wait) if wait > 0 else sem.acquire(False)
      look = not permit and time.monotonic() >= self._next_look
      if look:
        self._next_look = time.monotonic() + WAIT_SLICE_S
      slot, closed = self._try_take(want, then, permit, look)
      if slot is not None:
        return slot
      if closed:
        sem.release()  # pass the wake-up on to the next waiter
        raise base.ChannelClosed('put on a closed channel.' if what == 'put' else 'get on a closed, empty channel.')
      if look and not pid_alive(int(self._hdr[_CREATOR])):
        raise base.PeerDied(f'{what}: the process that created channel {self.name} (pid {int(self._hdr[_CREATOR])}) '
                            'died; nothing more will come through it.')
      if not permit and deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f'{what} timed out after {timeout} s.')

  def _finish(self, slot: int, state: int, sem, ticket: bool) -> None:
    """Gives up a held slot as `state` (with the next FIFO ticket if `ticket`: only that needs the lock, as no peer
    writes a slot a live process holds) and wakes one waiter on `sem`."""
    if ticket:
      with self._lock:
        self._ticket[slot] = self._hdr[_NEXT_TICKET]
        self._hdr[_NEXT_TICKET] += 1
        self._state[slot] = state
    else:
      self._state[slot] = state
    sem.release()

  def put(self, record: Any, timeout: Optional[float] = None) -> None:
    arrays = self.spec.check(record)
    if self.closed:
      raise base.ChannelClosed('put on a closed channel.')
    slot = self._claim(self._free_sem, FREE, WRITING, timeout, 'put')
    try:
      for view, array in zip(self._views[slot], arrays):
        np.copyto(view, array)
    except BaseException:  # interrupted mid-copy: the slot goes back and nothing was put
      self._finish(slot, FREE, self._free_sem, ticket=False)
      raise
    self._finish(slot, FILLED, self._fill_sem, ticket=True)

  def get(self, timeout: Optional[float] = None) -> Any:
    if self._views is None:
      raise base.ChannelClosed('get on a detached channel.')
    slot = self._claim(self._fill_sem, FILLED, READING, timeout, 'get')
    try:
      record = self.spec.build(view.copy() for view in self._views[slot])
    except BaseException:  # interrupted mid-copy: the record stays, at the head of the FIFO
      self._finish(slot, FILLED, self._fill_sem, ticket=False)
      raise
    self._finish(slot, FREE, self._free_sem, ticket=False)
    return record

  def qsize(self) -> int:
    return self._state.tolist().count(FILLED)

  def recovered(self) -> base.Recovered:
    """Slots and locks recovered from dead peers so far, by any process (read from the segment)."""
    return base.Recovered(int(self._hdr[_RECOVERED]), int(self._hdr[_DEAD_HOLDERS]))

  def close(self) -> None:
    """Marks the channel closed for every process and wakes blocked callers (each passes the wake-up on)."""
    if self.closed:  # NOTE: no lock: one word that only goes 0 -> 1 (two closers wake twice, which is harmless)
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
    if self._views is None:
      return
    self._lock.close()
    self._views, self._hdr = None, np.array([1, 0, 0, 0, 0, 0, 0, 0], np.int64)  # _CLOSED set, nothing recovered
    self._state = self._holder = self._ticket = np.zeros(0, np.int64)
    close_mapping(self._shm)
