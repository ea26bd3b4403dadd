"""Trainer worker: consumes finished env-group segments, runs `train_step`, publishes parameters.

It runs the training driver every schedule shares (`trainer.driver`: evaluation cadence, checkpoints, target,
metrics) around a `ChannelSource` whose iterations come from the segment channel instead of a local rollout, and
sends its summary (or the error it stopped on) to the controller on its control pipe.
A cell's trainer rank (`cfg.ranks`) trains through `trainer.ranks.RankStep`: its SIGINT (the controller's stop
request) and its --max_wall_s are votes the ranks agree on at a step, never a stop of its own.
NOTE: versions. The trainer publishes version v = iterations trained so far. A segment collected with version b
is `v - b` versions stale when trained on; segments staler than the bound are dropped (and counted).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any, Dict, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import metrics as metrics_lib
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import trace_cache
from ebrl_jax.runtime import tracing
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import ranks
from ebrl_jax.trainer import remote_eval
from ebrl_jax.trainer import stages as trainer_stages


class TrainerChannels(NamedTuple):
  """What the controller hands the trainer process: the segment channel, parameter store and stop event, its
  control pipe's `lifecycle.Outbox`, and optionally its feedback slots (`runtime.feedback.Feedback`: train_step
  seconds and iterations). `interrupt` is the trainer's own: set by SIGINT, the controller's request to stop at
  the next iteration boundary and send a partial summary (`trainer_main` installs it). `evaluation`: with
  --evaluator=process, the `remote_eval.EvalLink` to the evaluator process (None: the trainer evaluates)."""
  segments: Any
  params: Any
  stop: Any
  outbox: Any = None
  feedback: Any = None
  interrupt: Any = None
  evaluation: Any = None


def _host_params(params) -> Any:
  return jax.tree.map(np.asarray, jax.device_get(params))


class ChannelSource:
  """The driver's `BatchSource` over a segment channel fed by rollout workers."""

  def __init__(self, cfg: driver.TrainerConfig, spec: types.EnvSpec, network, optimizer, channels: TrainerChannels):
    self._phase = lifecycle.Phase(cfg.process.run_dir, 'trainer')  # start-up steps, for the controller's log
    self._phase('building the train step and the evaluator')
    self._cfg, self._spec, self._ch = cfg, spec, channels
    self._num_groups = cfg.schedule.block_count  # records per iteration: one per group, or per env block
    self._bound = cfg.schedule.staleness_bound
    self._h2d = 'h2d' in cfg.windows
    self._deterministic = cfg.schedule.deterministic
    self._ahead: Dict[tuple, Any] = {}  # --deterministic: (group, iteration) -> a record that came early
    self._on_device: Dict[int, Any] = {}
    train_args = (network, optimizer, cfg.algo, cfg.policy.min_std, cfg.sim.group_size, self._bound > 0)
    self._rank = None  # a cell's trainer rank: the step over every rank, with this rank's stop vote
    if cfg.ranks is not None and cfg.ranks.multi:
      interrupt = channels.interrupt
      vote = ranks.StopVote(cfg.schedule.max_wall_s, cfg.start.unix if cfg.start else None, lambda: 'SIGINT'
                            if interrupt is not None and interrupt.is_set() else None)
      self._rank = ranks.RankStep.over_ranks(train_args, vote)
    self._train = self._rank or trace_cache.jit(cfg.process.trace_cache_dir,
                                                'train_step',
                                                trainer_stages.train_fn(*train_args),
                                                (cfg.algo, cfg.policy, cfg.sim.group_size, self._bound > 0),
                                                donate_argnums=(0,))
    self._root_key = keys.root(cfg.schedule.seed)
    self._evaluator = None  # the evaluator process evaluates: the trainer builds and compiles no evaluation
    if channels.evaluation is None:
      self._evaluator = evaluation.make_evaluator(cfg.sim, cfg.policy, cfg.schedule.seed,
                                                  cfg.schedule.deterministic_eval, network,
                                                  trace_cache.lowerer(cfg.process.trace_cache_dir))
    self.tracer = tracing.Tracer(cfg.process.trace_dir, 'trainer')
    self._seen: Dict[tuple, int] = {}
    self.counts = {
        'segments_consumed': 0,
        'segments_dropped_stale': 0,
        'segments_duplicated': 0,
        'wait_s': 0.0,
        'train_s': 0.0,
        'max_staleness_seen': 0
    }
    self._startup_s: Optional[float] = None  # the session's first iteration, once done (see take_startup_s)
    self._startup_taken = False

  def compile(self, train_state, num_iterations: int) -> float:
    del num_iterations
    t0 = time.monotonic()
    self._phase('publishing policy version 0, compiling the evaluation')
    self._ch.params.publish(int(train_state.policy_version), _host_params(train_state.params))
    if self._evaluator is not None:
      self._evaluator.lower_and_compile(train_state.params)
    if self._rank is not None:
      self._rank.probe(train_state.params)  # the all-reduce alone, once at the start (every rank here)
    return time.monotonic() - t0

  def take_startup_s(self) -> Optional[float]:
    """Once per session, after the first `run_iterations`: the seconds of its first iteration. That iteration
    is start-up, not throughput: its wait covers the rollout workers' building and compiling and its first
    collect, and its train step the train step's compile. `run_training` moves it into compile_s and leaves
    its env steps out of the end-to-end rate (the fused schedules compile ahead instead). None afterwards."""
    if self._startup_taken or self._startup_s is None:
      return None
    self._startup_taken = True
    return self._startup_s

  def _check_stop(self) -> None:
    """Raises `errors.StopRequested` once the run's stop or this trainer's interrupt (SIGINT) is set (a rank's
    interrupt is its vote instead: `RankStep`)."""
    if self._ch.interrupt is not None and self._ch.interrupt.is_set() and self._rank is None:
      raise errors.StopRequested('SIGINT')
    if self._ch.stop.is_set():
      raise errors.StopRequested('stopped by the controller')

  def _next_records(self, version: int):
    """Blocks until `num_groups` usable records are in; drops stale ones. Raises StopRequested on a stop. With
    the 'h2d' window each record's transition is copied to the device as it arrives (`self._on_device`, by
    group), while the groups still simulating go on. With --deterministic the records are every group's segment
    of iteration `version`: one of a later iteration waits in `self._ahead` for its turn."""
    records, self._on_device = [], {}
    if self._deterministic:
      for group in range(self._num_groups):
        record = self._ahead.pop((group, version), None)
        if record is not None:
          self._accept(record, version, records)
    while len(records) < self._num_groups:
      if self._startup_s is None:
        self._phase(f'waiting for the first segments ({len(records)} of {self._num_groups} groups in)')
      self._check_stop()
      try:
        record = self._ch.segments.get(timeout=0.5)
      except TimeoutError:
        continue
      # A block's iteration is consumed once, whichever incarnation of its worker delivered it (a restarted one
      # that re-sends blocks of an iteration its predecessor had partly put repeats those)
      key = (int(record.group[0]), int(record.iteration[0]))
      if key in self._seen:
        self.counts['segments_duplicated'] += 1
        continue
      self._seen[key] = version
      if self._deterministic:
        group, iteration = key
        if iteration > version and (group, iteration) not in self._ahead:
          self._ahead[(group, iteration)] = record
          continue
        if iteration != version or any(int(r.group[0]) == group for r in records):
          self.counts['segments_duplicated' if iteration >= version else 'segments_dropped_stale'] += 1
          continue
      staleness = version - int(record.transition.policy_version.min())
      if staleness > self._bound:
        self.counts['segments_dropped_stale'] += 1
        continue
      self._accept(record, version, records)
    return records

  def _accept(self, record, version: int, records: list) -> None:
    staleness = version - int(record.transition.policy_version.min())
    self.counts['max_staleness_seen'] = max(self.counts['max_staleness_seen'], staleness)
    records.append(record)
    if self._h2d:
      with self.tracer.span('train/h2d', version=version, group=int(record.group[0])):
        self._on_device[int(record.group[0])] = jax.device_put(record.transition)

  def _batch(self, records):
    """The iteration's batch [T, S, ...]: the groups' transitions in group order, joined on the env axis (on the
    device from the copies made as they arrived, with the 'h2d' window; the same values either way)."""
    if self._h2d:
      parts = [self._on_device[int(r.group[0])] for r in records]
      return jax.tree.map(lambda *p: jnp.concatenate(p, axis=1), *parts)
    return jax.tree.map(lambda *parts: np.concatenate(parts, axis=1), *(r.transition for r in records))

  def run_iterations(self, train_state, num_iterations: int):
    acc = metrics_lib.IterationMetrics(self._cfg.algo.name)
    for done in range(num_iterations):
      try:
        self._check_stop()
        train_state = self._iteration(train_state, acc)
      except errors.StopRequested as stop:  # at an iteration boundary: the finished ones are counted
        raise errors.StopRequested(stop.reason, done, train_state, self._metrics(acc) if done else None) from None
      if self._rank is not None:  # the ranks agreed to stop after this step: all of them stop here
        self._rank.check_stop(train_state, done + 1, self._metrics(acc))
    return train_state, self._metrics(acc)

  def _metrics(self, acc) -> Dict[str, float]:
    out = acc.result()
    out['trainer/wait/seconds'] = self.counts['wait_s']
    out['trainer/train_step/seconds'] = self.counts['train_s']
    return out

  def _iteration(self, train_state, acc):
    """One iteration: this version's segments, one train step, the next version published."""
    version = int(train_state.policy_version)
    t0 = time.monotonic()
    with self.tracer.span('train/wait_segments', version=version):
      records = self._next_records(version)
    t1 = time.monotonic()
    records.sort(key=lambda r: int(r.group[0]))
    batch = self._batch(records)
    train_key = keys.train_key(self._root_key, version)
    if self._startup_s is None:
      self._phase('first train step (compiling it)')
    with self.tracer.span('train/train_step', version=version):
      train_state, metrics = self._train(train_state, batch, train_key)
      metrics = jax.device_get(metrics)
    t2 = time.monotonic()
    if not all(np.isfinite(float(v)) for v in metrics.values()):
      self._dump_nonfinite(batch, records, metrics, version)
    with self.tracer.span('train/publish_params', version=version):
      self._ch.params.publish(int(train_state.policy_version), _host_params(train_state.params))
    if self._startup_s is None:
      self._startup_s = time.monotonic() - t0
      self._phase.done('training')
    self.counts['wait_s'] += t1 - t0
    self.counts['train_s'] += time.monotonic() - t1
    if self._ch.feedback is not None:
      self._ch.feedback.delivered(t2 - t1, int(train_state.policy_version))
    startup.pin_after_startup()  # the first train step (and the first evaluation) compiled
    self.counts['segments_consumed'] += len(records)
    acc.add(metrics, sum(float(r.episode_stats.return_sum) for r in records),
            sum(float(r.episode_stats.count) for r in records))
    return train_state

  def _dump_nonfinite(self, batch, records, metrics, version) -> None:
    """Keeps the batch that produced a non-finite loss next to the run, for a post-mortem (the driver then
    stops the run when it logs the metric)."""
    path = os.path.join(self._cfg.process.run_dir, f'nonfinite_batch_v{version}.npz')
    # One array per leaf, by its path ('obs', or 'obs.pixels' and 'obs.state' for camera observations).
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    np.savez(path,
             **{
                 jax.tree_util.keystr(p).lstrip('.'): np.asarray(v) for p, v in leaves
             },
             groups=np.array([int(r.group[0]) for r in records]),
             iterations=np.array([int(r.iteration[0]) for r in records]))
    logging.error('trainer: non-finite metrics at version %d (%s); batch saved to %s.', version, {
        k: float(v) for k, v in metrics.items()
    }, path)

  def evaluate(self, params, key) -> Dict[str, float]:
    self._check_stop()  # a stop asked for meanwhile is not kept waiting by an evaluation
    self._phase('the first evaluation')  # no-op once training has started
    with self.tracer.span('train/evaluate', thread=threading.current_thread().name):
      return self._evaluator.evaluate(params, key)

  def summary_extra(self) -> Dict[str, Any]:
    return {**self.counts, **({} if self._rank is None else self._rank.summary_extra())}

  def close(self) -> None:
    if self._evaluator is not None:
      self._evaluator.close()
    self.tracer.close()


