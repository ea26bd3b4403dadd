"""`--schedule=auto`'s trials (`--auto_trial_s`): a process schedule that the stage profiles chose is run for a
few iterations, and then fused for as long, before the run commits to one; the process schedule is kept only if
its trial measured faster than fused's by MEASURED_MARGIN, otherwise the run goes on as fused.

Why: the profiles time each stage alone, so a prediction cannot see what the processes cost one another beyond
the modelled hand-off (on a 2-core machine the trainer's XLA threads, the rollout worker and the evaluator share
the cores: experiments/results/README.md, w4tf_auto_2cpu.json, async predicted +6.4 %, measured -1.3 %). Nor is
fused's own prediction exact (W4 on the same machine: 13,971 predicted, 12,695 measured, while async measured
13,351 in its trial and 13,870 in its run), so the process schedule is held against fused measured the same way,
not against fused's prediction (which an earlier version did: w4_auto_trial_2cpu.json).

Each trial is a config of the run itself (the chosen one, then the run's as fused), in `<run_dir>/auto_trial` and
`<run_dir>/auto_trial_fused`, stopped after `--auto_trial_s` seconds of training (`--max_train_s`: a process
schedule's start-up iteration, which no rate counts, comes first), without checkpoints, on the run's clock, inside
the calibration budget. The verdict is kept beside the profile store (`path_for`), keyed by the layout (`key`), so
a later run of the same machine, workload and layout decides without a trial. Every run that follows a verdict
checks it at its end (`check_run`): a run that measured, over at least a trial's length, slower than the
schedule it was preferred to (by MEASURED_MARGIN) drops the verdict (`forget`): a verdict taken in a noisy minute
holds only while the runs that follow bear it out, and after RECHECK_AFTER runs that bore it out the next run tries
both again (`confirm`): a run measures only its own schedule, and one slow trial of the other must not hold for
ever.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Tuple

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.resources import schedule_choice
from ebrl_jax.runtime import storage

FORMAT = 'ebrl_jax.resources.auto_trial/1'
MIN_MEASURED = 2  # iterations a trial's rate counts at the least (after a process schedule's start-up iteration)
# A process schedule is kept if its trial beats fused's trial by more than this (both measured: only their noise
# between them), or, where fused's trial measured nothing, fused's prediction by the choice's own margin.
MEASURED_MARGIN = 0.02
PREDICTED_MARGIN = schedule_choice.MARGIN
# How a trial may end and still have measured something; any other stop (a signal, a failure) ends the run.
MEASURED_STOPS = ('max_train_s', 'num_timesteps', 'max_wall_s')
# Runs that bear a verdict out before it is tried again: a run measures only the schedule it ran, so the other
# schedule's rate stays that of one trial; a trial that ran slow in a noisy minute would keep confirming the
# verdict for ever. Every RECHECK_AFTER confirmations, the next run measures both again.
RECHECK_AFTER = 5


def key(cfg: config_lib.Config) -> str:
  """The layout a trial measured: the schedule and everything `--schedule=auto` chose for it."""
  s = cfg.schedule
  return (f'{s.name};groups={s.num_groups};quotas={cfg.resources.sm_quotas or "-"};mps={cfg.resources.use_mps};'
          f'colocate={s.colocate_generation};slices={s.env_slices}')


def schedule_of(layout: str) -> str:
  """The schedule a layout key (`key`) names."""
  return layout.split(';', 1)[0]


def path_for(store_path: str) -> str:
  """The trials file beside a profile store (`<digest>.json` -> `<digest>.trials.json`)."""
  return os.path.splitext(store_path)[0] + '.trials.json'


def load(path: str) -> dict:
  """The kept trials, layout key -> entry; {} where there is no file or it cannot be read (the trial runs again)."""
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    logging.warning('auto trial: %s cannot be read (%s); its trials run again.', path, e)
    return {}
  if not isinstance(data, dict) or data.get('format') != FORMAT:
    logging.warning('auto trial: %s is not a trials file (%s); its trials run again.', path, FORMAT)
    return {}
  return dict(data.get('trials', {}))


def _write(path: str, trials: dict) -> None:
  """The trials file, written whole (storage.write_json)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  storage.write_json(path, {'format': FORMAT, 'trials': trials}, indent=1)


