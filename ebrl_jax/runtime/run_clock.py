"""The run's clock (docs/benchmarks.md, Clocks): every time a run reports counts from its first process's start.

`StartClock` is what the controller hands a schedule: when the process started and the start-up parts it measured
before the training driver began. `RunClock` is the driver's: seconds since that start on this process's
monotonic clock, and the start-up parts so far (each `mark` adds the seconds since the previous one, so the parts
tile process start -> the last mark).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class StartClock:
  """When the run's first process started (`time.time()` seconds) and the start-up parts the controller measured
  before the driver began, ((name, seconds), ...) in order: together they tile process start -> the last mark."""
  unix: float
  parts: Tuple[Tuple[str, float], ...] = ()

  def mark(self, name: str) -> 'StartClock':
    """This clock with one more part: the seconds from the end of the last one until now."""
    done = sum(seconds for _, seconds in self.parts)
    return dataclasses.replace(self, parts=self.parts + ((name, max(0.0, time.time() - self.unix - done)),))


class RunClock:
  """Seconds since the run's process start, on this process's monotonic clock, and the start-up parts so far."""

  def __init__(self, start: StartClock):
    self.start_unix = start.unix
    self._offset, self._t0 = time.time() - start.unix, time.monotonic()
    self.parts: Dict[str, float] = dict(start.parts)
    self._last = sum(self.parts.values())

  def now(self) -> float:
    return self._offset + time.monotonic() - self._t0

  def mark(self, name: str, seconds: Optional[float] = None) -> None:
    """Adds part `name`: the seconds since the last mark, or `seconds` (a source's own compile time)."""
    now = self.now()
    self.parts[name] = self.parts.get(name, 0.0) + (now - self._last if seconds is None else seconds)
    self._last = now
