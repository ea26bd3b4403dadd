"""`CellConfig`: how many cells a run has and how they find each other. A cell is one trainer rank with its own
envs (one per GPU on a GPU host; for sync/async also that GPU's rollout and generation workers); the ranks join
through `jax.distributed` (`runtime/distributed.py`). Part of `ebrl_jax.config` (re-exported there)."""
from __future__ import annotations

import dataclasses

from ebrl_jax.config_checks import check_choice as _check_choice
from ebrl_jax.config_checks import check_positive as _check_positive

# '': this process is one cell (of --num_processes, else of JAX_NUM_PROCESSES / SLURM's tasks, else the only one);
# 'local': this process starts --num_processes cells of itself on this host and watches them; 'ray': it places them
# over a Ray cluster's nodes, one host agent per node starting that node's cells (runtime/ray_launch.py).
LAUNCHERS = ('', 'local', 'ray')


@dataclasses.dataclass(frozen=True)
class CellConfig:
  """The cells' launch: `launcher`, the rank count (0: from the environment, else 1), rank 0's coordinator
  'host:port' and this process's rank (-1: from the environment), the seconds of silence after which the
  coordination service declares a rank dead, and the seconds a rank waits for the others to join."""
  launcher: str = ''
  num_processes: int = 0
  coordinator_address: str = ''
  process_id: int = -1
  heartbeat_timeout_s: int = 10
  init_timeout_s: int = 120  # JAX's own default (300 s) holds a rank deaf to SIGTERM that long

  def __post_init__(self):
    _check_choice('launcher', self.launcher, LAUNCHERS)
    _check_positive('num_processes', self.num_processes, allow_zero=True)
    _check_positive('heartbeat_timeout_s', self.heartbeat_timeout_s)
    _check_positive('init_timeout_s', self.init_timeout_s)
    if self.process_id < -1:
      raise ValueError(f'--process_id={self.process_id} must be a rank (>= 0), or -1 to take it from the environment.')
    if self.launcher and (self.coordinator_address or self.process_id >= 0):
      raise ValueError(f'--launcher={self.launcher} chooses each cell\'s --coordinator_address and --process_id '
                       'itself; drop them (or start the cells yourself without --launcher).')
    if self.launcher and self.num_processes < 1:
      where = 'on this host' if self.launcher == 'local' else 'over the Ray cluster'
      raise ValueError(f'--launcher={self.launcher} needs --num_processes=N: the number of cells to start {where}.')


def check_run_cells(cfg, num_cells: int) -> None:
  """What a run of `num_cells` > 1 cells needs (its flags, or the count found in the environment at start)."""
  if num_cells <= 1:
    return
  what = f'{num_cells} cells (--num_processes={num_cells}, or JAX_NUM_PROCESSES / SLURM)'
  name = cfg.schedule.name
  if name not in ('fused', 'sync', 'async'):
    raise ValueError(f'{what} run --schedule=fused, sync or async (a cell is one trainer rank with its own envs and, '
                     f'for sync/async, its own rollout workers); got --schedule={name}.')
  if cfg.schedule.max_train_s:
    raise ValueError(f'{what} cannot stop at --max_train_s yet (each rank counts its own training seconds; the '
                     '--max_wall_s budget is voted on): drop it.')
  if name == 'fused':
    return
  if cfg.schedule.relaid:
    raise ValueError(f'{what} cannot change their env groups during the run (--group_schedule, --replan_groups) yet; '
                     'drop it.')
  if cfg.schedule.evaluator == 'process' and cfg.schedule.target_return is not None:
    raise ValueError(f'{what} with --target_return need --evaluator=trainer: an evaluator process answers each '
                     'cell at its own time, so the ranks would stop at different iterations and leave one in an '
                     'all-reduce (the trainer evaluates in line, alike on every rank).')


# What every cell must run alike: the task and its envs (num_threads is a host's own), the policy, the algorithm,
# and the schedule's length, seed and layout; a cell's rank, run directory, caches and limits may differ.
_PER_HOST_SIM = ('num_threads',)
_AGREED_SCHEDULE = ('name', 'num_timesteps', 'num_evals', 'seed', 'resume', 'num_groups', 'max_staleness',
                    'target_return', 'deterministic_eval')


def agreed_flags(sim, policy, algo, schedule) -> dict:
  """--flag -> its value (as text) for every setting the cells must share (`runtime.distributed.agree` compares
  them across the ranks once they have joined)."""
  out = {f'--{k}': repr(v) for k, v in dataclasses.asdict(sim).items() if k not in _PER_HOST_SIM}
  out.update({f'--{k}': repr(v) for k, v in dataclasses.asdict(policy).items()})
  out.update({f'--{k}': repr(v) for k, v in dataclasses.asdict(algo).items()})
  out.update({f'--{k}': repr(getattr(schedule, k)) for k in _AGREED_SCHEDULE})
  return out
