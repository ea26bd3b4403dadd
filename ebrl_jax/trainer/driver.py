"""The training driver every schedule shares: evaluation cadence, checkpoints, the target, metrics, the summary.
`train(cfg, make_source)` asks a `BatchSource` for training iterations and does everything around them: the fused
schedule's (`controller.fused_mjx.MjxFusedLoop`, one jitted program per chunk of iterations; `controller.fused_cpu.
CpuFusedLoop`, native MuJoCo from a Python loop) or the trainer worker's (`trainer.worker.ChannelSource`)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Dict, Optional, Protocol, Tuple

from absl import logging
import jax

from ebrl_jax import config as config_lib
from ebrl_jax import config_generation
from ebrl_jax import sim
from ebrl_jax.generation import policies
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import hooks
from ebrl_jax.runtime import metrics as metrics_lib
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.runtime import trace_cache
from ebrl_jax.trainer import cadence
from ebrl_jax.trainer import checkpoint as checkpoint_lib
from ebrl_jax.trainer import evaluations
from ebrl_jax.trainer import run_summary
from ebrl_jax.trainer import stages as trainer_stages


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The trainer's part of the run (in the trainer worker, or in the fused schedule's one process): the task,
  the policy, the algorithm and the schedule's cadence, plus what the topology derives for it. `start` is the
  run's clock (None: the driver's figures count from its own compile, as for a driver run on its own)."""
  process: startup.ProcessConfig
  sim: config_lib.SimConfig
  policy: config_lib.PolicyConfig
  algo: config_lib.AlgoConfig
  schedule: config_lib.ScheduleConfig
  env_steps_per_iteration: int
  start: Optional[run_clock.StartClock] = None
  windows: Tuple[str, ...] = ()  # overlap windows it runs: 'h2d', 'evaluate', 'checkpoint' (iteration_graph.py)
  checkpoint_run_dir: str = ''  # whose checkpoints --resume reads ('': process.run_dir; a cell: rank 0's)
  ranks: Any = None  # a cell of several: the runtime.distributed.DistributedSpec its trainer rank joins


def trainer_config(cfg: config_lib.Config,
                   process: startup.ProcessConfig,
                   start: Optional[run_clock.StartClock] = None) -> TrainerConfig:
  return TrainerConfig(process, cfg.sim, cfg.policy, cfg.algo, cfg.schedule, cfg.env_steps_per_iteration,
                       start)  # the fields in order


def network_and_optimizer(sim_cfg: config_lib.SimConfig, policy: config_lib.PolicyConfig, algo: config_lib.AlgoConfig):
  """(env spec, network, optimizer) of a run: what its train state is made from."""
  spec = sim.spec_of(sim_cfg)
  network = policies.make_network(policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  return spec, network, trainer_stages.make_optimizer(algo)


class BatchSource(Protocol):
  """What produces training iterations for `train`. Optional: `take_startup_s() -> Optional[float]` (a process
  schedule's first iteration, counted as start-up), `summary_extra() -> dict` and `stops_each_iteration = True` (it
  checks a held signal after every iteration itself, so its chunks need not fit `errors.STOP_LATENCY_S`)."""

  def compile(self, train_state, num_iterations: int) -> float:
    """Compiles ahead of time; returns the seconds it took."""

  def run_iterations(self, train_state, num_iterations: int) -> Tuple[Any, Dict[str, float]]:
    """Collects and trains `num_iterations` iterations; returns the new state and the iterations' metrics. Every
    key comes from `rollout.keys` by the iteration index (`train_state.policy_version`), so sources agree."""

  def evaluate(self, params, key) -> Dict[str, float]:
    """Evaluation metrics (`eval/episode_return`, `eval/episode_length`) of `params`."""

  def close(self) -> None:
    """Frees what the source holds."""


RunSummary = run_summary.RunSummary  # what a run reports (its fields: trainer/run_summary.py)
FINISHED = ('num_timesteps', 'target_return')
BUDGETS = ('max_wall_s', 'max_train_s')  # a stop at the budget: checkpoint, then the final policy's evaluation
DIVERGED, OUT_OF_MEMORY = errors.DIVERGED, errors.OUT_OF_MEMORY


def run_training(cfg: TrainerConfig, make_source, remote=None) -> RunSummary:
  """`train` (below), a full disk turned into `errors.DiskFull` (the file, the checkpoint --resume can load)."""
  try:
    return train(cfg, make_source, remote)
  except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore wrap the OS error)
    reason = storage.disk_full(e)
    if reason is None:
      raise
    run_dir = os.path.abspath(cfg.process.run_dir)
    raise errors.DiskFull(f'the disk holding {run_dir} is full ({reason}); the run stopped. ' +
                          storage.resume_advice(run_dir)) from e


