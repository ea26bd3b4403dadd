"""Errors a run stops with, and how a worker's error reaches the controller.

A `RunError` carries a message the user can act on (what stopped, what stays loadable, what to do). A worker
process that stops on one reports it on its control pipe as an `ErrorReport` (kind and message) before it exits,
so the controller raises the same kind with the worker's words: no exit code carries a meaning between processes.

A stop the user asks for (SIGTERM, Ctrl-C) is not an error: the controller turns SIGTERM into the same
`KeyboardInterrupt` as Ctrl-C (`interrupt`), named by the signal (`stop_reason`); a batch source that sees a stop
request at an iteration boundary raises `StopRequested` with what it had finished. While a process runs programs
that call back into Python (MJX-Warp's kernels go through a ctypes callback), an exception raised there by a signal
handler aborts the interpreter ('free(): invalid size', seen on the H200 after a SIGTERM): there the signal is held
(`deferred_stops`) and the training driver stops at its next chunk boundary (`pending_stop`).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Type

from ebrl_jax.runtime import storage


class RunError(RuntimeError):
  """The run stopped for a reason the user must act on (a dead trainer, say); the message says what to do."""


class DiskFull(RunError):
  """A write of the run (metrics, a checkpoint, the summary) found the disk full; the message names the file and
  the checkpoint that stays loadable."""


class WorkerFailure(RunError):
  """A worker died and the run could not go on; the message names the worker, its exit code and the error it
  recorded. `stopped` is set when the worker was not the trainer, which can still send its summary so far: the
  summary's `stopped` (`WORKER_FAILED`, or `OUT_OF_MEMORY` for an allocation XLA refused the worker). `cause`:
  what happened without the advice (the summary's `extra['failure']`; default the message)."""

  def __init__(self, message: str, stopped: Optional[str] = None, cause: Optional[str] = None):
    super().__init__(message)
    self.stopped, self.cause = stopped, cause or message


class TrainerDied(WorkerFailure):
  """The trainer worker died: no summary came from it, so the controller writes its own from what the trainer had
  logged (`stopped` = TRAINER_DIED), then raises this."""


class MpsDaemonDied(RunError):
  """The run's MPS daemon stopped answering; every worker was stopped. The message says how to resume."""


class Diverged(RunError):
  """A loss or a return became NaN or infinite: training stopped there. The message names the metric and the env
  step, the summary that holds the run so far, and the checkpoint (written before it) that --resume can load."""


class OutOfMemory(RunError):
  """An allocation failed (XLA's RESOURCE_EXHAUSTED, on the device or the host): the message names the request, the
  flags that size the run's memory, the summary so far and the checkpoint --resume can load."""


class ErrorReport(NamedTuple):
  """A worker's error as it crosses to the controller: `kind` names a class of `KINDS`."""
  kind: str
  message: str


KINDS: Dict[str, Type[RunError]] = {
    cls.__name__: cls for cls in (RunError, DiskFull, WorkerFailure, TrainerDied, MpsDaemonDied, Diverged, OutOfMemory)
}

# A summary's `stopped` for a run a failure ended (beside FINISHED, the budget and the signals; trainer.driver's
# own failures are named after these): a loss or return became NaN/inf, an allocation XLA refused, a worker beside
# the trainer that failed for good, the trainer worker's own death (the controller's summary, from what the trainer
# had logged). extra['failure'] says what happened.
DIVERGED, OUT_OF_MEMORY, WORKER_FAILED, TRAINER_DIED = 'non_finite', 'out_of_memory', 'worker_failed', 'trainer_died'
# What to change before --resume after OUT_OF_MEMORY: the flags that size a run's memory.
OUT_OF_MEMORY_FIX = (
    'lower --num_envs or --num_eval_envs, the segments an iteration holds (--batch_size x '
    '--num_minibatches, of --unroll_length steps), the policy\'s size or, with pixels, --image_size or '
    '--frame_stack (runs sharing a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION)')


def out_of_memory(error: BaseException) -> Optional[str]:
  """XLA's line for an allocation that failed (`RESOURCE_EXHAUSTED: Out of memory allocating N bytes.`, a JAX
  runtime error on any platform), or None when `error` is something else (a checkpoint write that found the disk
  full, which tensorstore also names RESOURCE_EXHAUSTED)."""
  if storage.disk_full(error) is not None:  # tensorstore (under orbax) names a full disk RESOURCE_EXHAUSTED too
    return None
  for line in str(error).splitlines():
    if 'RESOURCE_EXHAUSTED' in line:
      return line.strip()[:300]
  return None


def report(error: RunError) -> ErrorReport:
  return ErrorReport(type(error).__name__ if type(error).__name__ in KINDS else 'RunError', str(error))


def raise_report(rep: ErrorReport, prefix: str = '') -> None:
  """Raises the error `rep` describes (an unknown kind as a plain RunError), its message after `prefix`."""
  raise KINDS.get(rep.kind, RunError)(prefix + rep.message)


class StopRequested(Exception):
  """A batch source stopped at an iteration boundary because a stop was asked for (`reason`): `done` iterations of
  the call had finished, leaving `state` and their `metrics` (None when none had)."""

  def __init__(self, reason: str, done: int = 0, state: Any = None, metrics: Optional[dict] = None):
    super().__init__(reason)
    self.reason, self.done, self.state, self.metrics = reason, done, state, metrics


STOP_SIGNALS = ('SIGTERM', 'SIGINT')


def interrupt(signum, frame) -> None:
  """A signal handler: stops the main thread as Ctrl-C does, with a `KeyboardInterrupt` named by the signal."""
  del frame
  raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def held_signals(on_first: Callable[[str], None], active: bool = True):
  """While active: the first SIGTERM or SIGINT is not raised but handed to `on_first` by name ('SIGTERM'); a second
  interrupts at once (`interrupt`), as a second Ctrl-C does elsewhere. Main thread only (elsewhere, or inactive,
  nothing changes). The one mechanism behind `deferred_stops` and a cell's stop vote (`controller.cells`). Yields
  whether the signals are held."""
  if not active or threading.current_thread() is not threading.main_thread():
    yield False
    return
  first: list = []

  def hold(signum, frame):
    if first:
      interrupt(signum, frame)
    first.append(signum)
    on_first(signal.Signals(signum).name)

  previous = {s: signal.signal(s, hold) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield True
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


_DEFERRING: list = []  # one list per active `deferred_stops`, innermost last, holding the signal it was sent


@contextlib.contextmanager
def deferred_stops(active: bool = True):
  """While active: SIGTERM and SIGINT are held (`held_signals`); `pending_stop()` names the first, and the training
  driver stops at its next chunk boundary, where nothing of the simulator is running (it keeps its chunks short,
  `STOP_LATENCY_S`, so that comes soon)."""
  held: list = []
  with held_signals(held.append, active) as holding:
    if holding:
      _DEFERRING.append(held)
    try:
      yield
    finally:
      if holding:
        _DEFERRING.remove(held)


# Seconds of work between two chunk boundaries while signals are held: how long a stop may wait.
STOP_LATENCY_S = 10.0


def stops_deferred() -> bool:
  return bool(_DEFERRING)


def pending_stop() -> str:
  """The held signal ('SIGTERM' or 'SIGINT') of the innermost `deferred_stops`, '' if none came."""
  return _DEFERRING[-1][0] if _DEFERRING and _DEFERRING[-1] else ''


def stop_reason(exc: KeyboardInterrupt) -> str:
  """The signal behind a `KeyboardInterrupt`: the one `interrupt` named, else SIGINT (Python's own handler)."""
  return exc.args[0] if exc.args and exc.args[0] in STOP_SIGNALS else 'SIGINT'
