"""The stage calibration's processes (`--plan`, `--schedule=auto`): one spawned process per SM quota, each timing
every stage alone (`calibrate.calibrate_main`), and the budget they run under (`--calibration_budget_s`).
`autoplan` decides which quotas to calibrate and keeps their profiles."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from typing import List, Optional, Sequence

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.resources import calibrate
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle

TIMEOUT_S = 900.0  # a calibration process's own limit, budget or not


class CalibrationTimeout(errors.RunError):
  """A calibration process did not finish in the time it was given (its quota is `quota`)."""

  def __init__(self, quota: int, timeout_s: float):
    super().__init__(f'stage calibration at SM quota {quota} % did not finish in {timeout_s:.0f} s.')
    self.quota, self.timeout_s = quota, timeout_s


class CalibrationFailed(errors.RunError):
  """A calibration process ended without its profile: its exit code, or the signal that killed it."""

  def __init__(self, quota: int, exitcode: Optional[int]):
    super().__init__(f'stage calibration at SM quota {quota} % failed ({exit_text(exitcode)}); see its log above')
    self.quota, self.exitcode = quota, exitcode


def exit_text(exitcode: Optional[int]) -> str:
  """How a process ended, as a message says it: 'killed by SIGKILL', or 'exit code 1'."""
  if exitcode is not None and exitcode < 0 and -exitcode in signal.valid_signals():
    return f'killed by {signal.Signals(-exitcode).name}'
  return f'exit code {exitcode}'


def _child_main(creator: int, target, args: tuple, kwargs: dict) -> None:
  lifecycle.end_with_creator(creator)  # a controller killed outright (SIGKILL) takes this process with it
  target(*args, **kwargs)


def run_process(target, args: tuple, name: str, timeout_s: float, kwargs: Optional[dict] = None) -> Optional[int]:
  """Runs `target(*args, **kwargs)` in a spawned daemon process and waits at most `timeout_s`; returns its exit
  code, or None where it was still running then. A process still running at the timeout, or when the wait is
  interrupted (Ctrl-C, SIGTERM), is killed before this returns or raises; one whose caller dies is ended by the
  parent-death signal (`lifecycle.end_with_creator`). Call it from the main thread (the signal's "parent")."""
  proc = multiprocessing.get_context('spawn').Process(target=_child_main,
                                                      args=(os.getpid(), target, args, kwargs or {}),
                                                      name=name,
                                                      daemon=True)
  timed_out = False
  try:
    proc.start()
    proc.join(max(0.0, timeout_s))
    timed_out = proc.is_alive()
  finally:
    if proc.is_alive():
      proc.kill()
      proc.join(5)
  return None if timed_out else proc.exitcode


def calibrate_quotas(cfg: config_lib.Config,
                     sizes: List[int],
                     quotas: Sequence[int],
                     worker_env,
                     run_dir: str,
                     repeats: int = 3,
                     timeout_s: float = TIMEOUT_S) -> List[dict]:
  """One spawned process per quota, in turn; returns their calibration JSONs, each with 'process_s' (the process's
  wall seconds, start-up included). A process that has not finished after `timeout_s` is killed
  (`CalibrationTimeout`); a failed one is a `CalibrationFailed` naming the quota and how it ended."""
  out = []
  for q in quotas:
    path = os.path.join(run_dir, f'calibration_q{q}.json')
    t0 = time.monotonic()
    exitcode = run_process(calibrate.calibrate_main, (cfg, sizes, repeats, path), f'calibrate/q{q}', timeout_s,
                           {'env': worker_env(q)})
    if exitcode is None:
      raise CalibrationTimeout(q, timeout_s)
    if exitcode != 0 or not os.path.exists(path):
      raise CalibrationFailed(q, exitcode)
    with open(path) as f:
      profile = json.load(f)
    profile['process_s'] = time.monotonic() - t0
    out.append(profile)
    phases = ', '.join(f'{name} {s:.1f}' for name, s in profile.get('phase_s', {}).items())
    logging.info('calibration at quota %d %%: %.1f s (sizes %s; phases in s: %s)', q, profile['process_s'], sizes,
                 phases)
  return out


def budget_s(cfg: config_lib.Config) -> float:
  """The calibration's budget in seconds from process start: --calibration_budget_s, or (0) a third of
  --max_wall_s; 0: none."""
  return cfg.resources.calibration_budget_s or cfg.schedule.max_wall_s / 3


def deadline(cfg: config_lib.Config, start_unix: Optional[float]) -> Optional[float]:
  """When (time.time() seconds) the calibration of a run that started at `start_unix` must have ended (`budget_s`
  after it); None: no budget but each process's own TIMEOUT_S."""
  budget = budget_s(cfg)
  if start_unix is None or budget <= 0:
    return None
  return start_unix + budget


def budget_flags(cfg: config_lib.Config) -> str:
  """The flags that set the budget, as a message names them."""
  if cfg.resources.calibration_budget_s:
    return f'--calibration_budget_s={cfg.resources.calibration_budget_s:g}'
  return f'--max_wall_s={cfg.schedule.max_wall_s:g} (a third of it; --calibration_budget_s sets another)'


def no_room(cfg: config_lib.Config, quota: int, left_s: float, last_s: float) -> Optional[str]:
  """Why the calibration at `quota` is not started with `left_s` of the budget left, the last quota having taken
  `last_s` (0: none ran yet), or None: it may start."""
  if left_s <= 0:
    return f'the calibration budget, {budget_flags(cfg)}, had run out before the calibration at {quota} % could start'
  if last_s > left_s:
    return (f'the calibration budget, {budget_flags(cfg)}, had {left_s:.1f} s left, less than the {last_s:.1f} s '
            'the last quota took')
  return None
