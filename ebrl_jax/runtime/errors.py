"""Errors a run stops with, and how a worker's error reaches the controller.

A `RunError` carries a message the user can act on (what stopped, what stays loadable, what to do). A worker
process that stops on one reports it on its control pipe as an `ErrorReport` (kind and message) before it exits,
so the controller raises the same kind with the worker's words: no exit code carries a meaning between processes.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Type


class RunError(RuntimeError):
  """The run stopped for a reason the user must act on (a dead trainer, say); the message says what to do."""


class DiskFull(RunError):
  """A write of the run (metrics, a checkpoint, the summary) found the disk full; the message names the file and
  the checkpoint that stays loadable."""


class WorkerFailure(RunError):
  """A worker died and the run could not go on; the message names the worker and its exit code."""


class MpsDaemonDied(RunError):
  """The run's MPS daemon stopped answering; every worker was stopped. The message says how to resume."""


class ErrorReport(NamedTuple):
  """A worker's error as it crosses to the controller: `kind` names a class of `KINDS`."""
  kind: str
  message: str


KINDS: Dict[str, Type[RunError]] = {cls.__name__: cls for cls in (RunError, DiskFull, WorkerFailure, MpsDaemonDied)}


def report(error: RunError) -> ErrorReport:
  return ErrorReport(type(error).__name__ if type(error).__name__ in KINDS else 'RunError', str(error))


def raise_report(rep: ErrorReport, prefix: str = '') -> None:
  """Raises the error `rep` describes (an unknown kind as a plain RunError), its message after `prefix`."""
  raise KINDS.get(rep.kind, RunError)(prefix + rep.message)
