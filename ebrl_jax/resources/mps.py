"""NVIDIA MPS daemon lifecycle for one run, and the environment each worker needs to use it.

`MpsDaemon(run_dir).start()` uses a daemon already serving `CUDA_MPS_PIPE_DIRECTORY` if there is one, else starts
`nvidia-cuda-mps-control -d` with a private pipe and log directory under the run directory (mode 0700), and
`stop()` quits it only if this run started it. Without a GPU, without the control binary, or when the daemon does
not answer, it logs one clear warning and the run goes on time-sliced: every call has a timeout, nothing hangs.
A worker's SM quota is `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, fixed for the life of its CUDA context.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, Optional

from absl import logging

CONTROL = 'nvidia-cuda-mps-control'
_TIMEOUT_S = 10.0


class MpsDaemon:
  """Owns (or borrows) the MPS control daemon for a run."""

  def __init__(self, run_dir: str, control: str = CONTROL, timeout_s: float = _TIMEOUT_S):
    self.pipe_dir = os.path.join(os.path.abspath(run_dir), 'mps', 'pipe')
    self.log_dir = os.path.join(os.path.abspath(run_dir), 'mps', 'log')
    self._control, self._timeout = control, timeout_s
    self.active = False
    self.started_here = False

  def _env(self, pipe_dir: str, log_dir: str) -> Dict[str, str]:
    return dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir, CUDA_MPS_LOG_DIRECTORY=log_dir)

  def _command(self, stdin: str, env: Dict[str, str]) -> Optional[str]:
    """Sends one command to the control daemon; None if it did not answer in time or failed."""
    try:
      out = subprocess.run([self._control], input=stdin, capture_output=True, text=True, env=env, timeout=self._timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
      logging.debug('MPS control %r failed: %s', stdin.strip(), e)
      return None
    return out.stdout if out.returncode == 0 else None

  def _warn(self, why: str) -> bool:
    logging.warning('MPS is not available (%s): the workers share the GPU time-sliced, without SM quotas.', why)
    return False

  def start(self) -> bool:
    """Makes a daemon available; returns whether MPS is active. Never raises for a missing GPU or daemon."""
    if shutil.which(self._control) is None:
      return self._warn(f'{self._control} not found on PATH')
    existing = os.environ.get('CUDA_MPS_PIPE_DIRECTORY')
    if existing and os.path.exists(os.path.join(existing, 'control')):
      env = self._env(existing, os.environ.get('CUDA_MPS_LOG_DIRECTORY', self.log_dir))
      if self._command('get_server_list\n', env) is not None:
        self.pipe_dir, self.log_dir = existing, env['CUDA_MPS_LOG_DIRECTORY']
        self.active = True
        logging.info('MPS: using the daemon already serving %s.', existing)
        return True
    for path in (self.pipe_dir, self.log_dir):
      os.makedirs(path, mode=0o700, exist_ok=True)
    env = self._env(self.pipe_dir, self.log_dir)
    try:
      started = subprocess.run([self._control, '-d'], capture_output=True, text=True, env=env, timeout=self._timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
      return self._warn(f'{self._control} -d did not start: {e}')
    if started.returncode != 0:
      return self._warn(f'{self._control} -d exited with {started.returncode}: {started.stderr.strip()[:200]}')
    self.started_here = True
    if self._command('get_server_list\n', env) is None:
      self.stop()
      return self._warn('the daemon started but does not answer (is there a GPU, and are we root?)')
    self.active = True
    logging.info('MPS: started a daemon for this run (pipe %s).', self.pipe_dir)
    return True

  def worker_env(self, quota: Optional[int] = None) -> Dict[str, str]:
    """Variables a worker process needs: the daemon's pipe and, if given, its SM quota in percent."""
    if not self.active:
      return {}
    env = {'CUDA_MPS_PIPE_DIRECTORY': self.pipe_dir, 'CUDA_MPS_LOG_DIRECTORY': self.log_dir}
    if quota is not None:
      env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'] = str(int(quota))
    return env

  def alive(self) -> bool:
    """Whether the daemon still answers (the controller asks about once a second, and when a worker dies)."""
    return self.active and self._command('get_server_list\n', self._env(self.pipe_dir, self.log_dir)) is not None

  def lost(self) -> None:
    """Records that the daemon is gone: no worker gets its variables any more and `stop()` sends it nothing."""
    self.active = self.started_here = False

  def stop(self) -> None:
    """Quits the daemon if this run started it (safe to call twice)."""
    if not self.started_here:
      self.active = False
      return
    self.started_here = self.active = False
    if self._command('quit\n', self._env(self.pipe_dir, self.log_dir)) is None:
      logging.warning('MPS: the daemon this run started did not acknowledge "quit"; check %s.', self.log_dir)
    else:
      logging.info('MPS: stopped the daemon this run started.')

  def __enter__(self) -> 'MpsDaemon':
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
