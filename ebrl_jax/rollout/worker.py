"""Rollout worker: one env group (`rollout.groups`), simulated and acted on in one process (or acted on by the
generation worker), segments sent to the trainer.

With generation co-located (the policy runs in this process), small policies avoid a hand-off every env step.
Each group advances on its own: it waits only for the staleness bound, never for other groups (`--schedule=sync`
is the bound 0: every iteration waits for the parameters trained on the previous one, which is the barrier).
NOTE: a segment is put on the channel only once complete, so a worker killed mid-segment loses that segment's
work but never hands the trainer a partial one; its replacement starts at the trainer's current version.
"""
from __future__ import annotations

import os
import time
from typing import Any, NamedTuple, Optional

from absl import logging
import jax
import numpy as np

from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.rollout import groups
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import feedback as feedback_lib
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import tracing
from ebrl_jax.transport import ChannelClosed


class RolloutChannels(NamedTuple):
  segments: Any
  params: Any
  stop: Any
  mailbox: Any = None  # set when a separate generation worker serves the actions


class _EitherSet:
  """Set when either event is: the run's stop, or this worker's own `retire` (a quota change replaces it)."""

  def __init__(self, first, second):
    self._first, self._second = first, second

  def is_set(self) -> bool:
    return self._first.is_set() or (self._second is not None and self._second.is_set())


def _stand_by(worker, store, control, stop, key, phase) -> bool:
  """A warm standby: builds and compiles with one throw-away collect (the old worker still owns the group),
  says it is ready, then waits for 'go'. False if the run stopped meanwhile, or the change it stood by for was
  given up (its `retire`: controller/relayout.py, after another standby of the change died).

  NOTE: with a generation worker the standby does not collect (the group's mailbox slot belongs to the old
  worker until it has exited); it only builds its envs.
  """
  if not worker.remote:
    version, host_params = store.latest()
    jax.device_get(worker.collect(jax.device_put(host_params), version, key)[0])
  quota = os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '0')
  control.feedback[feedback_lib.QUOTA] = float(quota or 0)
  control.feedback[feedback_lib.READY_T] = time.time()
  control.ready.set()
  phase('warm standby: ready, waiting for the worker it replaces to retire')
  while not stop.is_set() and not control.retire.is_set():
    if control.go.wait(timeout=0.2):
      return True
  return False


def _retired(control: Optional[feedback_lib.WorkerControl], iteration: int) -> bool:
  """A change of the env groups has this worker's layout end before `iteration` (feedback's RETIRE_AT)."""
  if control is None:
    return False
  retire_at = int(control.feedback[feedback_lib.RETIRE_AT])
  return 0 < retire_at <= iteration


def _records(transition, stats, group: int, iteration: int, incarnation: int, cfg: groups.RolloutConfig):
  """The segment's records: one for the group, or with env blocks (--group_schedule) one per block of the group's
  envs, `group` then the block's index in the run's block layout; the episode stats ride on the first."""
  arrays = jax.tree.map(np.asarray, transition)  # (pixel observations are a nested pytree)
  per_group = cfg.group_envs // cfg.block_envs if cfg.block_envs else 1
  columns = arrays.reward.shape[1] // per_group
  out = []
  for j in range(per_group):
    part = arrays if per_group == 1 else jax.tree.map(lambda x, j=j: x[:, j * columns:(j + 1) * columns], arrays)
    episode = stats if j == 0 else tuple(0.0 for _ in stats)
    out.append(
        types.SegmentRecord(transition=part,
                            group=np.array([group * per_group + j], np.int32),
                            iteration=np.array([iteration], np.int32),
                            incarnation=np.array([incarnation], np.int32),
                            episode_stats=types.EpisodeStats(*(np.float32(x) for x in episode))))
  return out


def _put_all(channel, records, stop) -> bool:
  """Puts every record (retrying while the channel is full); False if the run's stop came first."""
  for record in records:
    while True:
      if stop.is_set():
        return False
      try:
        channel.put(record, timeout=0.5)
        break
      except TimeoutError:
        continue
  return True


