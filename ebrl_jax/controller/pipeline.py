"""The process schedules, `sync` and `async`: one trainer worker and one rollout worker per env group.

The controller builds the transport (a segment channel and a versioned parameter store), starts the workers as
processes (`--transport=shm`, spawned, each with its own JAX client and environment) or threads
(`--transport=thread`), watches them, restarts a dead rollout worker (`--worker_fault=restart`) or stops
cleanly, and on exit — normal, error, Ctrl-C or SIGTERM — stops every child and unlinks every shared-memory
segment. `sync` is the staleness bound 0 (a barrier each iteration); `async` lets each group run up to
`--max_staleness` versions ahead of the trainer, with the decoupled PPO correction. With `--quota_schedule` or
`--replan`, the watch loop also changes the rollout workers' SM quota during the run by warm-standby swaps
(controller/replan.py; the trainer and the number of groups stay as they are, a swapped group's envs reset).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from absl import logging
import jax

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax import storage
from ebrl_jax import transport
from ebrl_jax import types
from ebrl_jax.transport import feedback
from ebrl_jax.transport import lifecycle
from ebrl_jax.controller import fused
from ebrl_jax.controller import replan
from ebrl_jax.controller import runner
from ebrl_jax.generation import policies
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import cpus
from ebrl_jax.resources import memory
from ebrl_jax.resources import mps
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.sim import worker as sim_worker
from ebrl_jax.trainer import stages as trainer_stages
from ebrl_jax.trainer import worker as trainer_worker

_JOIN_S = 10.0
_MPS_CHECK_S = 1.0  # the watch loop asks the MPS daemon whether it is alive at most this often
_STARTUP_LOG_S = 30.0  # until the first train step, the watch loop says what each worker is doing this often


class WorkerFailure(runner.RunError):
  """A worker died and the run could not go on; the message names the worker and its exit code."""


class MpsDaemonDied(runner.RunError):
  """The run's MPS daemon stopped answering; every worker was stopped. The message says how to resume."""


