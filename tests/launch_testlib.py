"""A stand-in for a cell process, for the launcher's watch (`runtime.launch.watch`) in unit tests."""
import json
import os
import signal
import subprocess
import time


class StandInCell:
  """Ends with `code` at `end_t` (monotonic), first writing `summary` (path, dict) where given, and records the
  signals it was sent (the launcher's `watch` needs pid, poll, returncode, send_signal, wait and kill)."""

  def __init__(self, pid, code, end_t, summary=None):
    self.pid, self._code, self._end_t, self.returncode, self.signals = pid, code, end_t, None, []
    self._summary = summary

  def poll(self):
    if self.returncode is None and time.monotonic() >= self._end_t:
      if self._summary is not None:
        os.makedirs(os.path.dirname(self._summary[0]), exist_ok=True)
        with open(self._summary[0], 'w') as f:
          json.dump(self._summary[1], f)
      self.returncode = self._code
    return self.returncode

  def send_signal(self, sig):
    self.signals.append(sig)

  def kill(self):
    self.returncode = -signal.SIGKILL

  def wait(self, timeout=None):
    while self.poll() is None:
      if timeout is not None and time.monotonic() >= self._end_t + 1:
        raise subprocess.TimeoutExpired('cell', timeout)
      time.sleep(0.01)
    return self.returncode
