"""The trainer's side of the evaluator process (`rollout/evaluator.py`, `--evaluator=process`).

At each evaluation point the driver `submit`s the version it has reached (a host copy of its parameters); a thread
of this module publishes the asked-for versions, one at a time and in order, to the evaluation parameter store
(a `ParamStore` of its own, written only here) and reads the evaluator's `types.EvalReport`s from the report
channel. The driver `poll`s at its next evaluation points and records every point that has come in, in version
order, with the env steps and training seconds of the moment it was asked for (the curve is keyed by version and
env steps, as in line) and the run-clock time its evaluation finished.

NOTE: one evaluation in flight. A version goes into the store only once the one before it has been reported, so
the store's newest version is always the one being evaluated (or the last one reported): an evaluator restarted
after a death takes it again, and no asked-for version is skipped. At most `max_pending` asked-for versions wait
for the store (host copies the trainer holds); asking for one more waits for room (the evaluator is that far
behind), counted in `extra.evaluator.wait_s`. A report of a version already reported (a restarted evaluator repeating the
last one) is dropped and counted. With `settle` (--deterministic) each `poll` first waits for every version asked
for before (counted in `settle_s`), so a --target_return stop comes at the evaluation point after the version that
reached it whatever the evaluator's pace, as with the overlap schedule's in-trainer evaluations.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, NamedTuple, Optional

from absl import logging
import jax
import numpy as np

from ebrl_jax.runtime import errors
from ebrl_jax.trainer import evaluations
from ebrl_jax.transport import ChannelClosed

_POLL_S = 0.05  # the link thread's longest wait for a report before it looks at the store again
_STOP_WAIT_S = 2.0  # a run stopped part-way (a signal, --max_wall_s) waits this long for the evaluations in flight


class EvalLink(NamedTuple):
  """The transport between the trainer and the evaluator: `store`, the evaluation `ParamStore` (the trainer
  publishes the versions to evaluate); `reports`, a channel of `types.EvalReport` (the evaluator's answers)."""
  store: Any
  reports: Any


class _Asked(NamedTuple):
  version: int
  env_steps: int
  train_s: float
  unix: float  # when it was asked for
  params: Any  # the host copy, until it is published (then None)
  reached_s: float  # the run clock when it was asked for


class RemoteEvaluations:
  """The driver's off-path evaluations (see `evaluations.OffPath` for the interface) done by the evaluator process.
  `stops`: (flag, reason) pairs, flags with `is_set()` (the run's stop, the trainer's SIGINT flag) that end a
  wait of the trainer's with `errors.StopRequested(reason)`."""
  in_line_first = False  # the trainer compiles no evaluation: the evaluator does, in its own process

  def __init__(self,
               link: EvalLink,
               target: Optional[float],
               stops=(),
               wait_s: float = 120.0,
               max_pending: int = 2,
               settle: bool = False):
    self._link, self._target, self._wait_s, self._max_pending = link, target, wait_s, max_pending
    self._settle = settle
    self._stops = [(flag, reason) for flag, reason in stops if flag is not None]
    self._lock = threading.Lock()
    self._asked: Deque[_Asked] = collections.deque()  # in version order, oldest first, until recorded
    self._reports: Dict[int, Any] = {}  # version -> its EvalReport, until recorded
    self._in_flight: Optional[int] = None  # the version in the store whose report has not come yet
    self._error: Optional[BaseException] = None
    self.counts: Dict[str, Any] = {
        'evaluations': 0,
        'duplicates': 0,
        'missing': 0,
        'wait_s': 0.0,  # the trainer waiting for room (the evaluator more than max_pending versions behind)
        'eval_s': 0.0,  # the evaluator evaluating
        'max_lag_s': 0.0,  # the longest from a version's submit to the end of its evaluation
        'settle_s': 0.0  # with `settle`: the trainer waiting at an evaluation point for the versions before
    }
    self._finished = False
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._run, name='evaluator-link', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    try:
      while not self._closed.is_set():
        self._publish_next()
        try:
          report = self._link.reports.get(timeout=_POLL_S)
        except TimeoutError:
          continue
        with self._lock:
          version = int(report.version)
          if version == self._in_flight:
            self._reports[version] = report
            self._in_flight = None
          else:
            self.counts['duplicates'] += 1
    except ChannelClosed:  # the controller has gone: the trainer's own stop follows
      pass
    except Exception as e:  # pylint: disable=broad-except  (raised again in the driver's thread, at its next poll)
      self._error = e

  def _publish_next(self) -> None:
    with self._lock:
      if self._in_flight is not None:
        return
      index = next((i for i, a in enumerate(self._asked) if a.params is not None), None)
      if index is None:
        return
      asked = self._asked[index]
      self._link.store.publish(asked.version, asked.params)
      self._asked[index] = asked._replace(params=None)
      self._in_flight = asked.version

  def _waiting(self) -> int:
    with self._lock:
      return sum(a.params is not None for a in self._asked)

  def _check(self) -> None:
    if self._error is not None:
      raise self._error
    for flag, reason in self._stops:
      if flag.is_set():
        raise errors.StopRequested(reason)

  def submit(self, source, params, key, progress, reached_s: float) -> None:
    """Asks for the evaluation of version `progress.iterations` (`params`); the evaluator derives the same key
    (`rollout.keys.eval_key` of the version), so `source` and `key` are not needed; `reached_s`: the run clock now."""
    del source, key
    host = jax.tree.map(np.asarray, jax.device_get(params))
    t0 = time.monotonic()
    while self._waiting() >= self._max_pending:  # the evaluator is that far behind: wait for room
      self._check()
      time.sleep(0.01)
    self.counts['wait_s'] += time.monotonic() - t0
    with self._lock:
      self._asked.append(
          _Asked(int(progress.iterations), int(progress.env_steps), float(progress.train_wall), time.time(), host,
                 reached_s))

  def _all_reported(self) -> bool:
    with self._lock:
      return all(a.version in self._reports for a in self._asked)

  def poll(self, progress, logger, now: Callable[[], float]) -> Optional[float]:
    """Records every point that has come in, in version order; returns the last return (None: none came). With
    `settle`, first waits (up to `wait_s`) until every version asked for has come in."""
    if self._settle and not self._all_reported():
      t0, deadline = time.monotonic(), time.monotonic() + self._wait_s
      while not self._all_reported() and time.monotonic() < deadline:
        self._check()
        time.sleep(0.01)
      self.counts['settle_s'] += time.monotonic() - t0
      if not self._all_reported():
        logging.warning(
            '--deterministic: the evaluator did not report versions asked for within %.0f s '
            '(--evaluator_wait_s); training goes on, so a --target_return stop may come later than '
            'in a run whose evaluator keeps pace.', self._wait_s)
    return self._record(progress, logger, now)

  def _record(self, progress, logger, now: Callable[[], float]) -> Optional[float]:
    if self._error is not None:
      raise self._error
    ready = []
    with self._lock:
      while self._asked and self._asked[0].version in self._reports:
        asked = self._asked.popleft()
        ready.append((asked, self._reports.pop(asked.version)))
    eval_return = None
    for asked, report in ready:
      wall_s = now() - max(0.0, time.time() - float(report.unix))  # when the evaluation finished, on the run clock
      metrics = {
          'eval/episode_return': float(report.episode_return),
          'eval/episode_length': float(report.episode_length)
      }
      eval_return = evaluations.record(progress,
                                       logger,
                                       self._target,
                                       metrics,
                                       asked.env_steps,
                                       wall_s,
                                       asked.train_s,
                                       asked.version,
                                       float(report.unix),
                                       reached_s=asked.reached_s)
      self.counts['evaluations'] += 1
      self.counts['eval_s'] += float(report.seconds)
      self.counts['max_lag_s'] = max(self.counts['max_lag_s'], float(report.unix) - asked.unix)
    return eval_return

  def finish(self, progress, logger, now: Callable[[], float], timeout: Optional[float] = None) -> None:
    """Waits (up to `timeout`, default `wait_s`) until every asked-for version is reported, and records them;
    a version still outstanding then is left out of the curve, with a warning and counted as missing."""
    self._finished = True
    deadline = time.monotonic() + (self._wait_s if timeout is None else timeout)
    while time.monotonic() < deadline:
      self._record(progress, logger, now)
      with self._lock:
        if not self._asked:
          return
      self._check()
      time.sleep(0.01)
    self._record(progress, logger, now)
    with self._lock:
      missing = [a.version for a in self._asked]
    if missing:
      self.counts['missing'] = len(missing)
      logging.warning(
          'the evaluator did not report versions %s within %.0f s (--evaluator_wait_s); the curve '
          'ends without them.', missing, self._wait_s if timeout is None else timeout)

  def close(self, progress, logger, now: Callable[[], float], quiet=()) -> None:
    """A run that stopped part-way: records what comes in within a short wait, then ends the link thread."""
    try:
      if self._finished:
        self._record(progress, logger, now)
      else:
        self.finish(progress, logger, now, timeout=_STOP_WAIT_S)
    except quiet:
      pass
    finally:
      self._closed.set()
      self._thread.join(timeout=2 * _POLL_S + 1.0)

  def summary_extra(self) -> Dict[str, Any]:
    """`extra['evaluator']`: evaluations recorded, duplicates dropped, versions missing at the end, seconds the
    trainer waited for room and the evaluator spent evaluating."""
    return {'evaluator': {k: round(v, 3) if isinstance(v, float) else v for k, v in self.counts.items()}}
