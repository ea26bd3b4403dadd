"""The `fused` schedule: one process, sequential. Collect a batch, train on it, evaluate now and then.

The correctness reference and the baseline for light workloads: the training driver (`trainer.driver`) around
one batch source per backend, `fused_mjx.MjxFusedLoop` (one jitted program per chunk of iterations, as Brax's PPO)
or `fused_cpu.CpuFusedLoop` (native MuJoCo stepped from a Python loop around jitted `act` and `train_step`). With
several cells (`controller.cells`) each process runs this schedule as one trainer rank on its own envs.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ebrl_jax import config as config_lib
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import fused_cpu
from ebrl_jax.controller import topology
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver


def make_source(cfg: config_lib.Config,
                spec,
                network,
                optimizer,
                cell: Optional[cells_lib.Cell] = None) -> driver.BatchSource:
  """The fused loop of `cfg`'s backend (it runs in the controller's process, so it sees the whole config); with
  `cell`, that cell's rank of the data-parallel loop (native MuJoCo only: config_cells.check_run_cells)."""
  if cfg.sim.backend == 'mujoco_cpu':
    return fused_cpu.CpuFusedLoop(cfg, spec, network, optimizer, cell)
  from ebrl_jax.controller import fused_mjx  # lazy: brax and MJX (~2 s of imports) load only for an MJX run
  return fused_mjx.MjxFusedLoop(cfg, spec, network, optimizer)


def run(cfg: config_lib.Config,
        start: Optional[driver.StartClock] = None,
        cell: Optional[cells_lib.Cell] = None) -> driver.RunSummary:
  """Trains with the fused schedule until `num_timesteps` env steps, the target return, --max_wall_s or a
  signal (the summary's `stopped` says which). Returns the summary, its times on the clock `start`. On MJX the
  loop compiles one program per chunk length, so its chunks are never cut (`fixed_chunks`). With a `cell` of
  several, an iteration is every cell's batch (its env steps count them all) and --resume reads rank 0's run."""
  trainer = driver.trainer_config(cfg,
                                  topology.process_config(cfg),
                                  start=start,
                                  fixed_chunks=cfg.sim.backend != 'mujoco_cpu')
  if cell is not None and cell.multi:
    trainer = dataclasses.replace(trainer,
                                  env_steps_per_iteration=cell.count * trainer.env_steps_per_iteration,
                                  checkpoint_run_dir=cell.run_dir)
  if cfg.schedule.resume:
    trainer = _rebased(trainer, cell.run_dir if cell is not None else cfg.schedule.run_dir)
  summary = driver.run_training(trainer,
                                lambda _, spec, network, optimizer: make_source(cfg, spec, network, optimizer, cell))
  summary.extra['topology'] = {'roles': ['controller'], 'num_groups': 1}  # one process collects and trains
  if cell is not None and cell.multi:
    summary.extra['cells'] = {
        'count': cell.count,
        'rank': cell.rank,
        'envs_per_cell': cfg.sim.num_envs,
        'env_steps_per_iteration': trainer.env_steps_per_iteration,
        'params_chain':
            summary.extra.pop('params_chain', None)  # equal on every rank: the same parameters
    }
  return summary


def _rebased(trainer: driver.TrainerConfig, run_dir: str) -> driver.TrainerConfig:
  """--resume from a run whose iterations held another number of env steps (another number of cells): the
  driver plans iterations from 0 at this run's size, so --num_timesteps moves by the difference and still counts
  env steps (the checkpoint's, then this run's)."""
  directory = os.path.join(run_dir, 'checkpoints')
  intact = [s for s in checkpoint.committed_steps(directory) if checkpoint.damage(directory, s) is None]
  if not intact:
    return trainer
  extra = checkpoint.read_extra(directory, intact[0])
  shift = int(extra.get('iterations', 0)) * trainer.env_steps_per_iteration - int(extra.get('env_steps', 0))
  if not shift:
    return trainer
  schedule = dataclasses.replace(trainer.schedule, num_timesteps=max(1, trainer.schedule.num_timesteps + shift))
  return dataclasses.replace(trainer, schedule=schedule)
