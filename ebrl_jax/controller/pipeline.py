"""The process schedules, `sync`, `async` and `overlap`: one trainer worker and one rollout worker per env group
(and, with `--nocolocate_generation`, one generation worker), composed from the topology, the transport and the
supervisor.

The controller builds the transport (a segment channel and a versioned parameter store) from the topology, lets
the supervisor start and watch the workers, and on exit — normal, error, Ctrl-C or SIGTERM — stops every child and
unlinks every shared-memory segment. `sync` is the staleness bound 0 (a barrier each iteration); `async` lets each
group run up to `--max_staleness` versions ahead of the trainer, with the decoupled PPO correction; `overlap` is
`sync` plus the windows of its iteration graph (controller/iteration_graph.py). With `--quota_schedule`,
`--replan` or `--slack_quotas`, the watch loop also changes the rollout workers' SM quota during the run by
warm-standby swaps (controller/replan.py); with `--group_schedule` or `--replan_groups`, the number of env groups
(controller/relayout.py).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import shutil
import signal
import time
from typing import Dict, List, Optional, Tuple

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax import transport
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import relayout
from ebrl_jax.controller import replan
from ebrl_jax.controller import slack_quotas
from ebrl_jax.controller import supervisor as supervisor_lib
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import memory
from ebrl_jax.resources import mps
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import stop_grace
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import remote_eval


def calibration_env(mps_daemon: Optional[mps.MpsDaemon], quota: int) -> Dict[str, str]:
  """A calibration process runs alone: most of the memory, and its quota under the run's MPS daemon."""
  env = {'EBRL_ROLE': f'calibrate/q{quota}', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.850'}
  if mps_daemon is not None:
    env.update(mps_daemon.worker_env(quota))
  return env


def rollout_figures(cfg: config_lib.Config, history, segment_steps=None) -> dict:
  """Rollout throughput (docs/benchmarks.md): env steps per second while collecting, from what each rollout worker
  reported (segments delivered, seconds inside collect). Groups collect at the same time, so the run's figure is
  the sum of the groups' rates; a group served by several workers in turn (restarts, quota swaps) pools them."""
  per_segment = cfg.env_steps_per_iteration // cfg.schedule.num_groups  # (`segment_steps`: per worker, by id)
  groups: Dict[str, List[float]] = {}
  for role, control in history:
    snap = control.feedback.snapshot()
    acc = groups.setdefault(role, [0.0, 0.0, 0.0])
    acc[0] += snap.iterations
    acc[1] += snap.stage_s
    acc[2] += snap.iterations * (segment_steps or {}).get(id(control), per_segment)
  rates = {role: steps / t for role, (_, t, steps) in sorted(groups.items()) if steps and t > 0}
  return {
      'env_steps_per_s': sum(rates.values()) if rates else None,
      'group_env_steps_per_s': rates,
      'segments': int(sum(n for n, _, _ in groups.values())),
      'collect_s': {
          r: t for r, (_, t, _) in groups.items()
      }
  }


def generation_layout(cfg: config_lib.Config, topology, plan_record) -> dict:
  """Where generation ran, how its hand-off travelled, and why (the planner's reason, or the flags')."""
  planned = (plan_record or {}).get('generation')
  reason = planned['reason'] if planned else (
      'set by --colocate_generation' if cfg.schedule.colocate_generation else 'set by --nocolocate_generation')
  transport_name = topology.rollout.generation_transport
  if transport_name and not planned:
    reason += f'; hand-off {transport_name} (--generation_transport={cfg.schedule.generation_transport})'
  return {'colocated': cfg.schedule.colocate_generation, 'transport': transport_name, 'reason': reason}


def _generation_stats_files(cfg: config_lib.Config):
  return sorted(glob.glob(os.path.join(cfg.schedule.run_dir, generation_worker.STATS_PREFIX + '*.json')))


def _transport(cfg: config_lib.Config, topology: topology_lib.Topology, registry):
  """(segment channel, parameter store, mailbox or None) of the run, as the topology describes them."""
  kind = cfg.schedule.transport
  channel = transport.make_channel(kind, topology.segment_spec, topology.segment_capacity, registry)
  store = transport.make_param_store(kind, topology.param_template, registry, topology.param_history)
  mailbox = None
  if topology.request_spec is not None:
    mailbox = transport.make_mailbox(kind,
                                     topology.request_spec,
                                     topology.reply_spec,
                                     topology.num_groups,
                                     registry=registry,
                                     num_slices=cfg.schedule.env_slices,
                                     slice_field='env_slice')
  return channel, store, mailbox


_REPORT_CAPACITY = 4  # evaluator reports in flight (one is, at most; a restarted evaluator may repeat it)


def _evaluation_link(cfg: config_lib.Config, topology: topology_lib.Topology, registry):
  """--evaluator=process: the evaluation parameter store (the versions the trainer asks the evaluator for) and
  the report channel (the evaluator's answers); None where the trainer evaluates."""
  if topology.evaluator is None:
    return None
  kind = cfg.schedule.transport
  return remote_eval.EvalLink(transport.make_param_store(kind, topology.param_template, registry),
                              transport.make_channel(kind, topology.report_spec, _REPORT_CAPACITY, registry))


def sweep_stale_segments() -> transport.shm.Sweep:
  """Removes the shared memory that SIGKILLed runs left behind (segments whose creating controller is gone) and
  says in one line how much it freed."""
  swept = transport.ShmRegistry.sweep()
  if swept.names:
    logging.info('freed %d bytes of shared memory: %d segments left in %s by dead runs (controller pids %s).',
                 swept.nbytes, len(swept.names), transport.shm.SHM_DIR, ', '.join(map(str, swept.owners)))
  return swept


def _recovered(parts) -> Dict[str, int]:
  """What the run's channels and parameter store recovered from dead peers (read before the segments go)."""
  counts = [p.recovered() for p in parts]
  return {'recovered_slots': sum(c.slots for c in counts), 'recovered_locks': sum(c.locks for c in counts)}


def _plan(cfg: config_lib.Config, topology, memory_plan, mps_daemon, start_unix: float):
  """`--plan`: groups and quotas from stage profiles (calibrated first if there are none, within the calibration
  budget from `start_unix`); returns the planned (cfg, topology, plan record, memory plan), or the run's own
  without --plan."""
  if not cfg.resources.plan:
    return cfg, topology, None, memory_plan
  cfg, plan_record = autoplan.plan_run(cfg, mps_daemon is not None, functools.partial(calibration_env, mps_daemon),
                                       calibration_procs.deadline(cfg, start_unix))
  topology = topology_lib.make_topology(cfg, topology.cell)  # the chosen groups: budgets again, before any worker
  memory_plan = memory.plan_for_run(cfg, topology.env_spec, list(topology.planned_roles))
  memory_plan.log()
  return cfg, topology, plan_record, memory_plan


_STOP_GRACE_S = 10.0  # after SIGTERM or Ctrl-C, the trainer's time to reach its iteration boundary (besides its save)
_CELL_STOP_GRACE_S = 60.0  # the same for a cell's trainer rank: it stops when every rank has reached its step


def _stop_trainer(cfg: config_lib.Config, workers: supervisor_lib.Supervisor) -> None:
  """After SIGTERM or Ctrl-C: asks the trainer to stop at its next iteration boundary (SIGINT to its process, which
  its handler turns into a request once it runs; the run's stop for a thread, its interrupt for a thread that is a
  cell's rank) and goes on watching while it saves the checkpoint of that iteration and sends its partial summary.
  A trainer process that has not ended within its grace is terminated (runtime/stop_grace.py: _STOP_GRACE_S,
  a cell's rank _CELL_STOP_GRACE_S, or two of its iterations, plus the time its checkpoint saves take)."""
  trainer = workers.workers.get('trainer')
  if trainer is None:
    return
  workers.tick, grace = None, None  # no live quota change while the run stops
  if not trainer.is_alive():
    pass  # it has ended (its summary, if it sent one, is read below)
  elif workers.trainer_interrupt is not None:  # a thread that is a cell's rank: it votes to stop (trainer.ranks)
    workers.trainer_interrupt.set()
  elif not workers.use_processes:
    workers.stop.set()
  elif lifecycle.read_phases(cfg.schedule.run_dir).get('trainer', {}).get('pid') == trainer.pid:
    base = stop_grace.base_grace(_CELL_STOP_GRACE_S if workers.cell_rank else _STOP_GRACE_S,
                                 workers.trainer_feedback.snapshot().period_s)
    grace = stop_grace.StopGrace(trainer, os.path.join(cfg.schedule.run_dir, 'checkpoints'), base)
    logging.info(
        'stopping: asking the trainer for its checkpoint and summary so far (up to %.0f s, longer while '
        'its save is being written).', grace.deadline - grace.asked)
    os.kill(trainer.pid, signal.SIGINT)  # its handler is installed before it reports a phase
    grace.start()
  else:  # still importing: nothing to send yet
    trainer.terminate()
  try:
    workers.watch()
  except (KeyboardInterrupt, errors.RunError) as e:  # stopped twice, or the trainer ended without its summary
    logging.info('the trainer sent no summary (%s).', type(e).__name__)
  finally:
    if grace is not None:
      grace.cancel()


def _start_and_watch(cfg: config_lib.Config,
                     workers: supervisor_lib.Supervisor) -> Tuple[Optional[str], Optional[errors.WorkerFailure]]:
  """Starts the workers and watches them until the trainer has ended. Returns (None, None), or what stopped the
  run after the trainer had its chance to send its summary so far: the signal (SIGTERM, SIGINT), or the failure
  of a worker beside the trainer (its `stopped` set)."""
  with lifecycle.stop_signals_as_interrupt():
    try:
      workers.start_all()
      workers.watch()
      return None, None
    except KeyboardInterrupt as interrupt:
      stopped, failure = errors.stop_reason(interrupt), None
    except errors.WorkerFailure as e:
      if e.stopped is None:  # the trainer's own: nobody left to send a summary
        raise
      logging.error('%s; stopping the run.', e)
      stopped, failure = e.stopped, e
    _stop_trainer(cfg, workers)
  return stopped, failure


def run(cfg: config_lib.Config,
        pids: Optional[Dict[str, int]] = None,
        start: Optional[run_clock.StartClock] = None,
        cell: Optional[cells_lib.Cell] = None) -> driver.RunSummary:
  """Runs `sync` or `async` and returns the trainer's summary (plus what the controller saw), also of a run
  stopped by SIGTERM or Ctrl-C (its `stopped` names the signal). `pids` (role -> pid) is kept up to date for
  telemetry while the run goes on; `start` is the run's clock, which the trainer's figures count from. `cell`:
  this run is that cell of several (its trainer worker a rank; None: the one cell)."""
  start = start or run_clock.StartClock(time.time())
  os.makedirs(cfg.schedule.run_dir, exist_ok=True)
  for path in _generation_stats_files(cfg):  # a reused run directory: count this run's batches only
    os.remove(path)
  shutil.rmtree(os.path.join(cfg.schedule.run_dir, lifecycle.PHASES_DIR), ignore_errors=True)  # and its phases
  topology = topology_lib.make_topology(cfg, cell)
  memory_plan = memory.plan_for_run(cfg, topology.env_spec, list(topology.planned_roles))  # no fit: stops here
  memory_plan.log()
  use_processes = cfg.schedule.transport == 'shm'
  if use_processes:
    sweep_stale_segments()
  registry: Optional[transport.ShmRegistry] = transport.ShmRegistry() if use_processes else None
  workers, plan_record, changer, parts = None, None, None, []
  mps_daemon = mps.MpsDaemon(cfg.schedule.run_dir) if cfg.resources.use_mps and use_processes else None
  try:
    if mps_daemon is not None and not mps_daemon.start():
      mps_daemon = None
    cfg, topology, plan_record, memory_plan = _plan(cfg, topology, memory_plan, mps_daemon, start.unix)
    logging.info('topology: %s', topology.describe())
    logging.info('%s', topology.iteration_graph.lines())
    placement = supervisor_lib.Placement(cfg, topology, mps_daemon, memory_plan)
    seg_channel, store, mailbox = _transport(cfg, topology, registry)
    evaluation = _evaluation_link(cfg, topology, registry)
    parts = [seg_channel, store] + ([mailbox.requests] + mailbox.replies if mailbox is not None else [])
    parts += list(evaluation) if evaluation is not None else []
    start = start.mark('workers_setup')  # topology, memory plan, MPS, --plan, shared memory
    topology = dataclasses.replace(topology, trainer=dataclasses.replace(topology.trainer, start=start))
    workers = supervisor_lib.Supervisor(cfg, topology, seg_channel, store, use_processes, mailbox, placement, pids,
                                        evaluation)
    if cfg.resources.slack_quotas:
      changer = slack_quotas.make_changer(cfg, workers, mps_daemon is not None)
    elif cfg.schedule.relaid:
      changer = relayout.make_changer(cfg, workers, plan_record, mps_daemon is not None)
    else:
      changer = replan.make_changer(cfg, workers, plan_record, mps_daemon is not None)
    workers.tick = changer.poll if changer is not None else None
    stopped, failure = _start_and_watch(cfg, workers)
  finally:
    if workers is not None:
      line = workers.startup_phases()  # a run stopped or failed before its first train step: where it waited
      if line is not None:
        logging.warning('stopped during %s', line)
      workers.stop_all()
    if changer is not None:
      changer.close()
    recovered = _recovered(parts)
    if registry is not None:
      registry.close()
    if mps_daemon is not None:
      mps_daemon.stop()
  if workers.summary is None and failure is not None:
    raise failure  # the runner writes the controller's own summary, then raises it
  if workers.summary is None and stopped is not None:
    raise KeyboardInterrupt(stopped)  # the runner writes the controller's own summary
  if workers.summary is None:
    raise errors.TrainerDied('the trainer ended without sending its summary; see its log above.')
  summary = driver.RunSummary(**workers.summary)
  if stopped is not None and summary.stopped not in driver.FINISHED:
    summary.stopped = stopped  # the trainer saw a stop request: the controller knows which signal, or failure
    if failure is not None:
      summary.extra['failure'] = str(failure)
  _add_extra(cfg, summary, workers, topology, plan_record, memory_plan, changer)
  summary.extra.update(recovered)
  if topology.cell.multi:
    summary.extra['cells'] = cells_lib.summary_cells(topology.cell, cfg.sim.num_envs,
                                                     topology.trainer.env_steps_per_iteration, summary.extra)
  return summary


def _add_extra(cfg, summary, workers, topology, plan_record, memory_plan, changer) -> None:
  """What the controller saw, into `summary.extra`: restarts, rollout figures, the plan, memory, live changes,
  the generation worker's batching and the topology."""
  summary.extra['topology'] = topology.describe()
  summary.extra['iteration_graph'] = topology.iteration_graph.describe()
  summary.extra['worker_restarts'] = workers.restarts
  summary.extra['rollout'] = rollout_figures(cfg, workers.control_history, workers.segment_steps)
  if summary.extra['rollout']['env_steps_per_s']:
    logging.info('rollout: %.0f env steps/s while collecting (%d segments).',
                 summary.extra['rollout']['env_steps_per_s'], summary.extra['rollout']['segments'])
  if plan_record is not None:
    plan_record['measured_env_steps_per_s'] = summary.env_steps_per_s
    plan_record['measured_over_predicted'] = summary.env_steps_per_s / plan_record['predicted_env_steps_per_s']
    summary.extra['plan'] = plan_record
    logging.info('--plan predicted %.0f env steps/s, measured %.0f (%.2fx).', plan_record['predicted_env_steps_per_s'],
                 summary.env_steps_per_s, plan_record['measured_over_predicted'])
  summary.extra['memory_plan'] = memory_plan.summary()
  summary.extra['generation_layout'] = generation_layout(cfg, topology, plan_record)
  if changer is not None:
    summary.extra['relayout' if isinstance(changer, relayout.GroupChanger) else 'replan'] = changer.record()
  generation = generation_worker.merge_stats(_generation_stats_files(cfg))
  if generation is not None:
    summary.extra['generation'] = generation
    logging.info('generation worker: %d batches; slices per batch %s; batches per bucket %s; %.1f%% padding.',
                 generation['batches'], generation['requests_per_batch'], generation['batches_per_bucket'],
                 100.0 * generation['padded_rows'] / max(1, generation['rows'] + generation['padded_rows']))