def _segment_spec(cfg: config_lib.Config, spec: types.EnvSpec) -> transport.RecordSpec:
  unrolls, steps = cfg.segment_shape
  s = unrolls * (cfg.sim.num_envs // cfg.schedule.num_groups)
  t, k, o, a = steps, cfg.policy.action_chunk, spec.obs_dim, spec.action_dim
  shapes = {'obs': (t, s, o), 'raw_action': (t, s, k, a), 'reward': (t, s), 'termination': (t, s),
            'truncation': (t, s), 'next_obs': (t, s, o), 'behaviour_log_prob': (t, s), 'mask': (t, s),
            'policy_version': (t, s), 'group': (1,), 'iteration': (1,), 'incarnation': (1,),
            'episode_stats': (3,)}
  return transport.record_spec(types.SegmentRecord, shapes,
                               dtypes={'policy_version': 'int32', 'group': 'int32', 'iteration': 'int32',
                                       'incarnation': 'int32'})


def _mailbox_specs(cfg: config_lib.Config, spec: types.EnvSpec):
  """Request and reply specs of one env slice (the whole group without `--env_slices`)."""
  b, k, o, a = cfg.slice_envs, cfg.policy.action_chunk, spec.obs_dim, spec.action_dim
  ints = {'group': 'int32', 'env_slice': 'int32', 'seq': 'int32'}
  request = transport.record_spec(types.ActRequest, {'group': (), 'env_slice': (), 'seq': (), 'min_version': (),
                                                     'obs': (b, o)},
                                  dtypes={**ints, 'min_version': 'int32'})
  reply = transport.record_spec(types.ActReply, {'group': (), 'env_slice': (), 'seq': (), 'version': (),
                                                 'actions': (b, k, a), 'raw_actions': (b, k, a), 'log_probs': (b,)},
                                dtypes={**ints, 'version': 'int32'})
  return request, reply


def _param_template(cfg: config_lib.Config, spec: types.EnvSpec):
  """Shapes of the policy parameters, without computing them (the controller touches no accelerator)."""
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  state = jax.eval_shape(lambda: trainer_stages.init_train_state(
      network, optimizer, jax.random.PRNGKey(0), spec.obs_dim, cfg.policy.normalize_observations))
  return state.params


def _on_gpu(cfg: config_lib.Config, role: str) -> bool:
  """Whether `role`'s process holds a GPU context (and so gets a memory budget and an SM quota)."""
  return not (cfg.rollout_on_host and role.startswith('rollout/'))


def _gpu_roles(cfg: config_lib.Config, roles):
  return [r for r in roles if _on_gpu(cfg, r)]


def _planned_roles(cfg: config_lib.Config):
  """The processes the memory plan budgets: every GPU role, and with live quota changes a warm standby per group
  (it runs beside the worker it replaces; resources/memory.py)."""
  cpu_roles, feeders = _roles(cfg)
  roles = _gpu_roles(cfg, feeders + cpu_roles)
  if (cfg.resources.quota_schedule or cfg.resources.replan) and _on_gpu(cfg, 'rollout/0'):
    roles += [f'standby/{g}' for g in range(cfg.schedule.num_groups)]
  return roles


def _roles(cfg: config_lib.Config):
  """(CPU-simulating roles, GPU-feeder roles) of the topology."""
  rollouts = [f'rollout/{g}' for g in range(cfg.schedule.num_groups)]
  feeders = ['trainer'] + ([] if cfg.schedule.colocate_generation else ['generation'])
  if cfg.sim.backend == 'mjx':
    return [], feeders + rollouts
  return rollouts, feeders


class _Placement:
  """Per-worker environment: memory budget, MPS pipe and SM quota, CPU cores."""

  def __init__(self, cfg: config_lib.Config, mps_daemon: Optional[mps.MpsDaemon], memory_plan: memory.MemoryPlan):
    self._cfg, self.mps, self.memory = cfg, mps_daemon, memory_plan
    cpu_roles, feeders = _roles(cfg)
    self._cpu_roles = set(cpu_roles)
    self.cores = (cpus.plan_cores(cpus.available_cores(), cpu_roles, feeders)
                  if cfg.resources.pin_cpus else {})

  def env(self, role: str) -> Dict[str, str]:
    if not _on_gpu(self._cfg, role):  # simulates on CPU cores; generation acts for it: no GPU context
      env = {'EBRL_ROLE': role, 'JAX_PLATFORMS': 'cpu'}
    else:
      env = {'EBRL_ROLE': role, **self.memory.worker_env(role, mps_active=self.mps is not None)}
      if self.mps is not None:
        env.update(self.mps.worker_env(self._cfg.resources.quotas.get(role.split('/')[0])))
    if role in self.cores:
      # CPU simulators are pinned at once; GPU feeders compile on every core first (resources.pin_after_startup).
      key = 'EBRL_CPUS' if role in self._cpu_roles else 'EBRL_CPUS_AFTER_STARTUP'
      env[key] = cpus.encode(self.cores[role])
    return env


class _Workers:
  """Starts, watches and stops the workers; records their pids in `<run_dir>/workers.json`."""

  def __init__(self, cfg: config_lib.Config, seg_channel, store, use_processes: bool, mailbox=None,
               placement: Optional[_Placement] = None):
    self._cfg, self._use_processes = cfg, use_processes
    self._placement = placement
    self._ctx = multiprocessing.get_context('spawn') if use_processes else None
    self.stop = self._ctx.Event() if use_processes else threading.Event()
    self.use_processes = use_processes
    self.trainer_feedback = feedback.Feedback(use_processes)  # read by controller/replan.py
    self.controls: Dict[str, feedback.WorkerControl] = {}  # rollout role -> its feedback and events
    self.control_history: List[Tuple[str, feedback.WorkerControl]] = []  # every rollout worker that delivered
    self.tick = None  # called by `watch` every `poll_s` when set (the live quota changes)
    self.poll_s = 0.5
    self._incarnations: Dict[str, int] = {}
    self._trainer_ch = trainer_worker.TrainerChannels(seg_channel, store, self.stop, self.trainer_feedback)
    self._rollout_ch = sim_worker.RolloutChannels(seg_channel, store, self.stop, mailbox)
    self._gen_args = (cfg, mailbox, store, self.stop)
    self.workers: Dict[str, Any] = {}
    self.restarts = 0
    self._role_restarts: Dict[str, int] = {}
    self._next_mps_check = 0.0
    self.rollout_quota: Dict[str, int] = {}  # role -> quota set by a live change (else the config's)
    self.started_t: Optional[float] = None  # when start_all ran
    self.first_step_seen = False  # the trainer's first train step is done: start-up is over
    self._next_startup_log = 0.0

  def _start(self, role: str, target, args, env: Optional[Dict[str, str]] = None, register: bool = True,
             **kwargs):
    # Threads share one process: only processes get their own environment and cores.
    if env is None and self._use_processes and self._placement:
      env = self._placement.env(role)
    kwargs['env'] = env if self._use_processes else None
    if self._use_processes:
      worker = self._ctx.Process(target=target, args=args, kwargs=kwargs, name=role, daemon=True)
    else:
      worker = threading.Thread(target=target, args=args, kwargs=kwargs, name=role, daemon=True)
    worker.start()
    if register:
      self.workers[role] = worker
      self._write_pids()
    return worker

  def start_rollout(self, group: int, quota: Optional[int] = None, standby: bool = False):
    """Starts group `group`'s rollout worker as the role's next incarnation, at SM quota `quota` (None: the
    config's). A warm standby (`standby`) is not registered: it waits on its control's `go` (controller/replan.py
    swaps it in). Returns (worker, control)."""
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
    worker = self._start(role, sim_worker.rollout_main, (self._cfg, group, self._rollout_ch, incarnation),
                         env=env, register=not standby, control=control)
    if not standby:
      self.controls[role] = control
      self.control_history.append((role, control))
    return worker, control

  def swap_in(self, role: str, worker, control) -> None:
    """Makes a started standby the role's worker (the old one, retiring, is no longer watched)."""
    self.workers[role], self.controls[role] = worker, control
    self.control_history.append((role, control))
    self._write_pids()

  def _write_pids(self) -> None:
    if not self._use_processes:
      return
    pids = {role: w.pid for role, w in self.workers.items()}
    path = os.path.join(self._cfg.schedule.run_dir, 'workers.json')
    try:  # for telemetry and for the user; a full disk must not stop the controller here (the trainer says it)
      storage.write_json(path, {'controller': os.getpid(), 'workers': pids, 'restarts': self.restarts})
    except OSError as e:
      logging.warning('could not write %s: %s', path, e)

  def start_all(self) -> None:
    self.started_t = time.monotonic()
    self._next_startup_log = self.started_t + _STARTUP_LOG_S
    self._start('trainer', trainer_worker.trainer_main, (self._cfg, self._trainer_ch))
    if self._rollout_ch.mailbox is not None:
      self._start('generation', generation_worker.generation_main, self._gen_args)
    for g in range(self._cfg.schedule.num_groups):
      self.start_rollout(g)

  def watch(self) -> None:
    """Returns when the trainer has finished; handles rollout-worker deaths and a dead MPS daemon on the way."""
    while True:
      trainer = self.workers['trainer']
      if self._use_processes:
        multiprocessing.connection.wait([w.sentinel for w in self.workers.values()], timeout=self.poll_s)
      else:
        trainer.join(timeout=self.poll_s)
      # A worker that died may have died with the daemon: ask it then too, so the error names the cause.
      self._check_mps(force=not all(w.is_alive() for w in self.workers.values()))
      if not trainer.is_alive():
        code = getattr(trainer, 'exitcode', 0)
        if code == runner.DISK_FULL_EXIT:
          run_dir = os.path.abspath(self._cfg.schedule.run_dir)
          raise runner.DiskFull(f'the trainer worker (pid {trainer.pid}) stopped: the disk holding {run_dir} is '
                                'full (its error above says which write failed). ' + storage.resume_advice(run_dir))
        if code not in (0, None):
          raise WorkerFailure(f'the trainer worker (pid {trainer.pid}) died with exit code {code}; the run '
                              f'stopped. Its last checkpoint in {self._cfg.schedule.run_dir}/checkpoints stays '
                              'loadable: continue with --resume.')
        return
      for role, w in list(self.workers.items()):
        if role != 'trainer' and not w.is_alive() and not self.stop.is_set():
          self._on_rollout_death(role, w)
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
    return (f'start-up {time.monotonic() - self.started_t:.0f} s, no train step yet: '
            + lifecycle.describe_phases(self._cfg.schedule.run_dir))

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
    raise MpsDaemonDied(f'the MPS daemon (pipe directory {daemon.pipe_dir}) died mid-run; every worker was '
                        f'stopped. The last checkpoint in {self._cfg.schedule.run_dir}/checkpoints stays loadable: '
                        'start MPS again (or run without --use_mps) and continue with --resume.')

  def _on_rollout_death(self, role: str, w) -> None:
    code = getattr(w, 'exitcode', None)
    if self._cfg.schedule.worker_fault != 'restart':
      raise WorkerFailure(f'{role} (pid {getattr(w, "pid", None)}) died with exit code {code}; stopping '
                          '(--worker_fault=stop).')
    self._role_restarts[role] = self._role_restarts.get(role, 0) + 1
    if self._role_restarts[role] > self._cfg.schedule.max_restarts:
      raise WorkerFailure(f'{role} died {self._role_restarts[role]} times (last exit code {code}), more than '
                          f'--max_restarts={self._cfg.schedule.max_restarts}; stopping. The last checkpoint in '
                          f'{self._cfg.schedule.run_dir}/checkpoints stays loadable.')
    self.restarts += 1
    logging.warning('%s (pid %s) died with exit code %s; restarting it (restart %d).',
                    role, getattr(w, 'pid', None), code, self.restarts)
    if role == 'generation':  # its groups re-send their outstanding requests to the new one
      self._start(role, generation_worker.generation_main, self._gen_args)
      return
    group = int(role.split('/')[1])  # the group's envs reset; its unfinished segment is lost, never half-sent
    # A new incarnation: its iteration numbers may repeat the dead one's, its records stay distinct.
    self.start_rollout(group, quota=self.rollout_quota.get(role))

  def stop_all(self) -> None:
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


@contextlib.contextmanager
def _sigterm_as_interrupt():
  """SIGTERM stops the run like Ctrl-C does (main thread only; elsewhere the handler is left alone)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    del signum, frame
    raise KeyboardInterrupt('SIGTERM')

  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _calibration_env(mps_daemon: Optional[mps.MpsDaemon], quota: int) -> Dict[str, str]:
  """A calibration process runs alone: most of the memory, and its quota under the run's MPS daemon."""
  env = {'EBRL_ROLE': f'calibrate/q{quota}', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.850'}
  if mps_daemon is not None:
    env.update(mps_daemon.worker_env(quota))
  return env


def rollout_figures(cfg: config_lib.Config, history) -> dict:
  """Rollout throughput (BENCHMARKS.md): env steps per second while collecting, from what each rollout worker
  reported (segments delivered, seconds inside collect). Groups collect at the same time, so the run's figure is
  the sum of the groups' rates; a group served by several workers in turn (restarts, quota swaps) pools them."""
  per_segment = cfg.env_steps_per_iteration // cfg.schedule.num_groups
  groups: Dict[str, List[float]] = {}
  for role, control in history:
    snap = control.feedback.snapshot()
    acc = groups.setdefault(role, [0.0, 0.0])
    acc[0] += snap.iterations
    acc[1] += snap.stage_s
  rates = {role: n * per_segment / t for role, (n, t) in sorted(groups.items()) if n and t > 0}
  return {'env_steps_per_s': sum(rates.values()) if rates else None, 'group_env_steps_per_s': rates,
          'segments': int(sum(n for n, _ in groups.values())), 'collect_s': {r: t for r, (_, t) in groups.items()}}


def _generation_stats_files(cfg: config_lib.Config):
  return sorted(glob.glob(os.path.join(cfg.schedule.run_dir, generation_worker.STATS_PREFIX + '*.json')))


def run(cfg: config_lib.Config) -> fused.RunSummary:
  """Runs `sync` or `async` and returns the trainer's summary (plus worker restarts)."""
  os.makedirs(cfg.schedule.run_dir, exist_ok=True)
  summary_path = os.path.join(cfg.schedule.run_dir, 'summary.json')
  if os.path.exists(summary_path):
    os.remove(summary_path)
  for path in _generation_stats_files(cfg):  # a reused run directory: count this run's batches only
    os.remove(path)
  shutil.rmtree(os.path.join(cfg.schedule.run_dir, lifecycle.PHASES_DIR), ignore_errors=True)  # and its phases
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  memory_plan = memory.plan_for_run(cfg, spec, _planned_roles(cfg))  # no fit: stops here
  memory_plan.log()
  use_processes = cfg.schedule.transport == 'shm'
  registry: Optional[transport.ShmRegistry] = transport.ShmRegistry() if use_processes else None
  workers, plan_record, changer = None, None, None
  mps_daemon = mps.MpsDaemon(cfg.schedule.run_dir) if cfg.resources.use_mps and use_processes else None
  try:
    if mps_daemon is not None and not mps_daemon.start():
      mps_daemon = None
    if cfg.resources.plan:  # groups and quotas from stage profiles (calibrated first if there are none)
      cfg, plan_record = autoplan.plan_run(cfg, mps_daemon is not None,
                                           functools.partial(_calibration_env, mps_daemon))
      # the chosen number of groups: budgets again, still before any worker
      memory_plan = memory.plan_for_run(cfg, spec, _planned_roles(cfg))
      memory_plan.log()
    placement = _Placement(cfg, mps_daemon, memory_plan)
    capacity = cfg.schedule.num_groups * (cfg.schedule.staleness_bound + 1)
    seg_channel = transport.make_channel(cfg.schedule.transport, _segment_spec(cfg, spec), capacity, registry)
    store = transport.make_param_store(cfg.schedule.transport, _param_template(cfg, spec), registry)
    mailbox = None
    if not cfg.schedule.colocate_generation:
      request_spec, reply_spec = _mailbox_specs(cfg, spec)
      mailbox = transport.make_mailbox(cfg.schedule.transport, request_spec, reply_spec, cfg.schedule.num_groups,
                                       registry=registry, num_slices=cfg.schedule.env_slices,
                                       slice_field='env_slice')
    workers = _Workers(cfg, seg_channel, store, use_processes, mailbox, placement)
    changer = replan.make_changer(cfg, workers, plan_record, mps_daemon is not None)
    workers.tick = changer.poll if changer is not None else None
    with _sigterm_as_interrupt():
      workers.start_all()
      workers.watch()
  finally:
    if workers is not None:
      line = workers.startup_phases()  # a run stopped or failed before its first train step: where it waited
      if line is not None:
        logging.warning('stopped during %s', line)
      workers.stop_all()
    if changer is not None:
      changer.close()
    if registry is not None:
      registry.close()
    if mps_daemon is not None:
      mps_daemon.stop()
  if not os.path.exists(summary_path):
    raise WorkerFailure(f'the trainer ended without writing {summary_path}; see its log above.')
  with open(summary_path) as f:
    summary = fused.RunSummary(**json.load(f))
  summary.extra['worker_restarts'] = workers.restarts  # written to summary.json by the runner
  summary.extra['rollout'] = rollout_figures(cfg, workers.control_history)
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
  if changer is not None:
    summary.extra['replan'] = changer.record()
  generation = generation_worker.merge_stats(_generation_stats_files(cfg))
  if generation is not None:
    summary.extra['generation'] = generation
    logging.info('generation worker: %d batches; slices per batch %s; batches per bucket %s; %.1f%% padding.',
                 generation['batches'], generation['requests_per_batch'], generation['batches_per_bucket'],
                 100.0 * generation['padded_rows'] / max(1, generation['rows'] + generation['padded_rows']))
  return summary
