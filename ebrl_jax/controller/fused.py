"""The `fused` schedule: one process, sequential. Collect a batch, train on it, evaluate now and then.

The correctness reference and the baseline for light workloads: the training driver (`trainer.driver`) around
one batch source per backend, `fused_mjx.MjxFusedLoop` (one jitted program per chunk of iterations, as Brax's PPO)
or `fused_cpu.CpuFusedLoop` (native MuJoCo stepped from a Python loop around jitted `act` and `train_step`). With
several cells (`controller.cells`) each process runs this schedule as one trainer rank on its own envs, and a
stop (SIGTERM, Ctrl-C, --max_wall_s) is that rank's vote, which every rank obeys at the same step (`trainer.ranks`).
"""
from __future__ import annotations

from typing import Optional

from ebrl_jax import config as config_lib
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import fused_cpu
from ebrl_jax.controller import topology
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import run_clock
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import ranks


def make_source(cfg: config_lib.Config,
                spec,
                network,
                optimizer,
                cell: Optional[cells_lib.Cell] = None,
                vote: Optional[ranks.StopVote] = None) -> driver.BatchSource:
  """The fused loop of `cfg`'s backend (it runs in the controller's process, so it sees the whole config); with
  `cell`, that cell's rank of the data-parallel loop (on MJX the chunk split at its train step: `fused_mjx`)."""
  if cfg.sim.backend == 'mujoco_cpu':
    return fused_cpu.CpuFusedLoop(cfg, spec, network, optimizer, cell, vote)
  from ebrl_jax.controller import fused_mjx  # lazy: brax and MJX (~2 s of imports) load only for an MJX run
  return fused_mjx.MjxFusedLoop(cfg, spec, network, optimizer, cell, vote)


def run(cfg: config_lib.Config,
        start: Optional[run_clock.StartClock] = None,
        cell: Optional[cells_lib.Cell] = None) -> driver.RunSummary:
  """Trains with the fused schedule until `num_timesteps` env steps, the target return, --max_wall_s or a
  signal (the summary's `stopped` says which). Returns the summary, its times on the clock `start`. On MJX one
  process runs its chunks as programs that call into the simulator (MJX-Warp's kernels call back into Python), so
  there a signal is held until the chunk ends (`errors.deferred_stops`): an exception raised inside such a
  callback aborts the process, losing the summary. On native MuJoCo it is held to the end of the running
  iteration (`fused_steps`): a stop at once would leave no whole state to save (the train step donates it). With
  a `cell` of several, an iteration is every cell's batch (its env steps count them all) and --resume reads rank
  0's run."""
  multi = cell is not None and cell.multi
  trainer = driver.trainer_config(cfg, topology.process_config(cfg), start=start)
  trainer = cells_lib.trainer_of_cell(trainer, cell or cells_lib.Cell(run_dir=cfg.schedule.run_dir),
                                      cfg.schedule.resume)
  vote = ranks.StopVote(cfg.schedule.max_wall_s, trainer.start.unix if trainer.start else None) if multi else None
  # a cell of several: SIGTERM and Ctrl-C are this rank's vote to stop; one cell: held, so the run stops where its
  # state is whole and saves it (MJX: at a chunk's end; native MuJoCo: after the running iteration, fused_steps)
  with cells_lib.signals_vote(vote), errors.deferred_stops(not multi):
    summary = driver.run_training(
        trainer, lambda _, spec, network, optimizer: make_source(cfg, spec, network, optimizer, cell, vote))
  summary.extra['topology'] = {'roles': ['controller'], 'num_groups': 1}  # one process collects and trains
  if multi:
    summary.extra['cells'] = cells_lib.summary_cells(cell, cfg.sim.num_envs, trainer.env_steps_per_iteration,
                                                     summary.extra)
  return summary
