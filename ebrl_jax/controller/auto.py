"""`--schedule=auto`: chooses fused, sync or async (with their groups and quotas) from this machine's stage
profiles (`resources.schedule_choice`; calibrated first, as for `--plan`, where the profile store lacks a stage)
and runs it. The choice, every schedule's prediction and the reason go to the log and to `summary.extra['auto']`;
`summary.schedule` names the schedule that ran."""
from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

from ebrl_jax import config as config_lib
from ebrl_jax.controller import fused
from ebrl_jax.controller import pipeline
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import mps
from ebrl_jax.runtime import run_clock
from ebrl_jax.trainer import driver


def resolve(cfg: config_lib.Config, start_unix: Optional[float] = None) -> Tuple[config_lib.Config, dict]:
  """The config with the chosen schedule, and the record of the choice. Calibration (if needed) runs under an MPS
  daemon of its own with --use_mps, stopped before the chosen schedule starts its own, within the calibration
  budget counted from `start_unix` (the run's process start; None: no budget)."""
  topology = topology_lib.make_topology(cfg)
  handoff = autoplan.handoff_s(topology.segment_spec.nbytes * topology.num_groups, topology.describe()['param_bytes'])
  daemon = mps.MpsDaemon(cfg.schedule.run_dir) if cfg.resources.use_mps else None
  try:
    if daemon is not None and not daemon.start():
      daemon = None
    return autoplan.plan_auto(cfg, daemon is not None, functools.partial(pipeline.calibration_env, daemon), handoff,
                              calibration_procs.deadline(cfg, start_unix))
  finally:
    if daemon is not None:
      daemon.stop()


def run(cfg: config_lib.Config, pids: Dict[str, int], start: run_clock.StartClock) -> driver.RunSummary:
  chosen, record = resolve(cfg, start.unix)
  start = start.mark('auto_choice')  # profiles read (or calibrated) and the schedule chosen
  if chosen.schedule.name == 'fused':
    summary = fused.run(chosen, start)
  else:
    summary = pipeline.run(chosen, pids, start)
  summary.extra['auto'] = record
  if record.get('generation') is not None and 'generation_layout' in summary.extra:
    summary.extra['generation_layout']['reason'] = record['generation']['reason']  # chosen here, not by a flag
  return summary