def _evaluate(cfg, source, train_state, root_key, progress: cadence.Progress, logger,
              clock: run_clock.RunClock) -> float:
  reached_s = clock.now()  # in line: training waits for this evaluation, which counts against its pace
  eval_metrics = source.evaluate(train_state.params, keys.eval_key(root_key, progress.iterations))
  return evaluations.record(progress,
                            logger,
                            cfg.schedule.target_return,
                            eval_metrics,
                            progress.env_steps,
                            clock.now(),
                            progress.train_wall,
                            progress.iterations,
                            reached_s=reached_s)


class _DiskFullNoise(logging.logging.Filter):
  """Drops what orbax's writer threads and asyncio (its tasks' unretrieved errors) log, a traceback each, of a
  write that found the disk full."""

  def filter(self, record) -> bool:
    if '/orbax/' not in record.pathname and '/asyncio/' not in record.pathname:
      return True
    exc = record.exc_info[1] if record.exc_info else None
    return storage.disk_full(exc) is None and storage.disk_full(RuntimeError(record.getMessage())) is None


def _loop_closed_unsaid(previous):
  """`sys.unraisablehook` without tensorstore's late callbacks into the event loop orbax closed after a failed
  write (`RuntimeError: Event loop is closed`, a traceback each)."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == 'Event loop is closed'):
      previous(unraisable)

  return hook


@contextlib.contextmanager
def _disk_full_said_once():
  """Around a checkpoint's save: a full disk is said once, by the driver (a stop's warning) or the run's
  `errors.DiskFull` line, without the tracebacks orbax, asyncio and tensorstore print beside it. After a save
  the full disk failed, both filters stay: their late reports come until the process ends."""
  quiet = _DiskFullNoise()
  loggers = (logging.get_absl_logger(), logging.logging.getLogger('asyncio'))  # where the records are made
  for logger in loggers:
    logger.addFilter(quiet)
  keep = False
  try:
    with hooks.unraisable_hook_within(_loop_closed_unsaid) as hook:
      try:
        yield
      except Exception as e:
        keep = storage.disk_full(e) is not None
        if keep:
          hook.keep()
        raise
  finally:
    if not keep:
      for logger in loggers:
        logger.removeFilter(quiet)


def _saved_already(cfg, checkpointer, progress: cadence.Progress) -> bool:
  """Whether there is nothing to save: no checkpoints in this run, or the iteration reached is saved."""
  return checkpointer is None or not cfg.schedule.checkpoint_every or progress.iterations <= progress.last_saved


def _save(cfg, checkpointer, train_state, progress: cadence.Progress, spec) -> None:
  if _saved_already(cfg, checkpointer, progress):
    return
  critic = config_generation.critic_of(cfg.policy, bool(spec.pixel_shape))
  run = dict(task=cfg.sim.task, policy=cfg.policy.kind, obs_dim=spec.obs_dim, action_dim=spec.action_dim, critic=critic)
  run.update(algo=cfg.algo.name, normalize_observations=cfg.policy.normalize_observations)  # no layout shows these
  with _disk_full_said_once():
    checkpointer.save(progress.iterations, train_state, {
        'env_steps': progress.env_steps,
        'iterations': progress.iterations,
        'schedule': cfg.schedule.name,
        'run': run
    })
  progress.last_saved = progress.checkpoint = progress.iterations


def _is_state_of(state, iterations: int) -> bool:
  """Whether `state` is whole (no array of it donated to a train step since) and the state after `iterations`
  iterations (its policy version counts the train steps)."""
  if state is None or any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(state)):
    return False
  return int(jax.device_get(state.policy_version)) == iterations


def _save_at_stop(cfg, checkpointer, state, progress: cadence.Progress, spec) -> None:
  """The checkpoint of a requested stop (a signal, the controller's stop request) at the last iteration counted,
  of `state` where it is that iteration's whole state; a state a stop caught mid-update is not saved (the newest
  checkpoint stays). Best effort: a write that fails (a full disk) is one warning and the stop goes on to its
  summary, whose `extra.last_checkpoint` names the checkpoint there is."""
  if _saved_already(cfg, checkpointer, progress):
    return
  advice = storage.checkpoint_advice(os.path.abspath(cfg.checkpoint_run_dir or cfg.process.run_dir))
  if not _is_state_of(state, progress.iterations):
    logging.warning('stopping at iteration %d without its checkpoint (no whole state of it to save). %s',
                    progress.iterations, advice)
    return
  try:
    _save(cfg, checkpointer, state, progress, spec)
  except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore wrap the OS error)
    full, said = storage.disk_full(e), (str(e).splitlines() or [''])[0][:300]
    why = f'the disk is full: {full}' if full else f'{type(e).__name__}: {said}'
    logging.warning('stopping at iteration %d without its checkpoint: the save failed (%s). %s', progress.iterations,
                    why, advice)


def _train_chunk(source, train_state, num: int, per_iteration: int, progress: cadence.Progress, logger, eval_return,
                 clock: run_clock.RunClock):
  """`num` iterations from the source. A source stopped part-way (`errors.StopRequested`) has its finished
  iterations counted before the stop goes on up."""
  t0 = time.monotonic()
  try:
    train_state, train_metrics = source.run_iterations(train_state, num)
  except errors.StopRequested as stop:
    if stop.done:
      cadence.account(progress, source, stop.done, time.monotonic() - t0, per_iteration, logger, clock)
      logger.log(progress.env_steps, stop.metrics or {})
    raise
  counted, seconds = cadence.account(progress, source, num, time.monotonic() - t0, per_iteration, logger, clock)
  train_metrics['rollout/env_steps_per_s'] = counted * per_iteration / max(seconds, 1e-9)
  logger.log(progress.env_steps, train_metrics)
  logger.advance(progress.env_steps, {'return': eval_return, 'steps/s': train_metrics['rollout/env_steps_per_s']})
  return train_state


def _close(source, logger, checkpointer) -> None:
  try:
    logger.close()  # its last flush fails on a full disk: the source and the checkpointer still close
  finally:
    try:
      source.close()
    finally:
      if checkpointer is not None:
        checkpointer.close()


def _stop_due(cfg, progress: cadence.Progress, clock: run_clock.RunClock) -> str:
  """The signal held while the last chunk ran (`errors.deferred_stops`), else the budget that is spent, else ''."""
  held = errors.pending_stop()
  if held or cfg.ranks is not None:  # a cell's ranks vote on --max_wall_s (trainer.ranks); cells refuse --max_train_s
    return held
  if cfg.schedule.max_wall_s and clock.now() >= cfg.schedule.max_wall_s:
    return 'max_wall_s'
  if cfg.schedule.max_train_s and progress.train_wall >= cfg.schedule.max_train_s:
    return 'max_train_s'
  return ''


def _evaluate_or_submit(cfg, source, train_state, root_key, progress: cadence.Progress, logger, clock, off_path,
                        in_line: bool):
  """The evaluation of the iteration reached: in line (returns its return), or asked of `off_path` (returns the
  newest return that came in meanwhile; None: none)."""
  progress.evaluated = progress.iterations
  if off_path is None or in_line:
    return _evaluate(cfg, source, train_state, root_key, progress, logger, clock)
  eval_return = off_path.poll(progress, logger, clock.now)
  if progress.target_hit is None:
    off_path.submit(source, train_state.params, keys.eval_key(root_key, progress.iterations), progress, clock.now())
  return eval_return


def _evaluate_the_stop(cfg, source, train_state, root_key, progress: cadence.Progress, logger, clock, off_path):
  """A budget's stop: the policy it stopped at is evaluated, unless that iteration just was."""
  if progress.evaluated is not None and progress.evaluated < progress.iterations:
    _evaluate_or_submit(cfg, source, train_state, root_key, progress, logger, clock, off_path, False)


