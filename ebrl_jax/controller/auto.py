"""`--schedule=auto`: chooses fused, sync or async (with their groups and quotas) from this machine's stage
profiles (`resources.schedule_choice`; calibrated first, as for `--plan`, where the profile store lacks a stage)
and runs it; a chosen sync/async layout first runs as a trial (`--auto_trial_s`, resources/auto_trial.py) and is
kept only if it measures faster than fused's prediction, else the run goes on as fused. The choice, every
schedule's prediction, the trial and the reason go to the log and to `summary.extra['auto']`; `summary.schedule`
names the schedule that ran."""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from typing import Dict, Optional, Tuple

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.controller import fused
from ebrl_jax.controller import pipeline
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.resources import auto_trial
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import mps
from ebrl_jax.resources import schedule_choice
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import storage
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


def trial(cfg: config_lib.Config, chosen: config_lib.Config, record: dict,
          start: run_clock.StartClock) -> Tuple[config_lib.Config, dict, Optional[driver.RunSummary]]:
  """Runs the pending trial of the chosen process schedule (resources/auto_trial.py) and decides: (the config
  the run goes on with, the record, None), or (chosen, record, the trial's summary) where a signal or a failure
  stopped the trial: the run ends with it. Without room in the calibration budget the prediction's choice stays."""
  pending = record['trial']
  max_wall_s, no_room = auto_trial.wall_limit(calibration_procs.deadline(cfg, start.unix), start.unix)
  if no_room:
    why = f'{chosen.schedule.name} kept on its prediction: {no_room}'
    record['trial'] = dict(pending, pending=False, kept=True, verdict=why)
    logging.warning('--schedule=auto: %s', record['trial']['verdict'])
    return chosen, record, None
  logging.info('--schedule=auto: a trial of %s, %g s of training after its start-up, before the run commits to it.',
               pending['layout'], cfg.resources.auto_trial_s)
  trial_cfg = auto_trial.trial_config(chosen, cfg.resources.auto_trial_s, max_wall_s)
  shutil.rmtree(trial_cfg.schedule.run_dir, ignore_errors=True)  # an earlier run's trial in this --run_dir
  summary = pipeline.run(trial_cfg, {}, start)
  os.makedirs(trial_cfg.schedule.run_dir, exist_ok=True)
  storage.write_json(os.path.join(trial_cfg.schedule.run_dir, 'summary.json'), dataclasses.asdict(summary), indent=2)
  result = auto_trial.entry(summary, pending['layout'], record['predicted_env_steps_per_s'],
                            record['predicted']['fused'], cfg.resources.auto_trial_s)
  if summary.stopped not in auto_trial.MEASURED_STOPS:
    record['trial'] = dict(pending, **result, pending=False, verdict=f'the trial stopped: {summary.stopped}')
    return chosen, record, summary
  keep, why = auto_trial.verdict(result, schedule_choice.MARGIN)
  if result['measured_env_steps_per_s'] is not None:
    auto_trial.save(pending['path'], pending['layout'], result)
  logging.info('--schedule=auto: %s', why)
  record['trial'] = dict(pending, **result, pending=False, kept=keep, verdict=why)
  return (chosen, record, None) if keep else (*autoplan.after_trial_fused(cfg, record, why), None)


def run(cfg: config_lib.Config, pids: Dict[str, int], start: run_clock.StartClock) -> driver.RunSummary:
  chosen, record = resolve(cfg, start.unix)
  start = start.mark('auto_choice')  # profiles read (or calibrated) and the schedule chosen
  if record.get('trial', {}).get('pending'):
    chosen, record, stopped = trial(cfg, chosen, record, start)
    start = start.mark('auto_trial')  # the trial's start-up and iterations, none of them in the run's rate
    if stopped is not None:
      stopped.extra['auto'] = record
      return stopped
  if chosen.schedule.name == 'fused':
    summary = fused.run(chosen, start)
  else:
    summary = pipeline.run(chosen, pids, start)
  summary.extra['auto'] = record
  if record.get('generation') is not None and 'generation_layout' in summary.extra:
    summary.extra['generation_layout']['reason'] = record['generation']['reason']  # chosen here, not by a flag
  return summary