def save(path: str, layout: str, entry: dict) -> None:
  """Adds (or replaces) one layout's trial in the file."""
  _write(path, {**load(path), layout: entry})


def trial_config(cfg: config_lib.Config,
                 trial_s: float,
                 max_wall_s: float,
                 name: str = 'auto_trial') -> config_lib.Config:
  """A config as its trial: stopped after `trial_s` seconds of training (--max_train_s; a process schedule's
  start-up iteration is not among them) or at `max_wall_s` from process start (0: none), in `<run_dir>/<name>`,
  evaluated at the run's cadence, without checkpoints, resume, target or trace."""
  if trial_s <= 0:
    raise ValueError(f'--auto_trial_s={trial_s} must be > 0 for a trial.')
  schedule = dataclasses.replace(cfg.schedule,
                                 run_dir=os.path.join(cfg.schedule.run_dir, name),
                                 target_return=None,
                                 checkpoint_every=0,
                                 first_checkpoint_iteration=0,
                                 resume=False,
                                 trace_dir='',
                                 max_wall_s=max_wall_s,
                                 max_train_s=trial_s,
                                 evaluator_wait_s=min(cfg.schedule.evaluator_wait_s, 10.0))
  return dataclasses.replace(cfg, schedule=schedule)


def wall_limit(deadline: Optional[float], start_unix: float) -> Tuple[float, Optional[str]]:
  """(the trial's --max_wall_s from process start, None) inside the calibration deadline (0: no deadline), or
  (0, why there is no room for a trial)."""
  if deadline is None:
    return 0.0, None
  left = deadline - time.time()
  if left <= 1.0:
    return 0.0, f'the calibration budget had {max(left, 0.0):.1f} s left, no room for a trial'
  return deadline - start_unix, None


def measured(summary) -> Optional[float]:
  """A trial's env steps/s (`summary`: its driver.RunSummary), or None where it counted fewer than MIN_MEASURED
  iterations (a process schedule's first iteration is start-up, in no rate; fused's start-up ends before its
  first)."""
  counted = summary.iterations - (0 if summary.schedule == 'fused' else 1)
  return summary.env_steps_per_s if counted >= MIN_MEASURED and summary.train_wall_s > 0 else None


def entry(summary, layout: str, predicted: float, fused_predicted: float, trial_s: float, fused_summary=None) -> dict:
  """What the trials measured, as the trials file keeps it: the process schedule's (`summary`) and fused's
  (`fused_summary`; None: not run)."""
  out = {
      'layout': layout,
      'measured_env_steps_per_s': measured(summary),
      'predicted_env_steps_per_s': predicted,
      'fused_predicted_env_steps_per_s': fused_predicted,
      'iterations': summary.iterations,
      'measured_s': summary.train_wall_s,
      'startup_s': summary.compile_s,
      'stopped': summary.stopped,
      'fused_measured_env_steps_per_s': None,
      'auto_trial_s': trial_s,
      'unix': time.time(),
  }
  if fused_summary is not None:
    out.update(fused_measured_env_steps_per_s=measured(fused_summary),
               fused_iterations=fused_summary.iterations,
               fused_measured_s=fused_summary.train_wall_s,
               fused_stopped=fused_summary.stopped)
  return out