def _loop(cfg, source, train_state, root_key, progress: cadence.Progress, logger, clock, checkpointer, spec,
          off_path) -> str:
  """Evaluates, checkpoints and trains until the run is done; returns why it stopped (see RunSummary.stopped).
  With `off_path` (the 'evaluate' window; the evaluator process) evaluations run beside training, recorded in order.
  A budget's stop saves its checkpoint, then evaluates the iteration it stopped at (unless it was just evaluated),
  so the summary's final return is of the policy the run ends with; it ends one evaluation past the budget (with
  `off_path`, `train` waits for it as at a finished run's end)."""
  per_iteration, total, per_eval = cadence.iteration_plan(cfg.schedule, cfg.env_steps_per_iteration)
  first, eval_return = True, None
  try:
    while True:
      stop = _stop_due(cfg, progress, clock)
      if stop:
        why = f'--{stop}={getattr(cfg.schedule, stop):g} reached' if stop in BUDGETS else (
            'A stop signal came during the last chunk')
        logging.info('%s: stopping at iteration %d.', why, progress.iterations)
        if stop not in BUDGETS:
          _save_at_stop(cfg, checkpointer, train_state, progress, spec)
          return stop
        _save(cfg, checkpointer, train_state, progress, spec)
        _evaluate_the_stop(cfg, source, train_state, root_key, progress, logger, clock, off_path)
        return stop
      if first or progress.iterations % per_eval == 0 or progress.iterations >= total:
        in_line = off_path is None or (first and off_path.in_line_first)
        came = _evaluate_or_submit(cfg, source, train_state, root_key, progress, logger, clock, off_path, in_line)
        eval_return = eval_return if came is None else came
        if first:
          clock.mark('first_eval')
        every = cfg.schedule.checkpoint_every  # every `every` evaluation intervals, and at the run's end
        if every and cadence.checkpoint_due(progress, per_eval, every, total):
          _save(cfg, checkpointer, train_state, progress, spec)
      first = False
      if progress.target_hit is not None:
        return 'target_return'
      if progress.iterations >= total:
        return 'num_timesteps'
      if progress.compile_s is None:  # start-up ends here (a process schedule's first iteration is added to it)
        clock.mark('other')
        progress.compile_s = sum(clock.parts.values())
        logger.log(progress.env_steps, {'time/compile_s': progress.compile_s})
      held = errors.stops_deferred() and not getattr(source, 'stops_each_iteration', False)
      held_latency_s = errors.STOP_LATENCY_S if held else None
      num = cadence.chunk_size(cfg.schedule, progress, per_eval, total, clock.now(), held_latency_s)
      train_state = _train_chunk(source, train_state, num, per_iteration, progress, logger, eval_return, clock)
      if progress.last_saved < cfg.schedule.first_checkpoint_iteration <= progress.iterations:  # a run stopped
        _save(cfg, checkpointer, train_state, progress, spec)  # early has a checkpoint to resume
  except errors.StopRequested as stop:  # the source saw a stop (a signal, the controller's): save where it stopped
    state = train_state if stop.state is None else stop.state
    _save_at_stop(cfg, checkpointer, state, progress, spec)
    if stop.reason in BUDGETS:
      # cells' ranks agreed on their budget (trainer.ranks); every rank evaluates the same parameters with the
      # same keys, so they stay in lockstep
      _evaluate_the_stop(cfg, source, state, root_key, progress, logger, clock, off_path)
    raise