def _interrupt_on_sigint() -> Optional[threading.Event]:
  """In a trainer process: SIGINT (the controller's stop request, or Ctrl-C at a terminal) sets the returned flag,
  which `ChannelSource` obeys at the next iteration boundary; a second SIGINT interrupts at once. None in a
  thread (signals reach the main thread only: the run's stop event stops a trainer thread)."""
  if threading.current_thread() is not threading.main_thread():
    return None
  flag = threading.Event()

  def handler(signum, frame):
    if flag.is_set():
      errors.interrupt(signum, frame)
    flag.set()

  signal.signal(signal.SIGINT, handler)
  return flag


def _stops(channels: TrainerChannels, interrupt: Optional[threading.Event]) -> tuple:
  """The (flag, reason) pairs that stop this trainer's waits: its SIGINT flag `interrupt` (None: none) and the
  run's stop (or the controller gone)."""
  return ((interrupt, 'SIGINT'), (channels.stop, 'stopped by the controller'))


def _stop_reason(channels: TrainerChannels) -> Optional[str]:
  """The reason of a stop asked of this trainer before it trains (`_stops`), for the join's wait
  (`distributed.initialize`); None while there is none."""
  return next((why for flag, why in _stops(channels, channels.interrupt) if flag is not None and flag.is_set()), None)