def verdict(trial: dict) -> Tuple[bool, str]:
  """(keep the process schedule?, why): kept only if its trial measured more than fused's trial by
  MEASURED_MARGIN, or, where fused's trial measured nothing, more than fused's prediction by PREDICTED_MARGIN; a
  process trial that measured nothing keeps the prediction's choice where that prediction beat fused's by
  PREDICTED_MARGIN (a layout tried because the model could not tell, `schedule_choice.uncertain`, did not), and
  such an uncertain layout is never kept without fused's trial."""
  layout, rate = trial['layout'], trial['measured_env_steps_per_s']
  schedule = schedule_of(layout)
  if rate is None:
    ended = (f'its trial ended ({trial["stopped"]}) after {trial["iterations"]} iteration(s), too few to '
             'measure')
    predicted, fused = trial['predicted_env_steps_per_s'], trial['fused_predicted_env_steps_per_s']
    if predicted > fused * (1 + PREDICTED_MARGIN):
      return True, f'{schedule} kept on its prediction: {ended}'
    return False, (f'fused: {ended}, and {schedule}\'s prediction ({predicted:,.0f} env-steps/s) does not beat '
                   f'fused\'s ({fused:,.0f}) by the {PREDICTED_MARGIN:.0%} margin')
  fused = trial.get('fused_measured_env_steps_per_s')
  if fused is not None:
    margin, against = MEASURED_MARGIN, f'fused\'s trial, {fused:,.0f} over {trial["fused_measured_s"]:.1f} s'
  elif trial['predicted_env_steps_per_s'] <= trial['fused_predicted_env_steps_per_s'] * (1 + PREDICTED_MARGIN):
    # Tried because the model could not tell, and fused unmeasured: fused's prediction is no yardstick (on the H100
    # W1's fused ran 903 k env-steps/s against its predicted 799 k).
    doubted = trial['fused_predicted_env_steps_per_s']
    return False, (f'fused: {schedule} ({layout}) was tried because the model could not tell, and fused\'s own '
                   f'trial measured nothing ({trial.get("fused_trial", "none ran")}): a trial of {rate:,.0f} '
                   f'env-steps/s is not weighed against a prediction ({doubted:,.0f}) the model itself doubted')
  else:
    fused, margin = trial['fused_predicted_env_steps_per_s'], PREDICTED_MARGIN
    against = f'fused\'s predicted {fused:,.0f} (fused\'s own trial measured nothing)'
  gain = rate / fused - 1
  text = (f'the trial of {schedule} ({layout}) measured {rate:,.0f} env-steps/s over {trial["iterations"] - 1} '
          f'iterations ({trial["measured_s"]:.1f} s; predicted {trial["predicted_env_steps_per_s"]:,.0f}), '
          f'{gain:+.1%} against {against}')
  if gain > margin:
    return True, f'{schedule} kept: {text} (> {margin:.0%})'
  return False, f'fused: {text}, within the {margin:.0%} margin'


def forget(path: str, layout: str) -> None:
  """Removes one layout's trial from the file (its next run tries again); nothing where it has none."""
  trials = load(path)
  if trials.pop(layout, None) is not None:
    _write(path, trials)


def confirm(path: str, layout: str) -> Tuple[int, bool]:
  """Counts a run that bore a layout's verdict out (`confirmed_runs` in its entry): (the count, whether it reached
  RECHECK_AFTER, which drops the verdict so that the next run tries both schedules again). (0, False) where the
  file has no such verdict (another run dropped it)."""
  trials = load(path)
  kept = trials.get(layout)
  if kept is None:
    return 0, False
  runs = int(kept.get('confirmed_runs', 0)) + 1
  if runs >= RECHECK_AFTER:
    trials.pop(layout)
  else:
    trials[layout] = dict(kept, confirmed_runs=runs)
  _write(path, trials)
  return runs, runs >= RECHECK_AFTER


def check_run(trial: dict, summary) -> Tuple[Optional[bool], str]:
  """Whether the run that followed a verdict (`trial`: its record, `summary`: the run's driver.RunSummary) bears
  it out: (None, why not checked) where the run measured less than a trial's length, or ended otherwise than by
  its steps, its target or a budget; else (True, text) where its rate is within MEASURED_MARGIN of, or above, the
  rate the other schedule measured (a process schedule's run against fused's trial, fused's run against the
  process schedule's trial), (False, text) where it is below it."""
  if summary.stopped not in MEASURED_STOPS + ('target_return',) or measured(summary) is None:
    return None, f'the run ended ({summary.stopped}) before it measured a rate'
  if summary.train_wall_s < trial.get('auto_trial_s', 0.0):
    return None, f'the run measured {summary.train_wall_s:.1f} s, less than a trial'
  if summary.schedule == 'fused':
    other, name = trial.get('measured_env_steps_per_s'), schedule_of(trial['layout']) + "'s trial"
  else:
    other, name = trial.get('fused_measured_env_steps_per_s'), "fused's trial"
  if other is None:
    return None, f'{name} measured nothing to hold the run against'
  gain = summary.env_steps_per_s / other - 1
  text = (f'the run ({summary.schedule}) measured {summary.env_steps_per_s:,.0f} env-steps/s over '
          f'{summary.train_wall_s:.0f} s, {gain:+.1%} against {name} ({other:,.0f})')
  return gain >= -MEASURED_MARGIN, text
