"""What every worker process needs from its controller, whatever its role: a stop signal that also fires when
the controller has gone, and a wait for the parameter store to reach a version."""
from __future__ import annotations

import os
import time


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
