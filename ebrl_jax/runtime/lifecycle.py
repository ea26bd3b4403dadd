"""What every worker process needs from its controller, whatever its role: a stop signal that also fires when
the controller has gone, a wait for the parameter store to reach a version, a start-up phase report, and an
outbox for what the worker tells its controller (its result, or the error it stopped on)."""
from __future__ import annotations

import glob
import json
import multiprocessing
import os
import queue
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ebrl_jax.runtime import storage


class ParentWatch:
  """A stop event that also fires when the process that started this worker has gone (orphaned worker)."""

  def __init__(self, stop):
    self._stop, self._parent = stop, os.getppid()

  def is_set(self) -> bool:
    return self._stop.is_set() or os.getppid() != self._parent

  def set(self) -> None:
    self._stop.set()


def wait_for_version(store, min_version: int, stop) -> bool:
  """Blocks until the store holds `min_version` or later; False if a stop was requested meanwhile."""
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
