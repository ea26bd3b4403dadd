"""`--schedule=auto`: chooses fused, sync or async (with their groups and quotas) from this machine's stage
profiles (`resources.schedule_choice`; calibrated first, as for `--plan`, where the profile store lacks a stage)
and runs it; a chosen sync/async layout first runs as a trial, and fused after it (`--auto_trial_s`,
resources/auto_trial.py), and is kept only if it measured faster than fused, else the run goes on as fused. The
choice, every schedule's prediction, the trials and the reason go to the log and to `summary.extra['auto']`;
`summary.schedule` names the schedule that ran."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
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
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import startup
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


def _trial_dir(trial_cfg: config_lib.Config) -> str:
  """A trial's directory, emptied of an earlier run's trial in this --run_dir."""
  shutil.rmtree(trial_cfg.schedule.run_dir, ignore_errors=True)
  os.makedirs(trial_cfg.schedule.run_dir, exist_ok=True)
  return os.path.join(trial_cfg.schedule.run_dir, 'summary.json')


def _process_trial(trial_cfg: config_lib.Config, start: run_clock.StartClock) -> driver.RunSummary:
  """The chosen process schedule's trial, run by this controller as the run would be; its summary kept."""
  path = _trial_dir(trial_cfg)
  summary = pipeline.run(trial_cfg, {}, start)
  storage.write_json(path, dataclasses.asdict(summary), indent=2)
  return summary


def _fused_trial_main(cfg: config_lib.Config, start: run_clock.StartClock, out_path: str) -> None:
  """Process entry point of fused's trial: a process of its own, so that its JAX client (and on a GPU the memory
  it preallocates) is gone before the run starts, whichever schedule it runs."""
  startup.configure_jax(cfg.resources.platform, cfg.schedule.compilation_cache_dir)
  storage.write_json(out_path, dataclasses.asdict(fused.run(cfg, start)), indent=2)


def _fused_trial(trial_cfg: config_lib.Config, start: run_clock.StartClock,
                 deadline: Optional[float]) -> Optional[driver.RunSummary]:
  """Fused's trial in a spawned process (its summary kept by it), killed 30 s after the calibration deadline (else
  after TIMEOUT_S). None where it was still running then (its start-up outlasted what the budget had left: on the
  H100, W1's fused compile took 48 s of the 36 s left, and the run used to end there): the verdict then weighs
  the process trial against fused's prediction, as without room for fused's trial. A process that failed
  without its summary is a RunError naming the trial."""
  path = _trial_dir(trial_cfg)
  timeout = calibration_procs.TIMEOUT_S if deadline is None else max(1.0, deadline - time.time() + 30.0)
  exitcode = calibration_procs.run_process(_fused_trial_main, (trial_cfg, start, path), 'auto_trial/fused', timeout)
  if exitcode is None and not os.path.exists(path):
    logging.warning(
        '--schedule=auto: fused\'s trial was still running after %.0f s (the calibration budget, '
        '--calibration_budget_s, had no room left for its start-up and training); fused\'s prediction stands '
        'in for it.', timeout)
    return None
  if exitcode != 0 or not os.path.exists(path):
    raise errors.RunError(f'--schedule=auto: fused\'s trial ended without its summary '
                          f'({calibration_procs.exit_text(exitcode)}); see its log above, or pass --auto_trial_s=0.')
  with open(path) as f:
    return driver.RunSummary(**json.load(f))


def trial(cfg: config_lib.Config, chosen: config_lib.Config, record: dict,
          start: run_clock.StartClock) -> Tuple[config_lib.Config, dict, Optional[driver.RunSummary]]:
  """Runs the pending trials (resources/auto_trial.py): the chosen process schedule, then `cfg` as fused, each for
  --auto_trial_s of training, and decides: (the config the run goes on with, the record, None), or (chosen,
  record, the trial's summary) where a signal or a failure stopped a trial: the run ends with it. Without room in
  the calibration budget the prediction's choice stays (and for fused's trial alone, fused's prediction is the
  measure)."""
  pending, trial_s = record['trial'], cfg.resources.auto_trial_s
  deadline = calibration_procs.deadline(cfg, start.unix)
  max_wall_s, no_room = auto_trial.wall_limit(deadline, start.unix)
  if no_room:
    why = f'{chosen.schedule.name} kept on its prediction: {no_room}'
    record['trial'] = dict(pending, pending=False, kept=True, verdict=why)
    logging.warning('--schedule=auto: %s', why)
    return chosen, record, None
  logging.info('--schedule=auto: a trial of %s, then of fused, %g s of training each after its start-up.',
               pending['layout'], trial_s)
  process = _process_trial(auto_trial.trial_config(chosen, trial_s, max_wall_s), start)
  fused_run = fused_cfg = None
  max_wall_s, no_room = auto_trial.wall_limit(deadline, start.unix)
  if process.stopped in auto_trial.MEASURED_STOPS and auto_trial.measured(process) is not None and not no_room:
    fused_cfg = auto_trial.trial_config(autoplan.as_fused(cfg)[0], trial_s, max_wall_s, 'auto_trial_fused')
    fused_run = _fused_trial(fused_cfg, start, deadline)
  result = auto_trial.entry(process, pending['layout'], record['predicted_env_steps_per_s'],
                            record['predicted']['fused'], trial_s, fused_run)
  if fused_cfg is not None and fused_run is None:
    result['fused_trial'] = 'out of the calibration budget: fused\'s prediction stood in'
  ended = next((r for r in (process, fused_run) if r is not None and r.stopped not in auto_trial.MEASURED_STOPS), None)
  if ended is not None:
    record['trial'] = dict(pending, **result, pending=False, verdict=f'a trial stopped: {ended.stopped}')
    return chosen, record, ended
  keep, why = auto_trial.verdict(result)
  if result['measured_env_steps_per_s'] is not None:
    auto_trial.save(pending['path'], pending['layout'], result)
  logging.info('--schedule=auto: %s', why)
  record['trial'] = dict(pending, **result, pending=False, kept=keep, verdict=why)
  return (chosen, record, None) if keep else (*autoplan.after_trial_fused(cfg, record, why), None)


def _check_verdict(trial: Optional[dict], summary: driver.RunSummary) -> None:
  """After a run that followed a trial's verdict (this run's or a kept one): the run's rate against the other
  schedule's trial (auto_trial.check_run); a verdict the run contradicts is dropped from the trials file, so the
  next run tries again. The outcome goes to trial['run_check']."""
  if not trial or trial.get('pending') or 'measured_env_steps_per_s' not in trial:
    return
  ok, why = auto_trial.check_run(trial, summary)
  trial['run_check'] = {'confirmed': ok, 'reason': why}
  if ok is False:
    auto_trial.forget(trial['path'], trial['layout'])
    logging.warning('--schedule=auto: %s; the verdict is dropped from %s, the next run tries again.', why,
                    trial['path'])
  elif ok:
    runs, recheck = auto_trial.confirm(trial['path'], trial['layout'])
    trial['run_check']['confirmed_runs'] = runs
    logging.info('--schedule=auto: the verdict holds: %s (%d run(s) have borne it out%s).', why, runs,
                 '; the next run tries both schedules again' if recheck else '')


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
  _check_verdict(record.get('trial'), summary)
  summary.extra['auto'] = record
  if record.get('generation') is not None and 'generation_layout' in summary.extra:
    summary.extra['generation_layout']['reason'] = record['generation']['reason']  # chosen here, not by a flag
  return summary
