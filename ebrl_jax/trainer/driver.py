"""The training driver every schedule shares: evaluation cadence, checkpoints, the target, metrics, the summary.

`train(cfg, make_source)` asks a `BatchSource` for training iterations and does everything around them. The
sources: the fused schedule's (`controller.fused_mjx.MjxFusedLoop`: one jitted program per chunk of iterations;
`controller.fused_cpu.CpuFusedLoop`: native MuJoCo from a Python loop), and the trainer worker's
(`trainer.worker.ChannelSource`: iterations from segments that rollout workers send).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Dict, Optional, Protocol, Tuple

from absl import logging
import jax

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax.generation import policies
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import metrics as metrics_lib
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.trainer import checkpoint as checkpoint_lib
from ebrl_jax.trainer import stages as trainer_stages


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The trainer's part of the run (in the trainer worker, or in the fused schedule's one process): the task,
  the policy, the algorithm and the schedule's cadence, plus what the topology derives for it."""
  process: startup.ProcessConfig
  sim: config_lib.SimConfig
  policy: config_lib.PolicyConfig
  algo: config_lib.AlgoConfig
  schedule: config_lib.ScheduleConfig
  env_steps_per_iteration: int


def trainer_config(cfg: config_lib.Config, process: startup.ProcessConfig) -> TrainerConfig:
  return TrainerConfig(process=process,
                       sim=cfg.sim,
                       policy=cfg.policy,
                       algo=cfg.algo,
                       schedule=cfg.schedule,
                       env_steps_per_iteration=cfg.env_steps_per_iteration)


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
  """What a finished run reports; the controller writes it to `<run_dir>/summary.json`."""
  env_steps: int
  iterations: int
  wall_s: float
  compile_s: float
  train_wall_s: float  # wall time of collection + training, compile and evaluation excluded
  env_steps_per_s: float  # env_steps / train_wall_s, this session's steps only
  final_eval_return: float
  best_eval_return: float
  target_return: Optional[float]
  env_steps_to_target: Optional[int]
  wall_s_to_target: Optional[float]  # wall time since start, compile included
  train_s_to_target: Optional[float]  # collection + training time only
  eval_curve: list
  num_params: int
  schedule: str
  backend: str
  task: str
  device: str
  extra: dict  # schedule-specific figures (segments consumed, dropped, duplicates, worker restarts, ...)


def _restore(cfg: TrainerConfig, checkpointer, train_state):
  """Returns (train_state, env_steps, iterations) from the run's last checkpoint, or fresh values."""
  if not cfg.schedule.resume:
    if checkpointer is not None and checkpointer.latest_step() is not None:
      raise ValueError(f'--run_dir={cfg.process.run_dir} already holds checkpoints; pass --resume to continue '
                       'that run or choose another --run_dir.')
    return train_state, 0, 0
  if checkpointer is None or checkpointer.latest_step() is None:
    raise ValueError(f'--resume was given but {cfg.process.run_dir}/checkpoints holds no checkpoint.')
  train_state, extra, _ = checkpointer.restore(train_state)
  logging.info('Resumed from env step %d (iteration %d) of a %s run.', extra['env_steps'], extra['iterations'],
               extra.get('schedule', '?'))
  if extra.get('schedule') not in (None, cfg.schedule.name):
    logging.warning('The checkpoint was written by --schedule=%s; continuing with --schedule=%s.', extra['schedule'],
                    cfg.schedule.name)
  return train_state, int(extra['env_steps']), int(extra['iterations'])


def run_training(cfg: TrainerConfig, make_source) -> RunSummary:
  """`train` (below), with a full disk turned into `errors.DiskFull`: which file found it full, and which
  checkpoint stays loadable for --resume (orbax commits a step only once it is whole)."""
  try:
    return train(cfg, make_source)
  except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore wrap the OS error)
    reason = storage.disk_full(e)
    if reason is None:
      raise
    run_dir = os.path.abspath(cfg.process.run_dir)
    raise errors.DiskFull(f'the disk holding {run_dir} is full ({reason}); the run stopped. ' +
                          storage.resume_advice(run_dir)) from e


@dataclasses.dataclass
class _Progress:
  """What the driver counts as the run goes on (mutable: one instance per run)."""
  env_steps: int
  iterations: int
  last_saved: int  # the iteration of the newest checkpoint (a resumed run's starting point is on disk)
  train_wall: float = 0.0  # seconds of collection + training, start-up excluded
  steps_this_session: int = 0  # env steps counted in the end-to-end rate
  compile_s: float = 0.0
  startup_s: Optional[float] = None  # a process schedule's first iteration, moved into compile_s
  eval_index: int = 0
  target_hit: Optional[Tuple[int, float, float]] = None  # (env steps, wall s, train s) when the target was hit
  eval_curve: list = dataclasses.field(default_factory=list)


def _iteration_plan(cfg: TrainerConfig) -> Tuple[int, int, int]:
  """(env steps per iteration, total iterations, iterations per evaluation): whole chunks only, since a shorter
  last chunk would be a second program to compile (MJX) mid-run."""
  per_iteration = cfg.env_steps_per_iteration
  total = max(1, math.ceil(cfg.schedule.num_timesteps / per_iteration))
  per_eval = max(1, math.ceil(total / max(1, cfg.schedule.num_evals)))
  return per_iteration, math.ceil(total / per_eval) * per_eval, per_eval