def _remote(cfg: driver.TrainerConfig, channels: TrainerChannels) -> Optional[remote_eval.RemoteEvaluations]:
  """With an evaluator process, the driver's link to it (its waits end on the run's stop and on SIGINT)."""
  if channels.evaluation is None:
    return None
  interrupt = None if cfg.ranks is not None and cfg.ranks.multi else channels.interrupt  # a rank's: a vote
  return remote_eval.RemoteEvaluations(channels.evaluation,
                                       cfg.schedule.target_return,
                                       _stops(channels, interrupt),
                                       cfg.schedule.evaluator_wait_s,
                                       settle=cfg.schedule.deterministic)


def trainer_main(cfg: driver.TrainerConfig, channels: TrainerChannels, env: Optional[dict] = None) -> None:
  """Process entry point: trains until done or stopped and sends its summary (a dict of `driver.RunSummary`,
  `stopped` saying why it ended) on the control pipe, or the `RunError` it stopped on as an `errors.ErrorReport`;
  then sets the stop event. A cell's trainer rank (`cfg.ranks`) joins the other ranks first, names a rank that
  died as a `distributed.RankFailed`, and leaves without JAX's shutdown (`distributed.exit_now`)."""
  interrupt = _interrupt_on_sigint()
  startup.start_process(cfg.process, env)
  joins = cfg.ranks is not None and cfg.ranks.multi and not distributed.joined()  # a thread: the controller joined
  lifecycle.Phase(cfg.process.run_dir,
                  'trainer')('joining the trainer ranks' if joins else 'initialising the network and the train state')
  channels = channels._replace(stop=lifecycle.ParentWatch(channels.stop), interrupt=interrupt or channels.interrupt)
  finished, code = False, 0
  try:
    try:
      if joins:  # a JoinFailed goes to the controller as any RunError, a stop meanwhile ends the join as an
        # interrupted start; then every rank's flags alike, before any trains (RanksDisagree names those that differ)
        distributed.initialize(cfg.ranks, lambda: _stop_reason(channels))
        distributed.agree(cfg.ranks, config_lib.agreed_flags(cfg.sim, cfg.policy, cfg.algo, cfg.schedule))
      summary = driver.run_training(cfg, lambda c, s, n, o: ChannelSource(c, s, n, o, channels), _remote(cfg, channels))
    except jax.errors.JaxRuntimeError as e:  # an all-reduce failed: a peer rank died
      if not distributed.joined():
        raise
      raise distributed.failed_rank(cfg.ranks, e) from e
    channels.outbox.send('result', dataclasses.asdict(summary))
    finished = summary.stopped in driver.FINISHED or ranks.stopped_together(summary.extra.get('cell_step', {}))
  except KeyboardInterrupt:  # interrupted twice, or before the driver's loop: no summary to send
    logging.warning('trainer: interrupted before it had a summary; the last checkpoint stays loadable.')
  except errors.RunError as e:  # the controller raises it again with these words
    logging.error('trainer: %s', e)
    channels.outbox.send('error', errors.report(e))
  except OSError as e:  # the controller has gone (a broken control pipe): nobody to tell
    logging.warning('trainer: could not reach the controller: %s', e)
  except Exception:  # pylint: disable=broad-except  (a rank leaves through exit_now below: say why first)
    if not joins:
      raise
    logging.exception('trainer rank %d failed', cfg.ranks.process_id)
    code = 1
  finally:
    channels.stop.set()
    if joins:  # every rank at one barrier after a finished (or agreed) end: rank 0 (the coordinator) ends last
      if finished:
        distributed.barrier('ebrl_jax/end', cfg.ranks.heartbeat_timeout_s * 3)
      distributed.exit_now(code)
