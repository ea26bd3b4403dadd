"""Run metrics: one `MetricsLogger` writes every scalar to a JSONL file, TensorBoard event files and absl logging,
and drives a progress bar. Metric names follow `role/stage/quantity` (e.g. `train/ppo/policy_loss`)."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import queue
import sys
import threading
import time
import traceback
import types
from typing import Callable, Dict, List, Mapping, Optional

from absl import logging
import numpy as np

from ebrl_jax.runtime import storage

METRICS_FILE = 'metrics.jsonl'  # in the run directory: one JSON record a line


class _DropChattyInfo(logging.logging.Filter):
  """Keeps orbax's per-save INFO lines out of the run's log; its warnings and errors still show."""

  def filter(self, record) -> bool:
    return record.levelno >= logging.logging.WARNING or '/orbax/' not in record.pathname


def quiet_library_logs() -> None:
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropChattyInfo) for f in handler.filters):
    handler.addFilter(_DropChattyInfo())


@contextlib.contextmanager
def _torch_hidden():
  """tensorboardX imports torch, where it is installed, only to accept torch tensors in its `add_*` calls (ebrl_jax
  logs floats); on the GPU machine here that import was a visible share of a warm start-up
  (experiments/results/startup_profile_h200.json's profile). Inside this block `import torch` fails as if torch
  were absent, unless this process has imported it already; after it, torch imports as usual."""
  if 'torch' in sys.modules:
    yield
    return
  sys.modules['torch'] = None  # an entry of None makes `import torch` raise ImportError
  try:
    yield
  finally:
    if 'torch' in sys.modules and sys.modules['torch'] is None:
      del sys.modules['torch']


class _EventQueue(queue.Queue):
  """tensorboardX's queue of pending events, between its caller and its writer thread in one process, as a thread
  queue. Its own is a `multiprocessing.Queue`, whose three named semaphores a spawned worker registers with
  multiprocessing's resource tracker (the worker's default context is 'spawn'): a SIGKILLed trainer left them
  there, and the tracker warned 'There appear to be 3 leaked semaphore objects to clean up at shutdown' when the
  controller exited. A thread queue has no semaphore to leak."""

  def close(self) -> None:  # the one call tensorboardX makes beside put and get (at its writer's close)
    pass


_THREAD_QUEUES = types.SimpleNamespace(Queue=_EventQueue)  # tensorboardX's `multiprocessing`, as it uses it

# Whether tensorboardX has met a full disk in this process, and whether that has been said.
_TENSORBOARD_DISK = {'full': False, 'said': False}


def _tensorboard_disk_full(exc, tb) -> bool:
  """An error of tensorboardX's writing on a full disk, or one that follows it (its writer thread finds its queue
  closed under it when the close that the full disk interrupted tore the writer down)."""
  if not isinstance(exc, OSError) or not any('tensorboardX' in f.filename for f in traceback.extract_tb(tb)):
    return False
  if exc.errno == errno.ENOSPC:
    _TENSORBOARD_DISK['full'] = True
  return _TENSORBOARD_DISK['full']


def _say_tensorboard_disk_full() -> None:
  if not _TENSORBOARD_DISK['said']:
    _TENSORBOARD_DISK['said'] = True
    print('TensorBoard events: the disk is full; the last events were not written.', file=sys.stderr, flush=True)


def quiet_tensorboard_on_a_full_disk() -> None:
  """tensorboardX writes from its own thread and flushes again at interpreter exit; on a full disk both raise
  after the run has already stopped with its own message naming the disk. Those tracebacks become one line
  (process-wide hooks; anything else still reaches the previous hooks)."""
  if getattr(threading.excepthook, 'ebrl_quiet_tensorboard', False):
    return
  previous_thread_hook, previous_unraisable_hook = threading.excepthook, sys.unraisablehook

  def thread_hook(args):
    if _tensorboard_disk_full(args.exc_value, args.exc_traceback):
      return _say_tensorboard_disk_full()
    return previous_thread_hook(args)

  def unraisable_hook(unraisable):  # what reports an exception in an atexit callback
    if _tensorboard_disk_full(unraisable.exc_value, unraisable.exc_traceback):
      return _say_tensorboard_disk_full()
    return previous_unraisable_hook(unraisable)

  thread_hook.ebrl_quiet_tensorboard = True
  threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook


class NonFiniteMetricError(FloatingPointError):
  """Raised when a loss or return is NaN/inf: training stops at once rather than writing garbage (the training
  driver then stops the run with its summary, and the controller raises `errors.Diverged`)."""


def _to_float(value) -> float:
  return float(np.asarray(value))


class IterationMetrics:
  """Means of per-iteration train metrics and the mean return of the episodes that ended, for one log record."""

  def __init__(self, algo_name: str):
    self._prefix, self._sums, self._n = f'train/{algo_name}/', {}, 0
    self._return_sum = self._episodes = 0.0

  def add(self, metrics: Mapping[str, float], return_sum: float, episodes: float) -> None:
    for name, value in metrics.items():
      self._sums[name] = self._sums.get(name, 0.0) + float(value)
    self._n += 1
    self._return_sum += return_sum
    self._episodes += episodes

  def result(self) -> Dict[str, float]:
    out = {self._prefix + k: v / max(self._n, 1) for k, v in self._sums.items()}
    if self._episodes:
      out['rollout/episode_return'] = self._return_sum / self._episodes
    return out


class MetricsLogger:
  """Appends `{"env_steps": ..., "wall_s": ..., name: value}` records to `<run_dir>/metrics.jsonl`.

  `wall_s` is `clock()`: a run's driver passes its run clock (seconds since the process started, as every time in
  the summary); without one, seconds since this logger was made.
  TensorBoard (tensorboardX) events go to `<run_dir>/tb`. The progress bar (tqdm) counts env steps.
  """

  def __init__(self,
               run_dir: str,
               total_env_steps: int,
               progress_bar: bool = True,
               initial_env_steps: int = 0,
               check_finite: tuple = ('loss', 'return'),
               clock: Optional[Callable[[], float]] = None):
    os.makedirs(run_dir, exist_ok=True)
    self._jsonl = storage.open_append(os.path.join(run_dir, METRICS_FILE))
    start = time.monotonic()
    self._clock = clock or (lambda: time.monotonic() - start)
    self._check_finite = check_finite
    try:
      with _torch_hidden():
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        from tensorboardX import event_file_writer  # pylint: disable=g-import-not-at-top
      event_file_writer.multiprocessing = _THREAD_QUEUES  # its event queue, a thread queue (`_EventQueue`)
      self._tb = SummaryWriter(os.path.join(run_dir, 'tb'), flush_secs=10)
      quiet_tensorboard_on_a_full_disk()
    except ImportError:  # optional: a notebook without tensorboardX still logs JSONL
      logging.warning('tensorboardX is not installed; TensorBoard events are not written.')
      self._tb = None
    self._bar = None
    if progress_bar:
      from tqdm import auto as tqdm_auto  # pylint: disable=g-import-not-at-top
      self._bar = tqdm_auto.tqdm(total=total_env_steps,
                                 initial=initial_env_steps,
                                 unit='step',
                                 unit_scale=True,
                                 dynamic_ncols=True,
                                 mininterval=1.0,
                                 disable=None)  # None: no bar when stderr is not a terminal
    self._last_steps = initial_env_steps
    self.history: list = []

  def wall_seconds(self) -> float:
    return self._clock()

  def log(self, env_steps: int, metrics: Mapping[str, float], echo: bool = True) -> Dict[str, float]:
    """Records `metrics` at `env_steps`. Raises NonFiniteMetricError on a non-finite loss or return."""
    values = {k: _to_float(v) for k, v in metrics.items()}
    for name, value in values.items():
      if not math.isfinite(value) and any(word in name for word in self._check_finite):
        raise NonFiniteMetricError(f'metric {name} is {value} at env step {env_steps:,}')
    record = {'env_steps': int(env_steps), 'wall_s': round(self.wall_seconds(), 3), **values}
    try:
      self._jsonl.write(json.dumps(record) + '\n')
    except OSError as e:  # name the file (a full disk's error from write() carries none)
      raise OSError(e.errno, e.strerror, self._jsonl.name) from e
    self.history.append(record)
    if self._tb is not None:
      for name, value in values.items():
        if _TENSORBOARD_DISK['full']:
          # NOTE: tensorboardX's writer thread has died on the full disk; its bounded queue (10 events) would block
          # add_scalar for good once full, so the run stops here with the disk named instead. Asked before every
          # event: the thread can die between two of one record's scalars (the fault suite caught a trainer
          # blocked there for good).
          raise OSError(errno.ENOSPC, 'No space left on device', self._tb.logdir)
        self._tb.add_scalar(name, value, global_step=int(env_steps))
    if echo:
      shown = ', '.join(f'{k}={v:.4g}' for k, v in values.items() if k.startswith(('eval/', 'rollout/', 'time/')))
      message = f'env_steps={env_steps:,} {shown}'
      if self._bar is not None:
        self._bar.write(message)
      else:
        logging.info(message)
    return values

  def advance(self, env_steps: int, postfix: Optional[Mapping[str, Optional[float]]] = None) -> None:
    """Moves the progress bar to `env_steps`; `postfix` values that are None (no evaluation return yet: an
    evaluator process has not answered) are left off the bar."""
    if self._bar is None:
      return
    self._bar.update(max(0, int(env_steps) - self._last_steps))
    self._last_steps = int(env_steps)
    shown = {k: f'{_to_float(v):.4g}' for k, v in (postfix or {}).items() if v is not None}
    if shown:
      self._bar.set_postfix(shown, refresh=False)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    tb, self._tb = self._tb, None
    if tb is not None and _TENSORBOARD_DISK['full']:  # its writer thread is gone: a close would wait for good
      _say_tensorboard_disk_full()
      tb = None
    if tb is not None:
      try:
        tb.close()
      except OSError as e:  # its last flush; the run's own writes say what happened to the disk
        if not _tensorboard_disk_full(e, e.__traceback__):
          raise
        _say_tensorboard_disk_full()
    if not self._jsonl.closed:
      self._jsonl.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def log_size(run_dir: str) -> int:
  """Bytes of `<run_dir>/metrics.jsonl` now (0: none yet): where a run's own records begin, as every run in a
  directory appends to it (a resumed one, and a new one in a directory without checkpoints)."""
  try:
    return os.path.getsize(os.path.join(run_dir, METRICS_FILE))
  except OSError:
    return 0


def read_log(run_dir: str, offset: int = 0) -> List[dict]:
  """The records `MetricsLogger` appended to `<run_dir>/metrics.jsonl` from byte `offset` on, read by another
  process (the controller, after its trainer died): a line the writer did not finish (killed mid-write) is
  skipped, and a file that cannot be read gives none."""
  try:
    with open(os.path.join(run_dir, METRICS_FILE), 'rb') as f:
      f.seek(offset)
      lines = f.read().splitlines()
  except OSError:
    return []
  records = []
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if isinstance(record, dict) and isinstance(record.get('env_steps'), int):
      records.append(record)
  return records