def _evaluate(cfg, source, train_state, root_key, progress: _Progress, logger, start: float) -> float:
  eval_metrics = source.evaluate(train_state.params, keys.eval_key(root_key, progress.iterations))
  eval_return = eval_metrics['eval/episode_return']
  progress.eval_curve.append({
      'env_steps': progress.env_steps,
      'wall_s': round(time.monotonic() - start, 3),
      'train_s': round(progress.train_wall, 3),
      'return': eval_return,
      'unix': round(time.time(), 3)
  })
  logger.log(progress.env_steps, eval_metrics)
  target = cfg.schedule.target_return
  if target is not None and progress.target_hit is None and eval_return >= target:
    progress.target_hit = (progress.env_steps, time.monotonic() - start, progress.train_wall)
  return eval_return


def _maybe_checkpoint(cfg, checkpointer, train_state, progress: _Progress, total_iterations: int) -> None:
  if checkpointer is None or progress.iterations <= progress.last_saved:
    return
  if (progress.eval_index % cfg.schedule.checkpoint_every == 0 or progress.iterations >= total_iterations or
      progress.target_hit is not None):
    checkpointer.save(progress.iterations, train_state, {
        'env_steps': progress.env_steps,
        'iterations': progress.iterations,
        'schedule': cfg.schedule.name
    })
    progress.last_saved = progress.iterations


def _train_chunk(source, train_state, num: int, per_iteration: int, progress: _Progress, logger, eval_return):
  """`num` iterations from the source; a process schedule's first iteration is start-up (moved into compile_s
  and left out of the rate, see `trainer.worker.ChannelSource.take_startup_s`)."""
  t0 = time.monotonic()
  train_state, train_metrics = source.run_iterations(train_state, num)
  elapsed = time.monotonic() - t0
  startup = source.take_startup_s() if hasattr(source, 'take_startup_s') else None
  counted = num
  if startup is not None:
    progress.startup_s = startup
    progress.compile_s += startup
    elapsed -= startup
    counted -= 1
    logger.log(progress.env_steps, {'time/compile_s': progress.compile_s})
  progress.train_wall += elapsed
  progress.iterations += num
  progress.env_steps += num * per_iteration
  progress.steps_this_session += counted * per_iteration
  train_metrics['rollout/env_steps_per_s'] = counted * per_iteration / max(elapsed, 1e-9)
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


def _summary(cfg, progress: _Progress, start: float, num_params: int, extra: dict) -> RunSummary:
  hit = progress.target_hit
  curve = progress.eval_curve
  return RunSummary(env_steps=progress.env_steps,
                    iterations=progress.iterations,
                    wall_s=time.monotonic() - start,
                    compile_s=progress.compile_s,
                    train_wall_s=progress.train_wall,
                    env_steps_per_s=progress.steps_this_session / max(progress.train_wall, 1e-9),
                    final_eval_return=curve[-1]['return'],
                    best_eval_return=max(e['return'] for e in curve),
                    target_return=cfg.schedule.target_return,
                    env_steps_to_target=hit[0] if hit else None,
                    wall_s_to_target=hit[1] if hit else None,
                    train_s_to_target=hit[2] if hit else None,
                    eval_curve=curve,
                    num_params=num_params,
                    schedule=cfg.schedule.name,
                    backend=cfg.sim.backend,
                    task=cfg.sim.task,
                    device=str(jax.devices()[0].device_kind),
                    extra=extra)


def train(cfg: TrainerConfig, make_source) -> RunSummary:
  """The training driver shared by every schedule: evaluation cadence, checkpoints, target, metrics; returns the
  summary. `make_source(cfg, spec, network, optimizer)` returns the `BatchSource` (`cfg` is the `TrainerConfig`)."""
  start = time.monotonic()
  run_dir = cfg.process.run_dir
  os.makedirs(run_dir, exist_ok=True)
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  root_key = keys.root(cfg.schedule.seed)
  train_state = trainer_stages.init_train_state(network, optimizer, keys.init_key(root_key), spec.obs_dim,
                                                cfg.policy.normalize_observations)
  num_params = policies.count_params(train_state.params.network)
  checkpointer = None
  if cfg.schedule.checkpoint_every:
    checkpointer = checkpoint_lib.Checkpointer(os.path.join(os.path.abspath(run_dir), 'checkpoints'))
  train_state, env_steps, iterations = _restore(cfg, checkpointer, train_state)
  per_iteration, total_iterations, per_eval = _iteration_plan(cfg)
  logging.info('%s/%s: %s, %d params, %d env steps per iteration, %d iterations (%d per evaluation).',
               cfg.schedule.name, cfg.sim.backend, cfg.sim.task, num_params, per_iteration, total_iterations, per_eval)
  source = make_source(cfg, spec, network, optimizer)
  logger = metrics_lib.MetricsLogger(run_dir,
                                     total_iterations * per_iteration,
                                     cfg.schedule.progress_bar,
                                     initial_env_steps=env_steps)
  progress = _Progress(env_steps=env_steps, iterations=iterations, last_saved=iterations)
  try:
    progress.compile_s = source.compile(train_state, per_eval)
    logger.log(env_steps, {'time/compile_s': progress.compile_s})
    while True:
      eval_return = _evaluate(cfg, source, train_state, root_key, progress, logger, start)
      _maybe_checkpoint(cfg, checkpointer, train_state, progress, total_iterations)
      progress.eval_index += 1
      if progress.iterations >= total_iterations or progress.target_hit is not None:
        break
      num = min(per_eval, total_iterations - progress.iterations)
      train_state = _train_chunk(source, train_state, num, per_iteration, progress, logger, eval_return)
  finally:
    extra = source.summary_extra() if hasattr(source, 'summary_extra') else {}
    if progress.startup_s is not None:  # kept so a rate with the first iteration counted in can be recomputed
      extra['startup_s'] = progress.startup_s
    _close(source, logger, checkpointer)
  return _summary(cfg, progress, start, num_params, extra)
