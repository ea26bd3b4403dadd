"""Cells: one controller process per cell (on a GPU host, one cell per GPU), each cell one trainer rank with its
own envs, the trainer ranks joined by `jax.distributed` (`runtime.distributed`). Under `fused` the cell is that one
process; under `sync`/`async` it is that controller's run as on one GPU (`controller.pipeline`: the topology, the
planner, its own MPS daemon with its pipe directory under the cell's run directory, its own shared memory), whose
trainer worker is the rank (it joins; its rollout, generation and evaluator workers never do) and publishes the
all-reduced parameters to its own cell's workers only. One GPU is the cell of one (`Cell()`), not another path.

Every rank starts from the same train state (the run's init key, or rank 0's checkpoint: --run_dir is on a
filesystem every rank sees), simulates its own envs (`rollout.keys.cell_key`: cell 0 draws a one-cell run's
keys), and trains on the global batch (the sum of the cells' batches) through `trainer.parallel`, so every rank
holds the same parameters after every step. The ranks stay in lockstep: each evaluates the same parameters with
the same keys and envs, so each takes the same decisions (evaluation cadence, target, end). Rank 0 alone writes
the run's files in --run_dir (checkpoints of the global state, metrics, summary.json, whose env steps count every
cell's); rank k > 0 writes its own metrics, config.json and summary.json under --run_dir/rank<k>/ and no
checkpoint.

A stop (SIGTERM, Ctrl-C, --max_wall_s) is agreed by the ranks (`trainer.ranks`): each rank's wish rides on its
train step as a vote, and every rank stops after the step where one voted, so the run ends as a finished one does
(rank 0's checkpoint at that iteration, each rank's summary with `stopped`, the end barrier). In a `fused` cell
the signals become the vote here (`signals_vote`); a cell's trainer worker votes on its SIGINT (the controller's
request to stop).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

from ebrl_jax import config as config_lib
from ebrl_jax import config_checks
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import ranks


@dataclasses.dataclass(frozen=True)
class Cell:
  """This process's cell: its rank of `count`, the launch it joined, and the run's directory (rank 0's)."""
  rank: int = 0
  count: int = 1
  spec: distributed.DistributedSpec = distributed.DistributedSpec()
  run_dir: str = ''

  @property
  def multi(self) -> bool:
    return self.count > 1


def resolve(cfg: config_lib.Config) -> distributed.DistributedSpec:
  """The launch of `cfg` completed from the environment (JAX_*, SLURM); refuses what cells cannot run."""
  c = cfg.cells
  spec = distributed.resolve(c.coordinator_address,
                             c.num_processes,
                             c.process_id,
                             c.heartbeat_timeout_s,
                             init_timeout_s=c.init_timeout_s)
  config_lib.check_run_cells(cfg, spec.num_processes)
  return spec


def trainer_here(cfg: config_lib.Config) -> bool:
  """Whether this process trains (fused, or --transport=thread: the trainer is a thread), so it is the rank."""
  return cfg.schedule.name == 'fused' or cfg.schedule.transport != 'shm'


def join(cfg: config_lib.Config, spec: Optional[distributed.DistributedSpec] = None) -> Cell:
  """This process's cell. Where it trains itself (`trainer_here`) it joins the other ranks now, before JAX starts
  a backend; else its trainer worker joins them (`trainer.worker`), and the cell's rank is the launch's."""
  spec = spec or resolve(cfg)
  if not spec.multi:
    return Cell(run_dir=cfg.schedule.run_dir)
  if not trainer_here(cfg):
    return Cell(spec.process_id, spec.num_processes, spec, cfg.schedule.run_dir)
  distributed.initialize(spec)
  distributed.agree(spec, config_lib.agreed_flags(cfg.sim, cfg.policy, cfg.algo, cfg.schedule))
  import jax  # lazy: after initialize (the process's JAX backend starts with the ranks joined)
  return Cell(jax.process_index(), jax.process_count(), spec, cfg.schedule.run_dir)


def trainer_of_cell(trainer: driver.TrainerConfig, cell: Cell, resume: bool) -> driver.TrainerConfig:
  """The trainer's part for this cell: an iteration is every cell's batch, --resume reads rank 0's checkpoints,
  the ranks to join (`ranks`); with --resume, rebased on the checkpoint's iteration size (`rebased`); a
  --learning_rate_end decay of the whole run's length spans the iterations this trainer runs."""
  planned_for = (trainer.schedule, trainer.env_steps_per_iteration)
  if cell.multi:
    trainer = dataclasses.replace(trainer,
                                  env_steps_per_iteration=cell.count * trainer.env_steps_per_iteration,
                                  checkpoint_run_dir=cell.run_dir,
                                  ranks=cell.spec)
  if resume:
    trainer = rebased(trainer, cell.run_dir or trainer.process.run_dir)
  # --learning_rate_end's decay spans the iterations this trainer runs (Config filled it in for one cell's)
  algo = config_checks.decay_filled(trainer.algo, trainer.schedule, trainer.env_steps_per_iteration, planned_for)
  return dataclasses.replace(trainer, algo=algo)


def rebased(trainer: driver.TrainerConfig, run_dir: str) -> driver.TrainerConfig:
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


@contextlib.contextmanager
def signals_vote(vote: Optional[ranks.StopVote]):
  """While training a cell of several in this process (`vote`; None: nothing changes): SIGTERM and SIGINT are this
  rank's vote to stop (`ranks.StopVote.ask`); a second one interrupts at once (`errors.interrupt`: this rank alone
  stops, and the others find it gone). Main thread only."""
  with errors.held_signals(vote.ask if vote is not None else None, active=vote is not None):
    yield


def summary_cells(cell: Cell, envs_per_cell: int, env_steps_per_iteration: int, extra: dict) -> dict:
  """summary.extra['cells'] of a cell of several: its rank, the count, the global batch, the chain of its
  parameters after every step (`runtime.distributed.chain_digest`: equal on every rank), the all-reduce's and the
  train step's seconds and the agreed stop (`trainer.ranks.RankStep`), taken out of `extra`."""
  return {
      'count': cell.count,
      'rank': cell.rank,
      'envs_per_cell': envs_per_cell,
      'env_steps_per_iteration': env_steps_per_iteration,
      'params_chain': extra.pop('params_chain', None),
      **extra.pop('cell_step', {})
  }


def rank_config(cfg: config_lib.Config, cell: Cell) -> config_lib.Config:
  """The config this rank runs: rank 0's is `cfg`; rank k's writes under --run_dir/rank<k>/ and no checkpoint."""
  if cell.rank == 0:
    return cfg
  schedule = dataclasses.replace(cfg.schedule,
                                 run_dir=distributed.rank_run_dir(cfg.schedule.run_dir, cell.rank),
                                 checkpoint_every=0,
                                 first_checkpoint_iteration=0)
  return dataclasses.replace(cfg, schedule=schedule)


def finish(cell: Cell, summary: driver.RunSummary) -> None:
  """After a run that finished, or whose ranks stopped together (`ranks.stopped_together`): all ranks at one
  barrier before any leaves, so that rank 0 (the coordination service) ends last (where this process joined them;
  a trainer worker that joined waits there itself). A cell that stopped alone leaves at once (the others may be
  in an all-reduce)."""
  if summary.stopped not in driver.FINISHED and not ranks.stopped_together(summary.extra.get('cells', {})):
    return
  if cell.multi and distributed.joined():
    distributed.barrier('ebrl_jax/end', cell.spec.heartbeat_timeout_s * 3)
