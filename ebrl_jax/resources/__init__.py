"""Resource management for the process schedules: the MPS daemon and SM quotas (`mps`), CPU cores (`cpus`),
stage profiles (`profiles`) and the planner (`planner`)."""
import os
import sys
from typing import Dict, Optional

from ebrl_jax.resources import cpus


def apply_worker_env(env: Optional[Dict[str, str]]) -> None:
  """First thing a worker process does: take its environment (MPS pipe and quota, memory share, ...) and pin
  itself to its cores (`EBRL_CPUS`), before JAX or an env pool starts."""
  if env:
    os.environ.update(env)
    if env.get('JAX_PLATFORMS') and 'jax' in sys.modules:  # JAX read its platform variable at import
      sys.modules['jax'].config.update('jax_platforms', env['JAX_PLATFORMS'])
  if os.environ.get('EBRL_CPUS'):
    cpus.pin(cpus.decode(os.environ['EBRL_CPUS']))


def pin_after_startup() -> None:
  """A GPU feeder (trainer, generation, MJX rollout) calls this once its programs are compiled: it takes its own
  core (`EBRL_CPUS_AFTER_STARTUP`) only then, because XLA compiles on many threads. Pinned to one core from the
  start, a W3 trainer and generation worker spent ~200 s compiling on the H200 machine (GPU idle) before the first
  iteration. Later calls do nothing."""
  text = os.environ.pop('EBRL_CPUS_AFTER_STARTUP', '')
  if text:
    cpus.pin(cpus.decode(text))
