"""The `fused` schedule: one process, sequential. Collect a batch, train on it, evaluate now and then.

The correctness reference and the baseline for light workloads. The per-backend work lives in
`fused_mjx.MjxFusedLoop` (one jitted program per chunk of iterations, as Brax's PPO) and
`fused_cpu.CpuFusedLoop` (native MuJoCo stepped from a Python loop around jitted `act` and `train_step`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Optional

from absl import logging
import jax

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax import storage
from ebrl_jax.controller import metrics as metrics_lib
from ebrl_jax.controller import runner
from ebrl_jax.generation import policies
from ebrl_jax.trainer import checkpoint as checkpoint_lib
from ebrl_jax.trainer import stages as trainer_stages


@dataclasses.dataclass
class RunSummary:
  """What a finished run reports (also written to `<run_dir>/summary.json`)."""
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


def _make_loop(cfg: config_lib.Config, spec, network, optimizer):
  if cfg.sim.backend == 'mjx':
    from ebrl_jax.controller import fused_mjx  # pylint: disable=g-import-not-at-top
    return fused_mjx.MjxFusedLoop(cfg, spec, network, optimizer)
  from ebrl_jax.controller import fused_cpu  # pylint: disable=g-import-not-at-top
  return fused_cpu.CpuFusedLoop(cfg, spec, network, optimizer)


def _restore(cfg: config_lib.Config, checkpointer, train_state):
  """Returns (train_state, env_steps, iterations) from the run's last checkpoint, or fresh values."""
  if not cfg.schedule.resume:
    if checkpointer is not None and checkpointer.latest_step() is not None:
      raise ValueError(f'--run_dir={cfg.schedule.run_dir} already holds checkpoints; pass --resume to continue '
                       'that run or choose another --run_dir.')
    return train_state, 0, 0
  if checkpointer is None or checkpointer.latest_step() is None:
    raise ValueError(f'--resume was given but {cfg.schedule.run_dir}/checkpoints holds no checkpoint.')
  train_state, extra, _ = checkpointer.restore(train_state)
  logging.info('Resumed from env step %d (iteration %d) of a %s run.', extra['env_steps'], extra['iterations'],
               extra.get('schedule', '?'))
  if extra.get('schedule') not in (None, cfg.schedule.name):
    logging.warning('The checkpoint was written by --schedule=%s; continuing with --schedule=%s.',
                    extra['schedule'], cfg.schedule.name)
  return train_state, int(extra['env_steps']), int(extra['iterations'])


def run(cfg: config_lib.Config) -> RunSummary:
  """Trains with the fused schedule until `num_timesteps` env steps or the target return. Returns the summary."""
  return run_training(cfg, _make_loop)


def run_training(cfg: config_lib.Config, make_loop) -> RunSummary:
  """`train` (below), with a full disk turned into `runner.DiskFull`: which file found it full, and which
  checkpoint stays loadable for --resume (orbax commits a step only once it is whole)."""
  try:
    return train(cfg, make_loop)
  except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore wrap the OS error)
    reason = storage.disk_full(e)
    if reason is None:
      raise
    run_dir = os.path.abspath(cfg.schedule.run_dir)
    raise runner.DiskFull(f'the disk holding {run_dir} is full ({reason}); the run stopped. '
                          + storage.resume_advice(run_dir)) from e