def train(cfg: TrainerConfig, make_source, remote=None) -> RunSummary:
  """The training driver shared by every schedule: evaluation cadence, checkpoints, target, wall-clock budget,
  metrics; returns the summary, also of a run stopped by a signal or a stop request (`stopped` says which), whose
  checkpoint is of the iteration it stopped at (`_save_at_stop`; a KeyboardInterrupt, a second signal, saves none).
  `make_source(cfg, spec, network, optimizer)` returns the `BatchSource` (`cfg`: the `TrainerConfig`); `remote`: a
  `trainer.remote_eval.RemoteEvaluations`, the evaluator process evaluating instead of the source."""
  clock = run_clock.RunClock(cfg.start or run_clock.StartClock(time.time()))
  clock.mark('driver_start')  # a spawned trainer: its process start and imports
  os.makedirs(run_dir := cfg.process.run_dir, exist_ok=True)
  spec, network, optimizer = network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  root_key = keys.root(cfg.schedule.seed)
  init = trainer_stages.init_fn(network, optimizer, spec.obs_dim, cfg.policy.normalize_observations, spec.pixel_shape,
                                cfg.algo.value_norm_rate is not None)
  train_state = trace_cache.jit(cfg.process.trace_cache_dir, 'init_train_state', init,
                                (cfg.sim, cfg.policy, cfg.algo))(keys.init_key(root_key))
  num_params = policies.count_params(train_state.params.network)
  clock.mark('state_init')
  checkpointer, train_state, resumed = checkpoint_lib.open_and_resume(cfg.checkpoint_run_dir or run_dir,
                                                                      cfg.schedule,
                                                                      train_state,
                                                                      async_save='checkpoint' in cfg.windows)
  env_steps, iterations = (resumed['env_steps'], resumed['iterations']) if resumed else (0, 0)
  clock.mark('restore')
  per_iteration, total_iterations, per_eval = cadence.iteration_plan(cfg.schedule, cfg.env_steps_per_iteration)
  logging.info('%s/%s: %s, %d params, %d env steps per iteration, %d iterations (%d per evaluation).',
               cfg.schedule.name, cfg.sim.backend, cfg.sim.task, num_params, per_iteration, total_iterations, per_eval)
  source = make_source(cfg, spec, network, optimizer)
  logger = metrics_lib.MetricsLogger(run_dir,
                                     total_iterations * per_iteration,
                                     cfg.schedule.progress_bar,
                                     initial_env_steps=env_steps,
                                     clock=lambda: clock.now())  # late-bound: the clock the summary keeps
  clock.mark('env_build')
  progress = cadence.Progress(env_steps, iterations, iterations, resumed['step'] if resumed else None)
  stopped = 'start-up'
  off_path = remote or (evaluations.OffPath(cfg.schedule.target_return) if 'evaluate' in cfg.windows else None)
  try:
    if cfg.start is None:  # a driver run on its own: its figures count from its compile
      clock = run_clock.RunClock(run_clock.StartClock(time.time()))
    clock.mark('compile', seconds=source.compile(train_state, per_eval))
    stopped = _loop(cfg, source, train_state, root_key, progress, logger, clock, checkpointer, spec, off_path)
    if off_path is not None and stopped in FINISHED + BUDGETS:  # the final version's evaluation (bounded wait)
      off_path.finish(progress, logger, clock.now)
  except errors.StopRequested as stop:  # its checkpoint is saved (`_loop`); a cell's ranks stopped at one step
    stopped = stop.reason
  except KeyboardInterrupt as interrupt:  # SIGINT, or SIGTERM turned into one (runtime/errors.interrupt)
    stopped = errors.stop_reason(interrupt)
  except metrics_lib.NonFiniteMetricError as e:  # the state is garbage now: the summary, and no checkpoint of it
    stopped, progress.failure = DIVERGED, str(e)
  except Exception as e:  # pylint: disable=broad-except  (XLA reports a failed allocation as a runtime error)
    refused = errors.out_of_memory(e)
    if refused is None:
      raise
    stopped, progress.failure = OUT_OF_MEMORY, refused
  finally:
    if off_path is not None:  # a run stopped part-way: the evaluations asked for before the stop still count
      off_path.close(progress, logger, clock.now, quiet=(errors.StopRequested, KeyboardInterrupt))
    extra = source.summary_extra() if hasattr(source, 'summary_extra') else {}
    extra.update(off_path.summary_extra() if off_path is not None else {})
    if progress.startup_s is not None:  # kept so a rate with the first iteration counted in can be recomputed
      extra['startup_s'] = progress.startup_s
    extra['last_checkpoint'] = progress.checkpoint
    if progress.failure:
      extra['failure'] = progress.failure
    if resumed is not None:
      extra['resumed_from'] = resumed
    _close(source, logger, checkpointer)
  return run_summary.make(cfg, progress, clock, num_params, extra, stopped, str(jax.devices()[0].device_kind))
