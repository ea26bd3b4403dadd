"""Entry point of the controller: `run(config)` configures JAX and dispatches to the schedule by name."""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional

from absl import logging

from ebrl_jax import config as config_lib
from ebrl_jax import storage


class RunError(RuntimeError):
  """The run stopped for a reason the user must act on (a dead trainer, say); the message says what to do."""


class DiskFull(RunError):
  """A write of the run (metrics, a checkpoint, the summary) found the disk full; the message names the file and
  the checkpoint that stays loadable."""


# A process schedule's trainer worker exits with this code when it stopped on a full disk (ENOSPC's number), so
# the controller can say why without reading anything the worker would have had to write.
DISK_FULL_EXIT = 28


def _run_fused(cfg: config_lib.Config):
  from ebrl_jax.controller import fused  # pylint: disable=g-import-not-at-top
  return fused.run(cfg)


def _run_pipeline(cfg: config_lib.Config):
  from ebrl_jax.controller import pipeline  # pylint: disable=g-import-not-at-top
  return pipeline.run(cfg)


# Schedule registry: every name in config.SCHEDULES.
SCHEDULES: Dict[str, Callable[[config_lib.Config], object]] = {
    'fused': _run_fused, 'sync': _run_pipeline, 'async': _run_pipeline}


def configure_jax(cfg: config_lib.Config) -> None:
  """Platform choice and JAX's persistent compilation cache (on by default; '' disables it)."""
  import jax  # pylint: disable=g-import-not-at-top
  if cfg.resources.platform:
    jax.config.update('jax_platforms', cfg.resources.platform)
  cache_dir = cfg.schedule.compilation_cache_dir
  if cache_dir:
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    try:
      os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
      raise ValueError(f'--compilation_cache_dir={cfg.schedule.compilation_cache_dir!r} cannot be created: {e}') from e
    jax.config.update('jax_compilation_cache_dir', cache_dir)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
    logging.info('Persistent compilation cache: %s', cache_dir)


def _watched_pids(run_dir: str) -> Dict[str, int]:
  """This process, and the workers the process schedules list in `<run_dir>/workers.json`."""
  pids = {'controller': os.getpid()}
  try:
    with open(os.path.join(run_dir, 'workers.json')) as f:
      pids.update(json.load(f)['workers'])
  except (OSError, ValueError, KeyError):
    pass
  return pids


def _finish(cfg: config_lib.Config, summary, telemetry_means: Optional[dict]):
  """Adds telemetry means and the timeline's per-stage totals to the summary (object and summary.json)."""
  from ebrl_jax import tracing  # pylint: disable=g-import-not-at-top
  extra = summary.extra
  if telemetry_means is not None:
    extra['telemetry'] = telemetry_means
    shown = {k: round(v, 1) for k, v in telemetry_means.items() if isinstance(v, float)}
    logging.info('telemetry means: %s', shown)
  if cfg.schedule.trace_dir and tracing.merge(cfg.schedule.trace_dir):
    extra['stage_ms'] = tracing.summarize(cfg.schedule.trace_dir)
    for name, s in sorted(extra['stage_ms'].items()):
      logging.info('%s: %d spans, %.1f ms total, %.3f ms mean', name, s['count'], s['total_ms'], s['mean_ms'])
  path = os.path.join(cfg.schedule.run_dir, 'summary.json')
  if os.path.exists(path):
    with open(path) as f:
      data = json.load(f)
    data['extra'] = extra
    try:
      storage.write_json(path, data, indent=2)  # the trainer's summary stays whole if this fails
    except OSError as e:
      reason = storage.disk_full(e)
      if reason is None:
        raise
      raise DiskFull(f'the run finished, but the disk holding {os.path.abspath(cfg.schedule.run_dir)} is full '
                     f'({reason}): {path} keeps the trainer\'s summary without the telemetry '
                     'means.') from e
  return summary


def run(cfg: config_lib.Config):
  """Runs `cfg` with its schedule, with telemetry alongside; returns the schedule's summary."""
  if cfg.schedule.name not in SCHEDULES:
    raise ValueError(f'--schedule={cfg.schedule.name!r} is not valid; allowed values: {", ".join(SCHEDULES)}.')
  configure_jax(cfg)
  from ebrl_jax.controller import metrics  # pylint: disable=g-import-not-at-top
  from ebrl_jax.resources import telemetry as telemetry_lib  # pylint: disable=g-import-not-at-top
  metrics.quiet_library_logs()
  telemetry = None
  if cfg.resources.telemetry_period_s > 0:
    os.makedirs(cfg.schedule.run_dir, exist_ok=True)
    telemetry = telemetry_lib.Telemetry(cfg.schedule.run_dir, lambda: _watched_pids(cfg.schedule.run_dir),
                                        cfg.resources.telemetry_period_s, cfg.schedule.trace_dir).start()
  try:
    summary = SCHEDULES[cfg.schedule.name](cfg)
  finally:
    means = telemetry.stop() if telemetry is not None else None
  return _finish(cfg, summary, means)
