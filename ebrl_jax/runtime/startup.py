"""Process start-up: the worker environment and core pinning, and JAX's platform and persistent compilation cache.

Every process of a run calls `apply_worker_env` first (before JAX starts a backend or an env pool starts its
threads) and `configure_jax` before it compiles.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence

from absl import logging

from ebrl_jax.runtime import storage


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  """What every worker process of a run needs to start, whatever its role: where the run writes, the timeline's
  directory ('' off), the JAX platform ('' lets JAX choose), the persistent compilation cache ('' off) and the
  trace cache inside it (`trace_cache.cache_dir_for`; '' off)."""
  run_dir: str
  trace_dir: str = ''
  platform: str = ''
  compilation_cache_dir: str = ''
  trace_cache_dir: str = ''


def pin(cores: Sequence[int]) -> None:
  """Restricts this process (and the threads it starts later) to `cores`."""
  os.sched_setaffinity(0, set(cores))


def encode_cores(cores: Sequence[int]) -> str:
  return ','.join(str(c) for c in cores)


def decode_cores(text: str) -> List[int]:
  try:
    return [int(c) for c in text.split(',') if c.strip()]
  except ValueError as e:
    raise ValueError(f'EBRL_CPUS={text!r} must be a comma-separated list of core numbers.') from e


def apply_worker_env(env: Optional[Dict[str, str]]) -> None:
  """First thing a worker process does: take its environment (MPS pipe and quota, memory share, ...) and pin
  itself to its cores (`EBRL_CPUS`), before JAX or an env pool starts."""
  if env:
    os.environ.update(env)
    if env.get('JAX_PLATFORMS') and 'jax' in sys.modules:  # JAX read its platform variable at import
      sys.modules['jax'].config.update('jax_platforms', env['JAX_PLATFORMS'])
  if os.environ.get('EBRL_CPUS'):
    pin(decode_cores(os.environ['EBRL_CPUS']))


def pin_after_startup() -> None:
  """A GPU feeder (trainer, generation, MJX rollout) calls this once its programs are compiled: it takes its own
  core (`EBRL_CPUS_AFTER_STARTUP`) only then, because XLA compiles on many threads (pinned to one core from the
  start, a trainer compiles for minutes while the GPU idles). Later calls do nothing."""
  text = os.environ.pop('EBRL_CPUS_AFTER_STARTUP', '')
  if text:
    pin(decode_cores(text))


# MuJoCo Warp's compiled kernels (warp-lang's cache) go here inside the compilation cache, unless WARP_CACHE_PATH
# says otherwise: one flag keeps both caches (a cold Warp cache cost 67 s of W1's start-up on the H200).
WARP_CACHE_SUBDIR = 'warp'


def configure_jax(platform: str, compilation_cache_dir: str) -> None:
  """Platform choice ('' lets JAX choose), JAX's persistent compilation cache ('' disables it) and, inside it,
  Warp's kernel cache (`WARP_CACHE_SUBDIR`, set through WARP_CACHE_PATH before Warp starts; a WARP_CACHE_PATH
  already set is kept)."""
  import jax  # lazy: a worker sets its environment (apply_worker_env) before JAX is imported
  if platform:
    jax.config.update('jax_platforms', platform)
  if compilation_cache_dir:
    cache_dir = os.path.abspath(os.path.expanduser(compilation_cache_dir))
    # NOTE: JAX loads and runs the executables it finds there: a cache others can write to is refused.
    storage.ensure_private_dir(cache_dir, '--compilation_cache_dir', group_may_write=False)
    jax.config.update('jax_compilation_cache_dir', cache_dir)
    # Every program is kept, the small ones too: under a 0.5 s threshold a warm W1 start compiled ~130 programs of a
    # few ms each again (copies, conversions, key folds; JAX_LOG_COMPILES=1 lists them).
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    os.environ.setdefault('WARP_CACHE_PATH', os.path.join(cache_dir, WARP_CACHE_SUBDIR))
    logging.info('Persistent compilation cache: %s (Warp kernels: %s)', cache_dir, os.environ['WARP_CACHE_PATH'])


def start_process(process: ProcessConfig, env: Optional[Dict[str, str]]) -> None:
  """A worker's first call: its environment and cores (`apply_worker_env`), then JAX's platform and cache."""
  apply_worker_env(env)
  configure_jax(process.platform, process.compilation_cache_dir)
