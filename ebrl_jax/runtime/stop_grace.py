"""How long a stopping trainer worker has to send its summary so far before the controller terminates it.

After SIGTERM or Ctrl-C the trainer stops at its next iteration boundary, saves the checkpoint of that iteration
and sends its summary. Its grace (`StopGrace`) is the time to reach the boundary (the base: at least 10 s, or two
of its recent iterations where those are longer) plus the time of that save: SAVE_FACTOR times the longest save of
the run's checkpoints, which orbax records in each step (`_CHECKPOINT_METADATA`: when the save began and when it
committed), within [SAVE_FLOOR_S, SAVE_CAP_S]. While the stop's save is still being written past that (its
uncommitted step directory, `<step>.orbax-checkpoint-tmp-<t>`, made since the stop, is there: the trainer's sign
that it is saving), the deadline stays the base ahead of now, up to the base plus SAVE_CAP_S. A trainer terminated at
last leaves its older checkpoints whole: orbax commits a step by renaming its directory, so an uncommitted one is
never read (the next run's checkpointer removes it). `--launcher=local` waits for its cells the same way
(runtime/launch.py: rank 0 saves the stop's checkpoint).
"""
from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import List, Optional

from absl import logging

SAVE_FACTOR = 3.0  # the stop's save may take this many times the run's longest save so far
SAVE_FLOOR_S = 20.0  # and at least this long (no save measured yet: the stop's is the first)
SAVE_CAP_S = 600.0  # and at most this long, however long its directory keeps changing
POLL_S = 0.5
_UNCOMMITTED = '.orbax-checkpoint-tmp'  # orbax's suffix of a step directory being written
_METADATA = '_CHECKPOINT_METADATA'  # orbax's record of a committed step: init and commit times (ns since the epoch)


def save_seconds(directory: str) -> List[float]:
  """Seconds each committed checkpoint step in `directory` took to save (orbax's commit time minus its init
  time), in step order; steps without a readable record are left out."""
  steps = [
      p for p in glob.glob(os.path.join(directory, '*', _METADATA)) if os.path.basename(os.path.dirname(p)).isdigit()
  ]
  out = []
  for path in sorted(steps, key=lambda p: int(os.path.basename(os.path.dirname(p)))):
    try:
      with open(path) as f:
        record = json.load(f)
      took = (int(record['commit_timestamp_nsecs']) - int(record['init_timestamp_nsecs'])) / 1e9
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if took >= 0:
      out.append(took)
  return out


def save_allowance(directory: str) -> float:
  """Seconds the stop's checkpoint save is given: SAVE_FACTOR times the longest save in `directory`, within
  [SAVE_FLOOR_S, SAVE_CAP_S] (the floor where none was measured)."""
  took = save_seconds(directory)
  return min(SAVE_CAP_S, max(SAVE_FLOOR_S, SAVE_FACTOR * max(took, default=0.0)))


def saving_since(directory: str, since_unix: float) -> bool:
  """Whether a checkpoint save that began at or after `since_unix` is being written in `directory`: an
  uncommitted step directory created (or changed) since then."""
  for path in glob.glob(os.path.join(directory, f'*{_UNCOMMITTED}*')):
    try:
      if os.stat(path).st_mtime >= since_unix:
        return True
    except OSError:  # committed (renamed) or removed meanwhile
      continue
  return False


def moved_deadline(deadline: float, asked: float, base_s: float, now: float, directory: str) -> float:
  """`deadline` of a stop asked for at `asked`, kept `base_s` ahead of `now` while the stop's save is written in
  `directory` (an uncommitted step made since), up to `base_s` plus SAVE_CAP_S after `asked`."""
  if not saving_since(directory, asked - 1.0):  # (-1 s: file times are coarser than the clock)
    return deadline
  return min(asked + base_s + SAVE_CAP_S, max(deadline, now + base_s))


def base_grace(floor_s: float, period_s: float) -> float:
  """The time to reach the next iteration boundary: `floor_s`, or two of the trainer's recent iterations
  (`period_s`, its feedback's mean; 0 unknown) where those are longer."""
  return max(floor_s, 2.0 * period_s)


class StopGrace:
  """Terminates `trainer` (a worker process: is_alive, terminate) when it has not ended within its grace, counted
  from now: `base_s` plus the save allowance of `checkpoint_dir`, moved on while the stop's save is written (see
  the module's docstring). `start` it once the trainer was asked to stop; `cancel` once it has ended."""

  def __init__(self, trainer, checkpoint_dir: str, base_s: float, clock=time.time):
    self._trainer, self._dir, self._base, self._clock = trainer, checkpoint_dir, base_s, clock
    self.asked = clock()
    self.allowance = save_allowance(checkpoint_dir)
    self.deadline = self.asked + base_s + self.allowance
    self.terminated = False
    self._cancelled = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def start(self) -> 'StopGrace':
    self._thread = threading.Thread(target=self._run, name='stop-grace', daemon=True)
    self._thread.start()
    return self

  def cancel(self) -> None:
    self._cancelled.set()
    if self._thread is not None:
      self._thread.join(timeout=5.0)

  def poll(self) -> bool:
    """One check: moves the deadline on while the stop's save is written; terminates the trainer past it.
    Returns whether the watch is over (the trainer ended, or was terminated)."""
    if not self._trainer.is_alive():
      return True
    now = self._clock()
    self.deadline = moved_deadline(self.deadline, self.asked, self._base, now, self._dir)
    if now < self.deadline:
      return False
    logging.warning(
        'the trainer sent no summary within %.0f s of the stop (%.0f s for its iteration, %.0f s for its checkpoint '
        'save%s); terminating it: its committed checkpoints stay whole.', now - self.asked, self._base,
        self.deadline - self.asked - self._base,
        ', still being written' if saving_since(self._dir, self.asked - 1.0) else '')
    self._trainer.terminate()
    self.terminated = True
    return True

  def _run(self) -> None:
    while not self._cancelled.wait(POLL_S):
      if self.poll():
        return
