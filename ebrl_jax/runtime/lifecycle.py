"""What every worker process needs from its controller, whatever its role: a stop signal that also fires when
the controller has gone, a wait for the parameter store to reach a version, a start-up phase report, and an
outbox for what the worker tells its controller (its result, or the error it stopped on).

NOTE: liveness. Nothing here takes a lock another process could hold: the run-wide stop is one byte of shared
memory (`StopFlag`), the controller's death is seen through `getppid` (asked first) and the parent-death
signal, which a worker arms as soon as it unpickles its stop, before it imports JAX. So a worker whose
controller was SIGKILLed, even mid-import or mid-compile, is ended within a second, and no SIGKILLed worker can
freeze the others or the controller.

Also the controller's side of a stop signal: SIGTERM and Ctrl-C as a `KeyboardInterrupt` that no callback swallows
(`stop_signals_as_interrupt`), and none lost while a worker spawns (`spawning`).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import multiprocessing
from multiprocessing import resource_tracker
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ebrl_jax.runtime import errors
from ebrl_jax.runtime import hooks
from ebrl_jax.runtime import storage

# What a worker receives when its controller dies. No worker handles it, so the kernel ends the worker at once.
PARENT_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def arm_parent_death_signal(sig: int = PARENT_DEATH_SIGNAL) -> bool:
  """Asks Linux to send this process `sig` when its parent dies (`prctl(PR_SET_PDEATHSIG)`); False elsewhere.
  NOTE: "parent" is the thread that started this process: the controller starts its workers from its main
  thread."""
  if not sys.platform.startswith('linux'):
    return False
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def pid_alive(pid: int) -> bool:
  """Whether process `pid` (> 0) exists and has not exited (a zombie, exited but not yet reaped, counts as dead)."""
  try:
    os.kill(pid, 0)
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except (ProcessLookupError, FileNotFoundError):
    return False
  except (OSError, IndexError):  # another user's process, or no /proc
    return True


def end_with_creator(creator: int) -> None:
  """In a child of `creator`: arms the parent-death signal. If `creator` has died already (before the signal was
  armed it could not fire), ends this process now. In any other process (a grandchild of a live creator) does
  nothing."""
  if os.getppid() == creator:
    arm_parent_death_signal()
  if os.getppid() != creator and not pid_alive(creator):
    os.kill(os.getpid(), PARENT_DEATH_SIGNAL)


class StopFlag:
  """The run-wide stop of worker processes: one byte of shared memory (`multiprocessing.RawValue`), set by a plain
  store, read by a plain load. Picklable only while spawning (pass it as a `Process` argument).

  NOTE: no lock anywhere, so a process SIGKILLed at any instruction cannot leave it unreadable or unsettable (a
  `multiprocessing.Event` is a condition variable whose lock a killed holder keeps for good). It only ever goes
  from 0 to 1, so several writers are safe (the controller, and the trainer when it has finished).
  Unpickled in a child of the process that made it, it arms that child's parent-death signal (`end_with_creator`).
  """

  def __init__(self, ctx=None):
    self._value = (ctx or multiprocessing.get_context('spawn')).RawValue(ctypes.c_ubyte, 0)
    self.creator = os.getpid()

  def set(self) -> None:
    self._value.value = 1

  def is_set(self) -> bool:
    return self._value.value != 0

  def __getstate__(self):
    return {'value': self._value, 'creator': self.creator}

  def __setstate__(self, state):
    self._value, self.creator = state['value'], state['creator']
    ignore_inherited_sigint()
    end_with_creator(self.creator)


def ignore_inherited_sigint() -> None:
  """In a worker that the controller started with SIGINT blocked (`spawning`): ignores it from now on, a Ctrl-C
  that waited meanwhile included (the controller decides how the run stops), and unblocks it, so that a handler
  installed later (the trainer's stop request) gets the next one. Elsewhere (SIGINT not blocked) does nothing."""
  if threading.current_thread() is threading.main_thread() and signal.SIGINT in signal.pthread_sigmask(
      signal.SIG_BLOCK, []):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a pending one
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def spawning(processes: bool = True):
  """Around the start of a worker process: SIGINT is blocked in this thread, so the child starts with it blocked
  (the mask survives fork and exec) until, unpickling its stop, it ignores it (`ignore_inherited_sigint`). Ctrl-C
  at a terminal signals the whole process group: the controller alone decides how the run stops (it stops the
  trainer, which sends its summary, then every worker) instead of each worker dying with a traceback wherever it
  was. A SIGINT or SIGTERM that reaches the controller meanwhile is held, never raised inside
  `multiprocessing`'s start (which would leave a child started and unwatched), and is raised to the handlers in
  force once the child is started. Only the main thread may set handlers; elsewhere nothing changes.
  NOTE: not SIG_IGN in the controller, as before: the disposition is the process's, and a Ctrl-C landing while a
  worker spawned was lost (the run trained on)."""
  if not processes or threading.current_thread() is not threading.main_thread():
    yield
    return
  resource_tracker.ensure_running()  # its own start unblocks SIGINT: before the mask is set, not inside it
  came: List[int] = []
  previous = {s: signal.signal(s, lambda signum, _: came.append(signum)) for s in _STOP_SIGNALS}
  mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a SIGINT that waited on the mask is held here
    for s, handler in previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    for s in dict.fromkeys(came):  # once each, to the run's own handlers (a KeyboardInterrupt, as a rule)
      signal.raise_signal(s)


_REDELIVER_S = 0.05  # a swallowed interrupt is sent again this long after: the callback has returned by then


def _send_later(name: str) -> None:
  timer = threading.Timer(_REDELIVER_S, os.kill, (os.getpid(), signal.Signals[name]))
  timer.daemon = True
  timer.start()


def _redeliver_swallowed_interrupts(previous_hook):
  """A `sys.unraisablehook` for a `KeyboardInterrupt` Python could not raise (its signal handler ran inside a
  garbage-collection callback, a `__del__` or a weakref callback: 'Exception ignored in ...'): the signal that
  made it is sent to this process again `_REDELIVER_S` later, so that its handler runs after the callback, and
  nothing is printed. Anything else goes to `previous_hook`.
  NOTE: the signal is sent again rather than raised here: an interrupt raised inside this hook is swallowed too
  (a Timer thread, not `_thread.interrupt_main`, whose handler would run before the hook returns). If the one sent
  again lands in such a callback once more, it comes back here, and is sent again."""

  def hook(unraisable):
    if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
      previous_hook(unraisable)
      return
    name = errors.stop_reason(unraisable.exc_value or KeyboardInterrupt())
    for _ in range(3):
      try:
        _send_later(name)
        return
      except KeyboardInterrupt:  # an earlier one, sent again, landed in this hook (a starved main thread)
        continue

  hook.redelivers = True
  return hook


@contextlib.contextmanager
def stop_signals_as_interrupt():
  """SIGTERM stops the run like Ctrl-C does, as a `KeyboardInterrupt('SIGTERM')` (`errors.interrupt`), and neither
  is lost where Python cannot raise it: JAX's garbage-collection callback (`_xla_gc_callback`) ran the handler on
  a loaded machine, the interrupt was printed as 'Exception ignored' and the run trained on. Such an interrupt is
  raised again outside the callback (`_redeliver_swallowed_interrupts`). Main thread only; elsewhere nothing
  changes."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, errors.interrupt)
  found = sys.unraisablehook
  nested = getattr(found, 'redelivers', False) and getattr(found, 'on', True)  # an outer block's, still on
  try:
    with contextlib.ExitStack() as stack:
      if not nested:  # taken out at the end without dropping a hook installed meanwhile (runtime/hooks.py)
        stack.enter_context(hooks.unraisable_hook_within(_redeliver_swallowed_interrupts, redelivers=True))
      yield
  finally:
    signal.signal(signal.SIGTERM, previous)


FAILURES_DIR = 'failures'  # <run_dir>/failures/<pid>.json: the error a worker process ended on (run_worker)


def run_worker(stop, target, args, kwargs, failure_dir: Optional[str] = None):
  """A worker process's entry point: `target(*args, **kwargs)`. NOTE: the `Process` unpickles its arguments in
  order, so `stop` (a `StopFlag`) arms the parent-death signal before `target`'s module, and JAX with it, is
  imported: a worker whose controller dies during those seconds is ended too. With `failure_dir`, an exception
  that ends the worker is written there first (`last_error` reads it), so the controller can name the cause of a
  death that otherwise reaches it as an exit code; then it is raised as it was (its traceback in the log)."""
  del stop  # unpickling it was its work
  try:
    return target(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  (recorded, then raised unchanged)
    if failure_dir is not None:
      try:
        os.makedirs(failure_dir, exist_ok=True)
        storage.write_json(
            os.path.join(failure_dir, f'{os.getpid()}.json'),
            {
                'type': type(e).__name__,
                'message': str(e)[:2000],
                'out_of_memory': errors.out_of_memory(e),  # XLA's refusal line, else None
                'unix': time.time()
            })
      except OSError:  # a full disk: the exit code alone reaches the controller
        pass
    raise


def last_error(failure_dir: str, pid: Optional[int], since: float = 0.0) -> Optional[dict]:
  """{'type', 'message', 'out_of_memory'} of the error worker process `pid` ended on (`run_worker`; the last is
  XLA's line when an allocation was refused, else None), or None; a record written before `since` (a
  `time.time()`: an earlier run's, in a reused run directory, whose pid came round again) is not this worker's."""
  try:
    with open(os.path.join(failure_dir, f'{pid}.json')) as f:
      record = json.load(f)
    if float(record.get('unix', 0.0)) < since:
      return None
    refused = record.get('out_of_memory')
    return {
        'type': str(record['type']),
        'message': str(record['message']),
        'out_of_memory': None if refused is None else str(refused)
    }
  except (OSError, ValueError, KeyError, TypeError):
    return None


def make_stop(use_processes: bool):
  """The run-wide stop: a `StopFlag` for worker processes, a `threading.Event` for worker threads."""
  return StopFlag() if use_processes else threading.Event()


class ParentWatch:
  """A stop that also fires when the process that started this worker has gone (an orphaned worker).
  NOTE: it asks `getppid` first (a system call nothing can block), the stop only then."""

  def __init__(self, stop):
    self._stop, self._parent = stop, os.getppid()
    creator = getattr(stop, 'creator', None)  # a StopFlag: the controller, which may have died before now
    self._orphaned = creator is not None and creator != self._parent and not pid_alive(creator)

  def is_set(self) -> bool:
    return self._orphaned or os.getppid() != self._parent or self._stop.is_set()

  def set(self) -> None:
    self._stop.set()


def wait_for_version(store, min_version: int, stop) -> bool:
  """Blocks until the store holds `min_version` or later; False if a stop was requested meanwhile (a
  `ParentWatch` bounds the wait by the controller's life)."""
  while not stop.is_set():
    if store.version() >= min_version:
      return True
    time.sleep(0.0005)
  return False


PHASES_DIR = 'phases'


class Phase:
  """What one worker is doing during start-up (importing, building envs, compiling, waiting for a version or
  for segments), written to <run_dir>/phases/<name>.json so the controller can say where a slow start waits
  (`read_phases`). Best effort: a write that fails (a full disk) is skipped, never raised. Writes only on a
  change, and stops after `done()` (steady running is the metrics' business)."""

  def __init__(self, run_dir: str, name: str):
    self._path = os.path.join(run_dir, PHASES_DIR, name.replace('/', '_') + '.json')
    self._name, self._phase, self._done = name, None, False

  def __call__(self, phase: str) -> None:
    if self._done or phase == self._phase:
      return
    self._phase = phase
    try:
      os.makedirs(os.path.dirname(self._path), exist_ok=True)
      storage.write_json(self._path, {'name': self._name, 'phase': phase, 'since': time.time(), 'pid': os.getpid()})
    except OSError:
      pass

  def done(self, phase: str = 'running') -> None:
    self(phase)
    self._done = True


def read_phases(run_dir: str) -> Dict[str, dict]:
  """name -> {'phase', 'since', 'pid'} of every worker that reported one (unreadable files are left out)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(run_dir, PHASES_DIR, '*.json'))):
    try:
      with open(path) as f:
        record = json.load(f)
      out[record['name']] = record
    except (OSError, ValueError, KeyError):
      continue
  return out


def describe_phases(run_dir: str, now: Optional[float] = None) -> str:
  """One line: each worker's phase and for how long, e.g. 'trainer: compiling the train step (41 s); ...'."""
  now = time.time() if now is None else now
  phases = read_phases(run_dir)
  if not phases:
    return 'no worker has reported a phase yet (still importing or starting)'
  return '; '.join(f'{name}: {r["phase"]} ({max(0.0, now - r["since"]):.0f} s)' for name, r in phases.items())


class Message(NamedTuple):
  """What a worker tells its controller: `kind` 'result' (its payload, e.g. the trainer's summary as a dict) or
  'error' (a `runtime.errors.ErrorReport`)."""
  kind: str
  payload: Any


class Outbox:
  """The worker's end of its control pipe: `send` a `Message` (picklable; it crosses the spawn boundary)."""

  def __init__(self, end):
    self._end = end

  def close(self) -> None:
    """The controller closes its copy once the worker has started: then a worker that dies mid-send leaves the
    controller an end of file (`Inbox.poll` keeps what came whole), not a read that waits for the rest."""
    if not isinstance(self._end, queue.Queue):
      self._end.close()

  def send(self, kind: str, payload: Any) -> None:
    message = Message(kind, payload)
    if isinstance(self._end, queue.Queue):
      self._end.put(message)
    else:
      self._end.send(message)


class Inbox:
  """The controller's end: `poll()` returns every message that has arrived, without blocking. `waitable` is what
  `multiprocessing.connection.wait` can wait on (None for threads)."""

  def __init__(self, end):
    self._end = end
    self.waitable = None if isinstance(end, queue.Queue) else end

  def poll(self) -> List[Message]:
    out = []
    if isinstance(self._end, queue.Queue):
      while not self._end.empty():
        out.append(self._end.get_nowait())
      return out
    try:
      while self._end.poll():
        out.append(self._end.recv())
    except (EOFError, OSError):  # the worker has gone; what it sent before is in `out`
      pass
    return out


def make_pipe(use_processes: bool) -> Tuple[Inbox, Outbox]:
  """A one-way control pipe from a worker (process or thread) to its controller.
  NOTE: the controller must keep polling while a worker runs: a message larger than the pipe's buffer blocks
  the sender until it is read."""
  if not use_processes:
    q: queue.Queue = queue.Queue()
    return Inbox(q), Outbox(q)
  reader, writer = multiprocessing.get_context('spawn').Pipe(duplex=False)
  return Inbox(reader), Outbox(writer)
