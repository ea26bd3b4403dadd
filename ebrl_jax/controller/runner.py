"""Entry point of the controller: `run(config)` configures JAX, runs the schedule by name with telemetry
alongside, and writes `<run_dir>/summary.json` — the one writer of the summary."""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax.controller import fused
from ebrl_jax.controller import pipeline
from ebrl_jax.resources import telemetry as telemetry_lib
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import metrics
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.runtime import tracing
from ebrl_jax.trainer import driver

RunError = errors.RunError


def _run_fused(cfg: config_lib.Config, pids: Dict[str, int]) -> driver.RunSummary:
  del pids  # one process: the controller itself
  return fused.run(cfg)


# Schedule registry: every name in config.SCHEDULES. A schedule gets the config and the role -> pid map that
# telemetry watches (it adds its workers as it starts them).
SCHEDULES: Dict[str, Callable[[config_lib.Config, Dict[str, int]], driver.RunSummary]] = {
    'fused': _run_fused,
    'sync': pipeline.run,
    'async': pipeline.run
}


def _add_telemetry_and_trace(cfg: config_lib.Config, summary: driver.RunSummary,
                             telemetry_means: Optional[dict]) -> None:
  extra = summary.extra
  if telemetry_means is not None:
    extra['telemetry'] = telemetry_means
    shown = {k: round(v, 1) for k, v in telemetry_means.items() if isinstance(v, float)}
    logging.info('telemetry means: %s', shown)
  if cfg.schedule.trace_dir and tracing.merge(cfg.schedule.trace_dir):
    extra['stage_ms'] = tracing.summarize(cfg.schedule.trace_dir)
    for name, s in sorted(extra['stage_ms'].items()):
      logging.info('%s: %d spans, %.1f ms total, %.3f ms mean', name, s['count'], s['total_ms'], s['mean_ms'])


def write_summary(cfg: config_lib.Config, summary: driver.RunSummary) -> str:
  """Writes the summary atomically; a full disk is a `DiskFull` naming the file (the checkpoints stay whole)."""
  path = os.path.join(cfg.schedule.run_dir, 'summary.json')
  try:
    storage.write_json(path, dataclasses.asdict(summary), indent=2)
  except OSError as e:
    reason = storage.disk_full(e)
    if reason is None:
      raise
    run_dir = os.path.abspath(cfg.schedule.run_dir)
    raise errors.DiskFull(f'the run finished, but the disk holding {run_dir} is full ({reason}): {path} was not '
                          'written. ' + storage.resume_advice(run_dir)) from e
  return path


def check_run_dir(cfg: config_lib.Config) -> None:
  """Refuses, before anything starts or is written, a run whose directory does not match --resume."""
  run_dir = cfg.schedule.run_dir
  step = storage.latest_checkpoint_step(os.path.join(run_dir, 'checkpoints'))
  if cfg.schedule.checkpoint_every and not cfg.schedule.resume and step is not None:
    raise ValueError(f'--run_dir={run_dir} already holds checkpoints; pass --resume to continue that run or choose '
                     'another --run_dir.')
  if cfg.schedule.resume and step is None:
    raise ValueError(f'--resume was given but {run_dir}/checkpoints holds no checkpoint.')


def run(cfg: config_lib.Config) -> driver.RunSummary:
  """Runs `cfg` with its schedule, with telemetry alongside; writes the run's config.json (the whole config, the
  one place that sees it) and its summary.json, and returns the summary."""
  if cfg.schedule.name not in SCHEDULES:
    raise ValueError(f'--schedule={cfg.schedule.name!r} is not valid; allowed values: {", ".join(SCHEDULES)}.')
  check_run_dir(cfg)
  os.makedirs(cfg.schedule.run_dir, exist_ok=True)
  storage.write_json(os.path.join(cfg.schedule.run_dir, 'config.json'), dataclasses.asdict(cfg), indent=2)
  startup.configure_jax(cfg.resources.platform, cfg.schedule.compilation_cache_dir)
  metrics.quiet_library_logs()
  pids: Dict[str, int] = {}
  telemetry = None
  if cfg.resources.telemetry_period_s > 0:
    os.makedirs(cfg.schedule.run_dir, exist_ok=True)
    telemetry = telemetry_lib.Telemetry(cfg.schedule.run_dir, lambda: {
        'controller': os.getpid(),
        **pids
    }, cfg.resources.telemetry_period_s, cfg.schedule.trace_dir).start()
  try:
    summary = SCHEDULES[cfg.schedule.name](cfg, pids)
  finally:
    means = telemetry.stop() if telemetry is not None else None
  _add_telemetry_and_trace(cfg, summary, means)
  write_summary(cfg, summary)
  logging.info('Finished: %d env steps, final eval return %.1f, %.0f env steps/s, compile %.1f s.', summary.env_steps,
               summary.final_eval_return, summary.env_steps_per_s, summary.compile_s)
  return summary
