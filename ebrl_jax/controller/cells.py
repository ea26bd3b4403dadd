"""Cells: one process per cell, each a trainer rank of the fused schedule with its own envs (on a GPU host, one
cell per GPU), joined by `jax.distributed` (`runtime.distributed`).

Every rank starts from the same train state (the run's init key, or rank 0's checkpoint: --run_dir is on a
filesystem every rank sees), simulates its own envs (`rollout.keys.cell_key`: cell 0 draws a one-cell run's
keys), and trains on the global batch (the sum of the cells' batches) through `trainer.parallel`, so every rank
holds the same parameters after every step. The ranks stay in lockstep: each evaluates the same parameters with
the same keys and envs, so each takes the same decisions (evaluation cadence, target, end). Rank 0 alone writes
the run's files in --run_dir (checkpoints of the global state, metrics, summary.json, whose env steps count every
cell's); rank k > 0 writes its own metrics, config.json and summary.json under --run_dir/rank<k>/ and no
checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import distributed


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
  spec = distributed.resolve(c.coordinator_address, c.num_processes, c.process_id, c.heartbeat_timeout_s)
  config_lib.check_run_cells(cfg, spec.num_processes)
  return spec


def join(cfg: config_lib.Config, spec: Optional[distributed.DistributedSpec] = None) -> Cell:
  """Joins the other cells' ranks (nothing to join for one cell). Call before JAX starts a backend."""
  spec = spec or resolve(cfg)
  if not spec.multi:
    return Cell(run_dir=cfg.schedule.run_dir)
  distributed.initialize(spec)
  import jax  # lazy: after initialize (the process's JAX backend starts with the ranks joined)
  return Cell(jax.process_index(), jax.process_count(), spec, cfg.schedule.run_dir)


def rank_run_dir(run_dir: str, rank: int) -> str:
  return run_dir if rank == 0 else os.path.join(run_dir, f'rank{rank}')


def rank_config(cfg: config_lib.Config, cell: Cell) -> config_lib.Config:
  """The config this rank runs: rank 0's is `cfg`; rank k's writes under --run_dir/rank<k>/ and no checkpoint."""
  if cell.rank == 0:
    return cfg
  schedule = dataclasses.replace(cfg.schedule,
                                 run_dir=rank_run_dir(cfg.schedule.run_dir, cell.rank),
                                 checkpoint_every=0,
                                 first_checkpoint_iteration=0)
  return dataclasses.replace(cfg, schedule=schedule)


def finish(cell: Cell) -> None:
  """All ranks at one barrier before any leaves, so that rank 0 (the coordination service) ends last."""
  if cell.multi:
    distributed.barrier('ebrl_jax/end', cell.spec.heartbeat_timeout_s * 3)
