"""Entry point of the controller: `run(config)` configures JAX and dispatches to the schedule by name."""
from __future__ import annotations

import os
from typing import Callable, Dict

from absl import logging

from ebrl_jax import config as config_lib


class RunError(RuntimeError):
  """The run stopped for a reason the user must act on (a dead trainer, say); the message says what to do."""


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


def run(cfg: config_lib.Config):
  """Runs `cfg` with its schedule; returns the schedule's summary."""
  if cfg.schedule.name not in SCHEDULES:
    raise ValueError(f'--schedule={cfg.schedule.name!r} is not valid; allowed values: {", ".join(SCHEDULES)}.')
  configure_jax(cfg)
  from ebrl_jax.controller import metrics  # pylint: disable=g-import-not-at-top
  metrics.quiet_library_logs()
  return SCHEDULES[cfg.schedule.name](cfg)
