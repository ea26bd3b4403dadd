"""`--schedule=auto`'s trial (`--auto_trial_s`): a process schedule that the stage profiles chose is run for a few
iterations before the run commits to it, and kept only if its measured rate beats fused's prediction by more than
the choice's margin; otherwise the run goes on as fused.

Why: the profiles time each stage alone, so a prediction cannot see what the processes cost one another beyond
the modelled hand-off (on a 2-core machine the trainer's XLA threads, the rollout worker and the evaluator share
the cores: experiments/results/README.md, w4tf_auto_2cpu.json). Fused's prediction is the sum of the same stage
times run in turn, which is what the fused program does (3.39 k predicted vs 3.42 k measured there; 97.5 k vs
101.9 k for W2 on the H100), so a measured process schedule is held against it.

The trial is the chosen config itself, in `<run_dir>/auto_trial`, stopped after `--auto_trial_s` seconds of
training (`--max_train_s`: its start-up, which no rate counts, comes first), without checkpoints, on the run's
clock, inside the calibration budget. Its verdict is kept beside the profile store (`path_for`), keyed by the
layout (`key`), so a later run of the same machine, workload and layout decides without a trial.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Tuple

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import storage

FORMAT = 'ebrl_jax.resources.auto_trial/1'
MIN_MEASURED = 2  # iterations the trial's rate counts at the least (after its start-up iteration)
# How a trial may end and still have measured something; any other stop (a signal, a failure) ends the run.
MEASURED_STOPS = ('max_train_s', 'num_timesteps', 'max_wall_s')


def key(cfg: config_lib.Config) -> str:
  """The layout a trial measured: the schedule and everything `--schedule=auto` chose for it."""
  s = cfg.schedule
  return (f'{s.name};groups={s.num_groups};quotas={cfg.resources.sm_quotas or "-"};mps={cfg.resources.use_mps};'
          f'colocate={s.colocate_generation};slices={s.env_slices}')


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


def save(path: str, layout: str, entry: dict) -> None:
  """Adds (or replaces) one layout's trial in the file, written whole (storage.write_json)."""
  trials = load(path)
  trials[layout] = entry
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  storage.write_json(path, {'format': FORMAT, 'trials': trials}, indent=1)


def trial_config(cfg: config_lib.Config, trial_s: float, max_wall_s: float) -> config_lib.Config:
  """The chosen config as its trial: stopped after `trial_s` seconds of training (--max_train_s; its start-up
  iteration is not among them) or at `max_wall_s` from process start (0: none), in `<run_dir>/auto_trial`,
  evaluated at the run's cadence, without checkpoints, resume, target or trace."""
  if trial_s <= 0:
    raise ValueError(f'--auto_trial_s={trial_s} must be > 0 for a trial.')
  schedule = dataclasses.replace(cfg.schedule,
                                 run_dir=os.path.join(cfg.schedule.run_dir, 'auto_trial'),
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


def entry(summary, layout: str, predicted: float, fused_predicted: float, trial_s: float) -> dict:
  """What a finished trial measured (`summary`: its driver.RunSummary), as the trials file keeps it."""
  counted = summary.iterations - 1  # its start-up iteration is in compile_s, not in the rate
  measured = summary.env_steps_per_s if counted >= MIN_MEASURED and summary.train_wall_s > 0 else None
  return {
      'layout': layout,
      'measured_env_steps_per_s': measured,
      'predicted_env_steps_per_s': predicted,
      'fused_predicted_env_steps_per_s': fused_predicted,
      'iterations': summary.iterations,
      'measured_s': summary.train_wall_s,
      'startup_s': summary.compile_s,
      'stopped': summary.stopped,
      'auto_trial_s': trial_s,
      'unix': time.time(),
  }


def verdict(trial: dict, margin: float) -> Tuple[bool, str]:
  """(keep the process schedule?, why): kept only if the trial measured more than fused's prediction by `margin`;
  a trial that measured nothing (stopped before MIN_MEASURED iterations) keeps the prediction's choice."""
  layout, measured, fused = trial['layout'], trial['measured_env_steps_per_s'], trial['fused_predicted_env_steps_per_s']
  schedule = layout.split(';', 1)[0]
  if measured is None:
    return True, (f'{schedule} kept on its prediction: its trial ended ({trial["stopped"]}) after '
                  f'{trial["iterations"]} iteration(s), too few to measure')
  gain = measured / fused - 1
  text = (f'the trial of {schedule} ({layout}) measured {measured:,.0f} env-steps/s over {trial["iterations"] - 1} '
          f'iterations ({trial["measured_s"]:.1f} s; predicted {trial["predicted_env_steps_per_s"]:,.0f}), '
          f'{gain:+.1%} against fused\'s predicted {fused:,.0f}')
  if gain > margin:
    return True, f'{schedule} kept: {text} (> {margin:.0%})'
  return False, f'fused: {text}, within the {margin:.0%} margin'
