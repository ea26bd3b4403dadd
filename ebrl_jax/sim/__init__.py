"""Simulation: the task registry, the native-MuJoCo env pool and the MJX stages.

The registry is imported eagerly (it is light); `CpuEnvPool` (mujoco) and the MJX stages (brax, mujoco.mjx)
are imported on first use:

    from ebrl_jax import sim
    pool = sim.CpuEnvPool('hopper', num_envs=64, episode_length=1000)
    from ebrl_jax.sim import stages as sim_stages
"""
from __future__ import annotations

import importlib

from ebrl_jax.sim import gl_check  # first: it checks MUJOCO_GL before any module here imports mujoco
from ebrl_jax.sim.registry import TaskDef, env_spec, get_default_config, load, names, register, spec_of

_LAZY = {
    'CpuEnvPool': ('ebrl_jax.sim.cpu_env', 'CpuEnvPool'),
    'EnvGroupState': ('ebrl_jax.sim.stages', 'EnvGroupState'),
    'make_mjx_env': ('ebrl_jax.sim.stages', 'make_mjx_env'),
    'reset': ('ebrl_jax.sim.stages', 'reset'),
    'step': ('ebrl_jax.sim.stages', 'step'),
    'step_chunk': ('ebrl_jax.sim.stages', 'step_chunk'),
}

__all__ = ['TaskDef', 'env_spec', 'get_default_config', 'load', 'names', 'register', 'spec_of', *_LAZY]


def __getattr__(name: str):
  if name in _LAZY:
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