def rollout_main(cfg: groups.RolloutConfig,
                 group: int,
                 channels: RolloutChannels,
                 incarnation: int = 0,
                 env: Optional[dict] = None,
                 control: Optional[feedback_lib.WorkerControl] = None):
  """Process entry point for env group `group` (`incarnation`: how many times its worker was restarted or
  swapped). `control` (optional): feedback slots written each iteration, a `retire` event that ends the worker
  after its current iteration, and for a warm standby the `go` it waits on (see controller/replan.py)."""
  startup.start_process(cfg.process, env)
  stop = lifecycle.ParentWatch(channels.stop)
  standby = control is not None and control.go is not None
  phase = lifecycle.Phase(cfg.process.run_dir, f'rollout/{group}' + (f'#{incarnation}' if incarnation else ''))
  phase('building its envs')
  tracer = tracing.Tracer(cfg.process.trace_dir, f'rollout/{group}')
  spec = sim.spec_of(cfg.sim)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  worker = groups.make_group(cfg, group, network, tracer, channels.mailbox, stop)
  root_key = keys.cell_key(keys.root(cfg.seed), cfg.cell)  # the rollout keys of this worker's cell
  bound = cfg.staleness_bound
  store = channels.params
  params_version, params = -1, None
  running = _EitherSet(stop, control.retire if control is not None else None)
  remote = worker.remote  # acts come from the generation worker
  try:
    phase('waiting for policy version 0 (the trainer publishes it once initialised)')
    if not lifecycle.wait_for_version(store, 0, stop):  # the trainer publishes version 0 once it has initialised
      return
    if control is not None:
      control.feedback[feedback_lib.QUOTA] = float(os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') or 0)
      if standby:
        phase('warm standby: ' +
              ('built, acts come from the generation worker' if remote else 'a throw-away collect (compiling it)'))
        if not _stand_by(worker, store, control, stop, root_key, phase):
          return
    phase('first collect' + (' (acts come from the generation worker)' if remote else ' (compiling it)'))
    iteration = store.version()  # a restarted worker resumes at the trainer's version
    if control is not None:  # a standby goes on after the iteration its predecessor delivered last
      iteration = max(iteration, int(control.feedback[feedback_lib.START_ITERATION]))
    while not running.is_set() and not _retired(control, iteration):
      # NOTE: the staleness bound: iteration i may start once version i - bound is published.
      with tracer.span('rollout/wait_params'):
        if not lifecycle.wait_for_version(store, iteration - bound, running) or _retired(control, iteration):
          break  # (a change of the env groups may have been asked for while it waited: see controller/relayout.py)
        if remote:
          params_version = max(0, iteration - bound)
          worker.set_min_version(params_version)
        elif cfg.deterministic and params_version != max(0, iteration - bound):
          params_version = max(0, iteration - bound)  # the version this iteration is due, not the newest
          params = jax.device_put(store.get(params_version))
        elif not cfg.deterministic and store.version() != params_version:
          params_version, host_params = store.latest()
          params = jax.device_put(host_params)
      roll_key = keys.rollout_key(root_key, iteration, group)
      t_collect = time.monotonic()
      with tracer.span('rollout/collect', iteration=iteration, version=params_version):
        transition, stats = worker.collect(params, params_version, roll_key)
      t_collect = time.monotonic() - t_collect
      records = _records(transition, stats, group, iteration, incarnation, cfg)
      with tracer.span('rollout/put_segment'):
        # A retiring worker still delivers the segment it finished: only the run's stop abandons it.
        if _put_all(channels.segments, records, stop):
          if control is not None:
            control.feedback.delivered(t_collect, iteration)
          startup.pin_after_startup()  # MJX groups: the first collect compiled (native ones were pinned at start)
          phase.done('collecting')
      if 'reset_next' in cfg.windows:  # the overlap window: next episodes' reset while the trainer trains
        with tracer.span('rollout/reset_next', iteration=iteration + 1):
          worker.prepare_next()
      iteration += 1
  except (ChannelClosed, InterruptedError):
    pass
  finally:
    worker.close()
    tracer.close()
  logging.info('rollout worker %d: stopped.', group)
