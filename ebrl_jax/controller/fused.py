"""The `fused` schedule: one process, sequential. Collect a batch, train on it, evaluate now and then.

The correctness reference and the baseline for light workloads: the training driver (`trainer.driver`) around
one batch source per backend, `fused_mjx.MjxFusedLoop` (one jitted program per chunk of iterations, as Brax's PPO)
or `fused_cpu.CpuFusedLoop` (native MuJoCo stepped from a Python loop around jitted `act` and `train_step`).
"""
from __future__ import annotations

from typing import Optional

from ebrl_jax import config as config_lib
from ebrl_jax.controller import fused_cpu
from ebrl_jax.controller import topology
from ebrl_jax.trainer import driver


def make_source(cfg: config_lib.Config, spec, network, optimizer) -> driver.BatchSource:
  """The fused loop of `cfg`'s backend (it runs in the controller's process, so it sees the whole config)."""
  if cfg.sim.backend == 'mujoco_cpu':
    return fused_cpu.CpuFusedLoop(cfg, spec, network, optimizer)
  from ebrl_jax.controller import fused_mjx  # lazy: brax and MJX (~2 s of imports) load only for an MJX run
  return fused_mjx.MjxFusedLoop(cfg, spec, network, optimizer)


def run(cfg: config_lib.Config, start: Optional[driver.StartClock] = None) -> driver.RunSummary:
  """Trains with the fused schedule until `num_timesteps` env steps, the target return, --max_wall_s or a
  signal (the summary's `stopped` says which). Returns the summary, its times on the clock `start`. On MJX the
  loop compiles one program per chunk length, so its chunks are never cut (`fixed_chunks`)."""
  trainer = driver.trainer_config(cfg,
                                  topology.process_config(cfg),
                                  start=start,
                                  fixed_chunks=cfg.sim.backend != 'mujoco_cpu')
  summary = driver.run_training(trainer, lambda _, spec, network, optimizer: make_source(cfg, spec, network, optimizer))
  summary.extra['topology'] = {'roles': ['controller'], 'num_groups': 1}  # one process collects and trains
  return summary
