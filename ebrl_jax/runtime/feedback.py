"""Run-time feedback from a worker to the controller: a few numbers in shared memory, written once per iteration.

A rollout worker writes its collect seconds and segments delivered; the trainer its train_step seconds and
iterations. The controller only reads them (the live re-planner and the quota-change cost come from them).
NOTE: one writer per slot, a reader tolerates a torn pair of slots (it reads a rate over seconds, not a
transaction); timestamps are `time.time()` so they compare across processes.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import threading
import time
from typing import Any, NamedTuple, Optional

# Slots of the shared array.
ITERATIONS = 0  # segments put (rollout) or train steps done (trainer) by this worker
STAGE_S = 1  # seconds spent in the stage (collect or train_step), summed over ITERATIONS
FIRST_T = 2  # time.time() of the first delivery (0: none yet)
LAST_T = 3  # time.time() of the latest delivery
READY_T = 4  # time.time() at which a warm standby finished building and compiling (0: not yet)
QUOTA = 5  # the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the worker runs under, as it sees it (0: none)
START_ITERATION = 6  # written by the controller before 'go': the first iteration a standby may collect
LAST_ITERATION = 7  # the iteration number of the latest delivery (trainer: its policy version)
PERIOD_S = 8  # EMA of the seconds between deliveries (0: fewer than two), the recent production period
# Written by the controller (a change of the env groups): the worker collects no iteration >= this and exits once
# it has delivered the ones before (0: none). See controller/relayout.py.
RETIRE_AT = 9
_SLOTS = 10
_PERIOD_ALPHA = 0.3


class Feedback:
  """A worker's feedback slots: a `multiprocessing.RawArray` for processes, a list for threads."""

  def __init__(self, use_processes: bool):
    self.values: Any = (multiprocessing.get_context('spawn').RawArray('d', _SLOTS) if use_processes else [0.0] * _SLOTS)

  def __getitem__(self, slot: int) -> float:
    return float(self.values[slot])

  def __setitem__(self, slot: int, value: float) -> None:
    self.values[slot] = float(value)

  def delivered(self, stage_s: float, iteration: int) -> None:
    """Called by the worker after each iteration it delivered."""
    now = time.time()
    if self.values[FIRST_T] == 0.0:
      self.values[FIRST_T] = now
    else:
      period, ema = now - self.values[LAST_T], self.values[PERIOD_S]
      self.values[PERIOD_S] = period if ema == 0.0 else (1 - _PERIOD_ALPHA) * ema + _PERIOD_ALPHA * period
    self.values[STAGE_S] += stage_s
    self.values[LAST_T] = now
    self.values[LAST_ITERATION] = iteration
    self.values[ITERATIONS] += 1  # last: a reader that sees the count sees the seconds behind it

  def snapshot(self) -> 'FeedbackSnapshot':
    return FeedbackSnapshot(*(float(v) for v in self.values[:_SLOTS]))


class FeedbackSnapshot(NamedTuple):
  """One read of every slot (see the slot constants)."""
  iterations: float
  stage_s: float
  first_t: float
  last_t: float
  ready_t: float
  quota: float
  start_iteration: float
  last_iteration: float
  period_s: float
  retire_at: float = 0.0

  def next_iteration(self) -> int:
    """The first iteration a worker taking over from this one collects: after the one it delivered last, and not
    before the START_ITERATION it was given (a restart must not deliver an iteration again)."""
    return max(int(self.start_iteration), int(self.last_iteration) + 1 if self.iterations else 0)

  def stage_s_since(self, earlier: Optional['FeedbackSnapshot']) -> Optional[float]:
    """Mean stage seconds per iteration since `earlier` (None: since the start); None without a new iteration."""
    n = self.iterations - (earlier.iterations if earlier else 0.0)
    return (self.stage_s - (earlier.stage_s if earlier else 0.0)) / n if n > 0 else None


class WorkerControl(NamedTuple):
  """A rollout worker's own feedback and events. `retire`: stop after the current iteration (a quota change);
  `go`: None for a worker that starts at once, else a warm standby builds, compiles, sets `ready` and waits on it."""
  feedback: Feedback
  retire: Any
  ready: Any
  go: Any = None


class Flag:
  """A one-way flag across processes: one byte of shared memory (`RawValue`), set by a plain store, read by a plain
  load; `wait` polls it. NOTE: no lock, so a process SIGKILLed at any instruction cannot leave it unreadable or
  unsettable, which a `multiprocessing.Event` (a condition variable whose lock a killed holder keeps) can. Picklable
  only while spawning (a `Process` argument)."""

  _POLL_S = 0.002

  def __init__(self):
    self._value = multiprocessing.get_context('spawn').RawValue(ctypes.c_ubyte, 0)

  def set(self) -> None:
    self._value.value = 1

  def is_set(self) -> bool:
    return self._value.value != 0

  def wait(self, timeout: Optional[float] = None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not self.is_set():
      if deadline is not None and time.monotonic() >= deadline:
        return False
      time.sleep(self._POLL_S)
    return True


def make_control(use_processes: bool, standby: bool) -> WorkerControl:
  """A worker's control: `Flag`s for processes, `threading.Event`s for threads (which share one process)."""
  flag = Flag if use_processes else threading.Event
  return WorkerControl(Feedback(use_processes), flag(), flag(), flag() if standby else None)
