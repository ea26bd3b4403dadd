"""An MJX env group for a rollout worker: one jitted program collects the group's share of an iteration."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax.rollout import mjx as mjx_rollout
from ebrl_jax.sim import stages as sim_stages


class MjxGroup:
  """Holds the group's env state on the device between collections."""

  def __init__(self, cfg: config_lib.Config, group: int, network):
    num_envs = cfg.sim.num_envs // cfg.schedule.num_groups
    env = sim_stages.make_mjx_env(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat,
                                  auto_reset=cfg.algo.name != 'grpo')
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.schedule.seed + 1), 1_000_003 + group)
    self._env_state = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))(env, key, num_envs, cfg.sim.group_size)
    self._program = jax.jit(functools.partial(mjx_rollout.collect_iteration, cfg, env, network, num_envs),
                            donate_argnums=(2,))

  def collect(self, params, version: int, key):
    self._env_state, batch, stats = self._program(params, jnp.int32(version), self._env_state, key)
    batch, stats = jax.device_get((batch, stats))
    return [np.asarray(x) for x in batch], (float(stats.return_sum), float(stats.length_sum), float(stats.count))

  def close(self):
    pass