def train(cfg: config_lib.Config, make_loop) -> RunSummary:
  """The training driver shared by every schedule: evaluation cadence, checkpoints, target, metrics, summary.

  `make_loop(cfg, spec, network, optimizer)` returns the object that produces training iterations:
  `compile(state, n) -> seconds`, `run_iterations(state, n, key) -> (state, metrics)`,
  `evaluate(params, key) -> metrics`, `close()`, and optionally `summary_extra() -> dict`.
  """
  start = time.monotonic()
  run_dir = cfg.schedule.run_dir
  os.makedirs(run_dir, exist_ok=True)
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  key = jax.random.PRNGKey(cfg.schedule.seed)
  init_key, loop_key = jax.random.split(key)
  train_state = trainer_stages.init_train_state(network, optimizer, init_key, spec.obs_dim,
                                                cfg.policy.normalize_observations)
  num_params = policies.count_params(train_state.params.network)
  checkpointer = None
  if cfg.schedule.checkpoint_every:
    checkpointer = checkpoint_lib.Checkpointer(os.path.join(os.path.abspath(run_dir), 'checkpoints'))
  train_state, env_steps, iterations = _restore(cfg, checkpointer, train_state)
  with open(os.path.join(run_dir, 'config.json'), 'w') as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)

  per_iteration = cfg.env_steps_per_iteration
  total_iterations = max(1, math.ceil(cfg.schedule.num_timesteps / per_iteration))
  iterations_per_eval = max(1, math.ceil(total_iterations / max(1, cfg.schedule.num_evals)))
  # Whole chunks only: a shorter last chunk would be a second program to compile (MJX) mid-run.
  total_iterations = math.ceil(total_iterations / iterations_per_eval) * iterations_per_eval
  logging.info('%s/%s: %s, %d params, %d env steps per iteration, %d iterations (%d per evaluation).',
               cfg.schedule.name, cfg.sim.backend, cfg.sim.task, num_params, per_iteration, total_iterations,
               iterations_per_eval)

  loop = make_loop(cfg, spec, network, optimizer)
  logger = metrics_lib.MetricsLogger(run_dir, total_iterations * per_iteration, cfg.schedule.progress_bar,
                                     initial_env_steps=env_steps)
  eval_curve, target_hit = [], None
  last_saved = iterations  # a resumed run's starting point is already on disk
  train_wall, steps_this_session, compile_s = 0.0, 0, 0.0
  startup_s = None  # a process schedule's first iteration, moved into compile_s
  try:
    compile_s = loop.compile(train_state, iterations_per_eval)
    logger.log(env_steps, {'time/compile_s': compile_s})
    eval_index = 0
    while True:
      eval_key = jax.random.fold_in(loop_key, 2 * iterations + 1)
      eval_metrics = loop.evaluate(train_state.params, eval_key)
      eval_return = eval_metrics['eval/episode_return']
      eval_curve.append({'env_steps': env_steps, 'wall_s': round(time.monotonic() - start, 3),
                         'train_s': round(train_wall, 3), 'return': eval_return, 'unix': round(time.time(), 3)})
      logger.log(env_steps, eval_metrics)
      if (cfg.schedule.target_return is not None and target_hit is None
          and eval_return >= cfg.schedule.target_return):
        target_hit = (env_steps, time.monotonic() - start, train_wall)
      if (checkpointer is not None and iterations > last_saved
          and (eval_index % cfg.schedule.checkpoint_every == 0 or iterations >= total_iterations
               or target_hit is not None)):
        checkpointer.save(iterations, train_state, {'env_steps': env_steps, 'iterations': iterations,
                                                    'schedule': cfg.schedule.name})
        last_saved = iterations
      eval_index += 1
      if iterations >= total_iterations or target_hit is not None:
        break
      num = min(iterations_per_eval, total_iterations - iterations)
      t0 = time.monotonic()
      train_state, train_metrics = loop.run_iterations(train_state, num, jax.random.fold_in(loop_key, 2 * iterations))
      elapsed = time.monotonic() - t0
      startup = loop.take_startup_s() if hasattr(loop, 'take_startup_s') else None
      counted = num
      if startup is not None:  # a process schedule's first iteration is start-up (see PipelineLoop)
        startup_s = startup
        compile_s += startup
        elapsed -= startup
        counted -= 1
        logger.log(env_steps, {'time/compile_s': compile_s})
      train_wall += elapsed
      iterations += num
      env_steps += num * per_iteration
      steps_this_session += counted * per_iteration
      train_metrics['rollout/env_steps_per_s'] = counted * per_iteration / max(elapsed, 1e-9)
      logger.log(env_steps, train_metrics)
      logger.advance(env_steps, {'return': eval_return, 'steps/s': train_metrics['rollout/env_steps_per_s']})
  finally:
    loop_extra = loop.summary_extra() if hasattr(loop, 'summary_extra') else {}
    if startup_s is not None:  # kept so a rate with the first iteration counted in can be recomputed
      loop_extra['startup_s'] = startup_s
    try:
      logger.close()  # its last flush fails on a full disk: the loop and the checkpointer still close
    finally:
      try:
        loop.close()
      finally:
        if checkpointer is not None:
          checkpointer.close()

  summary = RunSummary(
      env_steps=env_steps, iterations=iterations, wall_s=time.monotonic() - start, compile_s=compile_s,
      train_wall_s=train_wall, env_steps_per_s=steps_this_session / max(train_wall, 1e-9),
      final_eval_return=eval_curve[-1]['return'], best_eval_return=max(e['return'] for e in eval_curve),
      target_return=cfg.schedule.target_return,
      env_steps_to_target=target_hit[0] if target_hit else None,
      wall_s_to_target=target_hit[1] if target_hit else None,
      train_s_to_target=target_hit[2] if target_hit else None,
      eval_curve=eval_curve, num_params=num_params, schedule=cfg.schedule.name, backend=cfg.sim.backend,
      task=cfg.sim.task, device=str(jax.devices()[0].device_kind),
      extra=loop_extra)
  with open(os.path.join(run_dir, 'summary.json'), 'w') as f:
    json.dump(dataclasses.asdict(summary), f, indent=2)
  logging.info('Finished: %d env steps, final eval return %.1f, %.0f env steps/s, compile %.1f s.',
               summary.env_steps, summary.final_eval_return, summary.env_steps_per_s, summary.compile_s)
  return summary
