"""The supervisor of a process schedule's workers: starts them (as processes, each with its own environment,
cores, MPS quota and memory budget, or as threads), watches them, restarts a dead rollout, generation or evaluator
worker (`--worker_fault=restart`) or stops the run cleanly, and stops every one of them on the way out."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.resources import cpus
from ebrl_jax.resources import memory
from ebrl_jax.resources import mps
from ebrl_jax.rollout import evaluator as evaluator_lib
from ebrl_jax.rollout import worker as rollout_worker
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import feedback
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.trainer import worker as trainer_worker

_JOIN_S = 10.0
_MPS_CHECK_S = 1.0  # the watch loop asks the MPS daemon whether it is alive at most this often
_STARTUP_LOG_S = 30.0  # until the first train step, the watch loop says what each worker is doing this often


class Placement:
  """Per-worker environment: memory budget, MPS pipe and SM quota, CPU cores."""

  def __init__(self, cfg: config_lib.Config, topology: topology_lib.Topology, mps_daemon: Optional[mps.MpsDaemon],
               memory_plan: memory.MemoryPlan):
    self._cfg, self._topology, self.mps, self.memory = cfg, topology, mps_daemon, memory_plan
    self._cpu_roles = set(topology.cpu_roles)
    self.cores = (cpus.plan_cores(cpus.available_cores(), topology.cpu_roles, topology.feeder_roles)
                  if cfg.resources.pin_cpus else {})

  def env(self, role: str) -> Dict[str, str]:
    if not self._topology.on_gpu(role):  # simulates on CPU cores; generation acts for it: no GPU context
      env = {'EBRL_ROLE': role, 'JAX_PLATFORMS': 'cpu'}
    else:
      env = {'EBRL_ROLE': role, **self.memory.worker_env(role, mps_active=self.mps is not None)}
      if self.mps is not None:
        env.update(self.mps.worker_env(self._cfg.resources.quota_of(role)))
    if role in self.cores:
      # CPU simulators are pinned at once; GPU feeders compile on every core first (startup.pin_after_startup).
      key = 'EBRL_CPUS' if role in self._cpu_roles else 'EBRL_CPUS_AFTER_STARTUP'
      env[key] = startup.encode_cores(self.cores[role])
    return env


def _said(error: Optional[dict]) -> str:
  """'; its error: Type: message' of a worker's recorded error, '' without one."""
  return f'; its error: {error["type"]}: {error["message"]}' if error else ''


def death_verdict(role: str, pid: Optional[int], code: Optional[int], error: Optional[dict],
                  schedule: config_lib.ScheduleConfig, deaths: int) -> Optional[errors.WorkerFailure]:
  """None when worker `role` (not the trainer; process `pid`, exit code `code`, `error` its recorded error, this
  its `deaths`-th death) is to be restarted; else the `WorkerFailure` that stops the run, its `stopped` set (the
  trainer is alive to send its summary so far): with --worker_fault=stop, past --max_restarts, or at once when the
  error would meet every restart too (the worker refused its configuration, or XLA refused it the memory its
  configuration needs)."""
  cause = _said(error)
  if schedule.worker_fault != 'restart':
    return errors.WorkerFailure(f'{role} (pid {pid}) died with exit code {code}{cause} (--worker_fault=stop)',
                                stopped=errors.WORKER_FAILED)
  if error is not None and error.get('out_of_memory'):
    return errors.WorkerFailure(f'{role} (pid {pid}): {error["out_of_memory"]} (a restart would meet the same)',
                                stopped=errors.OUT_OF_MEMORY)
  if error is not None and error['type'] == 'ValueError':
    return errors.WorkerFailure(
        f'{role} (pid {pid}) refused its configuration: ValueError: {error["message"]} '
        '(a restart would meet the same)',
        stopped=errors.WORKER_FAILED)
  if deaths > schedule.max_restarts:
    return errors.WorkerFailure(
        f'{role} died {deaths} times (last exit code {code}{cause}), more than '
        f'--max_restarts={schedule.max_restarts}',
        stopped=errors.WORKER_FAILED)
  return None


