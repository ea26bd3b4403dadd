"""The training driver every schedule shares: evaluation cadence, checkpoints, the target, metrics, the summary.
`train(cfg, make_source)` asks a `BatchSource` for training iterations and does everything around them: the fused
schedule's (`controller.fused_mjx.MjxFusedLoop`, one jitted program per chunk of iterations; `controller.fused_cpu.
CpuFusedLoop`, native MuJoCo from a Python loop) or the trainer worker's (`trainer.worker.ChannelSource`)."""
from __future__ import annotations

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
from ebrl_jax.runtime import metrics as metrics_lib
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.runtime import trace_cache
from ebrl_jax.trainer import cadence
from ebrl_jax.trainer import checkpoint as checkpoint_lib
from ebrl_jax.trainer import evaluations
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
  schedule's first iteration, counted as start-up) and `summary_extra() -> dict`."""

  def compile(self, train_state, num_iterations: int) -> float:
    """Compiles ahead of time; returns the seconds it took."""

  def run_iterations(self, train_state, num_iterations: int) -> Tuple[Any, Dict[str, float]]:
    """Collects and trains `num_iterations` iterations; returns the new state and the iterations' metrics. Every
    key comes from `rollout.keys` by the iteration index (`train_state.policy_version`), so sources agree."""

  def evaluate(self, params, key) -> Dict[str, float]:
    """Evaluation metrics (`eval/episode_return`, `eval/episode_length`) of `params`."""

  def close(self) -> None:
    """Frees what the source holds."""


@dataclasses.dataclass
class RunSummary:
  """What a run reports, finished or stopped; the controller writes it to `<run_dir>/summary.json`. Every time
  is on the run's clock (docs/benchmarks.md, Clocks): seconds since its first process started."""
  env_steps: int
  iterations: int
  wall_s: float  # process start -> the end of the run
  compile_s: float  # start-up: process start -> the first iteration counted in the rate (see compile_breakdown)
  train_wall_s: float  # wall time of collection + training, start-up and evaluation excluded
  env_steps_per_s: float  # env_steps / train_wall_s, this session's steps only
  final_eval_return: Optional[float]  # None: stopped before the first evaluation
  best_eval_return: Optional[float]
  target_return: Optional[float]
  env_steps_to_target: Optional[int]
  wall_s_to_target: Optional[float]  # process start -> the evaluation that reached the target
  train_s_to_target: Optional[float]  # collection + training time only
  eval_curve: list
  num_params: int
  schedule: str
  backend: str
  task: str
  device: str
  extra: dict  # schedule-specific figures (segments consumed, dropped, duplicates, worker restarts, ...)
  # Why the run ended: one of FINISHED, 'max_wall_s' or 'max_train_s' (the budgets), the signal ('SIGTERM', 'SIGINT'), DIVERGED (a
  # loss or return became NaN/inf), OUT_OF_MEMORY (an allocation XLA refused, here or in a worker) or
  # errors.WORKER_FAILED (a worker beside the trainer failed for good); for the failures extra['failure'] says what
  # happened, and the controller raises errors.Diverged, OutOfMemory or WorkerFailure.
  stopped: str = 'num_timesteps'
  compile_breakdown: Dict[str, float] = dataclasses.field(default_factory=dict)  # the parts of compile_s
  start_unix: Optional[float] = None  # the clock's origin, `time.time()` at process start


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
  eval_metrics = source.evaluate(train_state.params, keys.eval_key(root_key, progress.iterations))
  return evaluations.record(progress, logger, cfg.schedule.target_return, eval_metrics, progress.env_steps, clock.now(),
                            progress.train_wall, progress.iterations)


def _save(cfg, checkpointer, train_state, progress: cadence.Progress, spec) -> None:
  if checkpointer is None or not cfg.schedule.checkpoint_every or progress.iterations <= progress.last_saved:
    return
  critic = config_generation.critic_of(cfg.policy, bool(spec.pixel_shape))
  run = dict(task=cfg.sim.task, policy=cfg.policy.kind, obs_dim=spec.obs_dim, action_dim=spec.action_dim, critic=critic)
  checkpointer.save(progress.iterations, train_state, {
      'env_steps': progress.env_steps,
      'iterations': progress.iterations,
      'schedule': cfg.schedule.name,
      'run': run
  })
  progress.last_saved = progress.checkpoint = progress.iterations


def _account(progress: cadence.Progress, source, num: int, elapsed: float, per_iteration: int, logger, clock) -> int:
  """Counts `num` finished iterations that took `elapsed` s; a process schedule's first iteration is start-up
  (its seconds go into compile_s, its steps out of the rate; see `trainer.worker.ChannelSource.take_startup_s`).
  Returns (iterations counted in the rate, their seconds)."""
  progress.s_per_iteration = elapsed / max(num, 1)
  startup = source.take_startup_s() if hasattr(source, 'take_startup_s') else None
  counted = num
  if startup is not None:
    progress.startup_s = startup
    clock.mark('first_iteration', seconds=startup)
    progress.compile_s += startup
    elapsed -= startup
    counted -= 1
    logger.log(progress.env_steps, {'time/compile_s': progress.compile_s})
  progress.train_wall += elapsed
  progress.iterations += num
  progress.env_steps += num * per_iteration
  progress.steps_this_session += counted * per_iteration
  return counted, elapsed