class Supervisor:
  """Starts, watches and stops the workers. Their pids are in `pids` (role -> pid, read by telemetry) and, for
  the user, in `<run_dir>/workers.json`; the trainer's summary arrives on its control pipe (`summary`)."""

  def __init__(self,
               cfg: config_lib.Config,
               topology: topology_lib.Topology,
               seg_channel,
               store,
               use_processes: bool,
               mailbox=None,
               placement: Optional[Placement] = None,
               pids: Optional[Dict[str, int]] = None,
               evaluation=None):
    self._cfg, self._topology, self._use_processes = cfg, topology, use_processes
    self.pids = pids if pids is not None else {}
    self.summary: Optional[dict] = None  # the trainer's result, once it has sent it
    self._placement = placement
    self._ctx = multiprocessing.get_context('spawn') if use_processes else None
    self.stop = lifecycle.make_stop(use_processes)  # no lock a SIGKILLed worker could keep (runtime/lifecycle.py)
    self.use_processes = use_processes
    self.trainer_feedback = feedback.Feedback(use_processes)  # read by controller/replan.py
    self.controls: Dict[str, feedback.WorkerControl] = {}  # rollout role -> its feedback and events
    self.control_history: List[Tuple[str, feedback.WorkerControl]] = []  # every rollout worker that delivered
    self.tick = None  # called by `watch` every `poll_s` when set (the live quota changes)
    self.poll_s = 0.5
    self._incarnations: Dict[str, int] = {}
    # The env-group layout in force (controller/relayout.py changes it with --group_schedule): the group count,
    # the rollout workers' part of the config, and each worker's env steps per segment (by id of its control).
    self.num_groups, self.rollout_cfg = cfg.schedule.num_groups, topology.rollout
    self.store = store  # the parameter store (its version bounds where the rollout workers can be)
    self.segment_steps: Dict[int, float] = {}
    self._inbox, outbox = lifecycle.make_pipe(use_processes)
    self._outbox = outbox
    self.cell_rank = topology.trainer.ranks is not None  # the trainer is a rank of several cells
    # A trainer thread that is a cell's rank: the controller's request to stop, which it votes on (trainer.ranks).
    self.trainer_interrupt = threading.Event() if not use_processes and self.cell_rank else None
    self._trainer_ch = trainer_worker.TrainerChannels(seg_channel,
                                                      store,
                                                      self.stop,
                                                      outbox,
                                                      self.trainer_feedback,
                                                      interrupt=self.trainer_interrupt,
                                                      evaluation=evaluation)
    self._eval_args = None  # --evaluator=process: (its config, its channels)
    if evaluation is not None:
      self._eval_args = (topology.evaluator,
                         evaluator_lib.EvaluatorChannels(evaluation.store, evaluation.reports, self.stop))
    self._rollout_ch = rollout_worker.RolloutChannels(seg_channel, store, self.stop, mailbox)
    self._gen_args = (topology.generation, mailbox, store, self.stop)
    self.workers: Dict[str, Any] = {}
    self.restarts = 0
    self._role_restarts: Dict[str, int] = {}
    # The worker failure that stops the run, once raised: the trainer is then asked for its summary so far, while
    # the dead worker (and any that dies beside it) is left alone.
    self.failure: Optional[errors.WorkerFailure] = None
    self._next_mps_check = 0.0
    self.rollout_quota: Dict[str, int] = {}  # role -> quota set by a live change (else the config's)
    self.started_t: Optional[float] = None  # when start_all ran
    self.first_step_seen = False  # the trainer's first train step is done: start-up is over
    self._next_startup_log = 0.0
    self._failure_dir = os.path.join(cfg.schedule.run_dir, lifecycle.FAILURES_DIR)  # workers' last errors
    self._created_unix = time.time()  # records older than this are an earlier run's (lifecycle.last_error)

  def _last_error(self, w) -> Optional[dict]:
    """{'type', 'message'} of the error worker process `w` recorded before it ended, else None."""
    if not self._use_processes:
      return None
    return lifecycle.last_error(self._failure_dir, getattr(w, 'pid', None), self._created_unix)

  def _start(self, role: str, target, args, env: Optional[Dict[str, str]] = None, register: bool = True, **kwargs):
    # Threads share one process: only processes get their own environment and cores.
    if env is None and self._use_processes and self._placement:
      env = self._placement.env(role)
    kwargs['env'] = env if self._use_processes else None
    if self._use_processes:  # the stop goes first: unpickled, it arms the parent-death signal before any import
      worker = self._ctx.Process(target=lifecycle.run_worker,
                                 args=(self.stop, target, args, kwargs, self._failure_dir),
                                 name=role,
                                 daemon=True)
    else:
      worker = threading.Thread(target=target, args=args, kwargs=kwargs, name=role, daemon=True)
    with lifecycle.spawning(self._use_processes):  # a stop that comes meanwhile is raised once it is watched
      worker.start()
      if register:
        self.workers[role] = worker
        self._write_pids()
    return worker

  def start_rollout(self,
                    group: int,
                    quota: Optional[int] = None,
                    standby: bool = False,
                    rollout_cfg=None,
                    start_iteration: int = 0):
    """Starts group `group`'s rollout worker as the role's next incarnation, at SM quota `quota` (None: the
    config's), in the layout in force (or `rollout_cfg`'s, a standby for a new layout), collecting from iteration
    `start_iteration` on (or the trainer's version, if later). A warm standby (`standby`) is not registered: it
    waits on its control's `go` (controller/replan.py swaps it in). Returns (worker, control)."""
    rollout_cfg = rollout_cfg or self.rollout_cfg
    role = f'rollout/{group}'
    env = None
    if self._use_processes and self._placement is not None:
      env = self._placement.env(role)
      if quota is not None and self._placement.mps is not None:
        env.update(self._placement.mps.worker_env(quota))
      if standby:  # beside the worker it replaces (planned as 'standby/<g>'): it grows into its cap, not takes it
        env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
    incarnation = self._incarnations.get(role, -1) + 1
    self._incarnations[role] = incarnation
    control = feedback.make_control(self._use_processes, standby)
    control.feedback[feedback.START_ITERATION] = start_iteration
    worker = self._start(role,
                         rollout_worker.rollout_main, (rollout_cfg, group, self._rollout_ch, incarnation),
                         env=env,
                         register=not standby,
                         control=control)
    self.segment_steps[id(control)] = (self._cfg.env_steps_per_iteration * rollout_cfg.group_envs /
                                       self._cfg.sim.num_envs)
    if not standby:
      self.controls[role] = control
      self.control_history.append((role, control))
    return worker, control

  def drop_role(self, role: str) -> None:
    """A rollout role the new layout does not have (its worker has exited): no longer watched or restarted."""
    self.workers.pop(role, None)
    self.controls.pop(role, None)
    self._write_pids()

  def swap_in(self, role: str, worker, control) -> None:
    """Makes a started standby the role's worker (the old one, retiring, is no longer watched)."""
    self.workers[role], self.controls[role] = worker, control
    self.control_history.append((role, control))
    self._write_pids()

  def _write_pids(self) -> None:
    if not self._use_processes:
      return
    self.pids.clear()
    self.pids.update({role: w.pid for role, w in self.workers.items()})
    path = os.path.join(self._cfg.schedule.run_dir, 'workers.json')
    try:  # for the user; a full disk must not stop the controller here (the trainer says it)
      storage.write_json(path, {'controller': os.getpid(), 'workers': dict(self.pids), 'restarts': self.restarts})
    except OSError as e:
      logging.warning('could not write %s: %s', path, e)

  def start_all(self) -> None:
    self.started_t = time.monotonic()
    self._next_startup_log = self.started_t + _STARTUP_LOG_S
    self._start('trainer', trainer_worker.trainer_main, (self._topology.trainer, self._trainer_ch))
    self._outbox.close()  # the trainer has its own copy: its death is now an end of file on the inbox
    if self._rollout_ch.mailbox is not None:
      self._start('generation', generation_worker.generation_main, self._gen_args)
    for g in range(self.num_groups):
      self.start_rollout(g)
    if self._eval_args is not None:  # last: the workers on the critical path spawn (and compile) first
      self._start_evaluator()

  def _start_evaluator(self) -> None:
    incarnation = self._incarnations.get('evaluator', -1) + 1
    self._incarnations['evaluator'] = incarnation
    self._start('evaluator', evaluator_lib.evaluator_main, self._eval_args + (incarnation,))

  def _read_inbox(self, trainer) -> None:
    """The trainer's messages: its summary, or the `RunError` it stopped on (raised here in its words)."""
    for message in self._inbox.poll():
      if message.kind == 'result':
        self.summary = message.payload
      elif message.kind == 'error':
        who = f'worker (pid {trainer.pid})' if self._use_processes else 'thread'  # --transport=thread: no pid
        errors.raise_report(message.payload, prefix=f'the trainer {who} stopped: ')

  def watch(self) -> None:
    """Returns when the trainer has finished; handles the other workers' deaths and a dead MPS daemon on the way."""
    while True:
      trainer = self.workers['trainer']
      if self._use_processes:
        waitables = [w.sentinel for w in self.workers.values()] + [self._inbox.waitable]
        multiprocessing.connection.wait(waitables, timeout=self.poll_s)
      else:  # not trainer.join: a KeyboardInterrupt (SIGTERM, Ctrl-C) inside Thread.join marks the running thread
        time.sleep(self.poll_s)  # stopped (CPython's bpo-45274 handling), and its summary would go unread
      self._read_inbox(trainer)
      # A worker that died may have died with the daemon: ask it then too, so the error names the cause.
      self._check_mps(force=not all(w.is_alive() for w in self.workers.values()))
      if not trainer.is_alive():
        self._read_inbox(trainer)
        code = getattr(trainer, 'exitcode', 0)
        if code not in (0, None):
          cause = f'the trainer worker (pid {trainer.pid}) died with exit code {code}{_said(self._last_error(trainer))}'
          raise errors.TrainerDied(f'{cause}; the run stopped. {storage.checkpoint_advice(self._cfg.schedule.run_dir)}',
                                   cause=cause)
        return
      for role, w in list(self.workers.items()):
        if role != 'trainer' and not w.is_alive() and not self.stop.is_set() and self.failure is None:
          self._on_worker_death(role, w)
      if self.tick is not None and not self.stop.is_set():
        self.tick()
      self._log_startup()

  def startup_phases(self) -> Optional[str]:
    """Until the trainer's first train step: one line of what each worker is doing (their phase reports) and
    for how long; None once start-up is over."""
    if self.first_step_seen or self.started_t is None:
      return None
    if self.trainer_feedback[feedback.ITERATIONS] >= 1:
      self.first_step_seen = True
      return None
    return (f'start-up {time.monotonic() - self.started_t:.0f} s, no train step yet: ' +
            lifecycle.describe_phases(self._cfg.schedule.run_dir))

  def _log_startup(self) -> None:
    if self.first_step_seen or time.monotonic() < self._next_startup_log:
      return
    self._next_startup_log = time.monotonic() + _STARTUP_LOG_S
    line = self.startup_phases()
    if line is not None:
      logging.info('%s', line)

  def _check_mps(self, force: bool) -> None:
    """Raises MpsDaemonDied when the run's MPS daemon no longer answers (asked at most once a second unless
    `force`d); the caller's `stop_all` then stops every worker, and the trainer's last checkpoint stays whole."""
    daemon = self._placement.mps if self._placement is not None else None
    if daemon is None or not daemon.active or (not force and time.monotonic() < self._next_mps_check):
      return
    self._next_mps_check = time.monotonic() + _MPS_CHECK_S
    if daemon.alive():
      return
    daemon.lost()
    logging.error('The MPS daemon serving pipe directory %s died (it no longer answers); stopping every worker.',
                  daemon.pipe_dir)
    raise errors.MpsDaemonDied(
        f'the MPS daemon (pipe directory {daemon.pipe_dir}) died mid-run; every worker was stopped. ' +
        storage.checkpoint_advice(self._cfg.schedule.run_dir, 'start MPS again (or run without --use_mps)'))

  def _on_worker_death(self, role: str, w) -> None:
    """Restarts worker `w` (not the trainer), or raises the `WorkerFailure` (`death_verdict`) that stops the run."""
    code, error, pid = getattr(w, 'exitcode', None), self._last_error(w), getattr(w, 'pid', None)
    deaths = self._role_restarts.get(role, 0) + 1
    self.failure = death_verdict(role, pid, code, error, self._cfg.schedule, deaths)
    if self.failure is not None:
      raise self.failure
    self._role_restarts[role] = deaths
    self.restarts += 1
    logging.warning('%s (pid %s) died with exit code %s%s; restarting it (restart %d).', role, pid, code, _said(error),
                    self.restarts)
    if role == 'generation':  # its groups re-send their outstanding requests to the new one
      self._start(role, generation_worker.generation_main, self._gen_args)
      return
    if role == 'evaluator':  # it takes the version in flight from the evaluation store again
      self._start_evaluator()
      return
    group = int(role.split('/')[1])  # the group's envs reset; its unfinished segment is lost, never half-sent
    # A new incarnation, after the iteration the dead one's delivery counted last (one it put but did not count is
    # collected again, and the trainer drops the repeat: it takes each block's iteration once).
    dead = self.controls.get(role)
    start = dead.feedback.snapshot().next_iteration() if dead is not None else 0
    self.start_rollout(group, quota=self.rollout_quota.get(role), start_iteration=start)

  def stop_all(self) -> None:
    """Sets the stop (a plain store: nothing can block it) and waits a bounded time for every worker; a process
    still running after _JOIN_S is terminated, then killed."""
    self.stop.set()
    deadline = time.monotonic() + _JOIN_S
    for w in self.workers.values():
      w.join(timeout=max(0.1, deadline - time.monotonic()))
    if self._use_processes:
      for w in self.workers.values():
        if w.is_alive():
          logging.warning('%s (pid %d) did not stop in %.0f s; terminating it.', w.name, w.pid, _JOIN_S)
          w.terminate()
          w.join(timeout=2.0)
        if w.is_alive():
          w.kill()
          w.join(timeout=2.0)
        if w.is_alive():  # in an uninterruptible wait (a driver call): the kernel ends it when that returns
          logging.error('%s (pid %d) survived SIGKILL for 2 s; leaving it to the kernel.', w.name, w.pid)