def _train_chunk(source, train_state, num: int, per_iteration: int, progress: cadence.Progress, logger, eval_return,
                 clock: run_clock.RunClock):
  """`num` iterations from the source. A source stopped part-way (`errors.StopRequested`) has its finished
  iterations counted before the stop goes on up."""
  t0 = time.monotonic()
  try:
    train_state, train_metrics = source.run_iterations(train_state, num)
  except errors.StopRequested as stop:
    if stop.done:
      _account(progress, source, stop.done, time.monotonic() - t0, per_iteration, logger, clock)
      logger.log(progress.env_steps, stop.metrics or {})
    raise
  counted, seconds = _account(progress, source, num, time.monotonic() - t0, per_iteration, logger, clock)
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


def _summary(cfg, progress: cadence.Progress, clock: run_clock.RunClock, num_params: int, extra: dict, stopped: str,
             device: str) -> RunSummary:
  hit, curve = progress.target_hit, progress.eval_curve
  parts = {k: round(v, 3) for k, v in clock.parts.items()}
  compile_s = progress.compile_s if progress.compile_s is not None else clock.now()  # stopped during start-up
  return RunSummary(env_steps=progress.env_steps,
                    iterations=progress.iterations,
                    wall_s=clock.now(),
                    compile_s=compile_s,
                    train_wall_s=progress.train_wall,
                    env_steps_per_s=progress.steps_this_session / max(progress.train_wall, 1e-9),
                    final_eval_return=curve[-1]['return'] if curve else None,
                    best_eval_return=max(e['return'] for e in curve) if curve else None,
                    target_return=cfg.schedule.target_return,
                    env_steps_to_target=hit[0] if hit else None,
                    wall_s_to_target=hit[1] if hit else None,
                    train_s_to_target=hit[2] if hit else None,
                    eval_curve=curve,
                    num_params=num_params,
                    schedule=cfg.schedule.name,
                    backend=cfg.sim.backend,
                    task=cfg.sim.task,
                    device=device,
                    extra=extra,
                    stopped=stopped,
                    compile_breakdown=parts,
                    start_unix=clock.start_unix)


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
    off_path.submit(source, train_state.params, keys.eval_key(root_key, progress.iterations), progress)
  return eval_return


def _loop(cfg, source, train_state, root_key, progress: cadence.Progress, logger, clock, checkpointer, spec,
          off_path) -> str:
  """Evaluates, checkpoints and trains until the run is done; returns why it stopped (see RunSummary.stopped).
  With `off_path` (the 'evaluate' window; the evaluator process) evaluations run beside training, recorded in order.
  A budget's stop saves its checkpoint, then evaluates the iteration it stopped at (unless it was just evaluated),
  so the summary's final return is of the policy the run ends with; it ends one evaluation past the budget (with
  `off_path`, `train` waits for it as at a finished run's end)."""
  per_iteration, total, per_eval = cadence.iteration_plan(cfg.schedule, cfg.env_steps_per_iteration)
  first, eval_return = True, None
  while True:
    stop = _stop_due(cfg, progress, clock)
    if stop:
      why = f'--{stop}={getattr(cfg.schedule, stop):g} reached' if stop in BUDGETS else (
          'A stop signal came during the last chunk')
      logging.info('%s: stopping at iteration %d.', why, progress.iterations)
      _save(cfg, checkpointer, train_state, progress, spec)
      if stop in BUDGETS and progress.evaluated is not None and progress.evaluated < progress.iterations:
        _evaluate_or_submit(cfg, source, train_state, root_key, progress, logger, clock, off_path, False)
      return stop
    if first or progress.iterations % per_eval == 0 or progress.iterations >= total:
      in_line = off_path is None or (first and off_path.in_line_first)
      came = _evaluate_or_submit(cfg, source, train_state, root_key, progress, logger, clock, off_path, in_line)
      eval_return = eval_return if came is None else came
      if first:
        clock.mark('first_eval')
      every = cfg.schedule.checkpoint_every  # the cadence: every `every` evaluations, and at the run's end
      if every and (progress.eval_index % every == 0 or progress.iterations >= total or progress.target_hit):
        _save(cfg, checkpointer, train_state, progress, spec)
      progress.eval_index += 1
    first = False
    if progress.target_hit is not None:
      return 'target_return'
    if progress.iterations >= total:
      return 'num_timesteps'
    if progress.compile_s is None:  # start-up ends here (a process schedule's first iteration is added to it)
      clock.mark('other')
      progress.compile_s = sum(clock.parts.values())
      logger.log(progress.env_steps, {'time/compile_s': progress.compile_s})
    held_latency_s = errors.STOP_LATENCY_S if errors.stops_deferred() else None
    num = cadence.chunk_size(cfg.schedule, progress, per_eval, total, clock.now(), held_latency_s)
    train_state = _train_chunk(source, train_state, num, per_iteration, progress, logger, eval_return, clock)
    if progress.last_saved < cfg.schedule.first_checkpoint_iteration <= progress.iterations:  # a run stopped
      _save(cfg, checkpointer, train_state, progress, spec)  # early has a checkpoint to resume


def train(cfg: TrainerConfig, make_source, remote=None) -> RunSummary:
  """The training driver shared by every schedule: evaluation cadence, checkpoints, target, wall-clock budget,
  metrics; returns the summary, also of a run stopped by a signal or a stop request (`stopped` says which).
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
  except errors.StopRequested as stop:
    stopped = stop.reason
    if cfg.ranks is not None and stop.state is not None:  # the ranks stopped at one step: rank 0 saves it
      _save(cfg, checkpointer, stop.state, progress, spec)
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
  return _summary(cfg, progress, clock, num_params, extra, stopped, str(jax.devices()[0].device_kind))
