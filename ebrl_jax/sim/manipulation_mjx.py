"""`push_cube` as a Brax `PipelineEnv` on MJX, registered with Brax as `ebrl_push_cube`.

    from ebrl_jax.sim import manipulation_mjx  # registers the env (registry.load('push_cube') imports this)
    env = brax.envs.get_environment('ebrl_push_cube', backend='mjx')

Observation, reward, termination and the reset's mapping from uniforms are the functions of
`ebrl_jax.sim.manipulation` applied with `jax.numpy` to one env, with the task's `TaskDef` (frame skip,
parameters); only the uniforms come from `jax.random` instead of numpy. The model is loaded with Brax's
loader from the same MJCF as the native-MuJoCo pool's.
"""
from __future__ import annotations

import jax
from jax import numpy as jnp

from brax import envs as brax_envs
from brax.envs import base as brax_base
from brax.io import mjcf

from ebrl_jax.sim import manipulation
from ebrl_jax.sim import registry

BRAX_NAME = 'ebrl_push_cube'


def _frame(pipeline_state) -> dict:
  return {'qpos': pipeline_state.q, 'qvel': pipeline_state.qd, 'site_xpos': pipeline_state.site_xpos}


class PushCube(brax_base.PipelineEnv):
  """A planar arm pushes a cube onto a target; obs [31], action [3] in [-1, 1] (motor torques)."""

  def __init__(self, backend: str = 'mjx', **kwargs):
    task = registry.load('push_cube')
    sys = mjcf.load(task.xml_path)
    manipulation.check_layout(sys.mj_model)
    kwargs.setdefault('n_frames', task.n_frames)
    super().__init__(sys=sys, backend=backend, **kwargs)
    self._params = dict(task.params)

  def reset(self, rng: jax.Array) -> brax_base.State:
    u = jax.random.uniform(rng, (manipulation.NUM_UNIFORMS,))
    q, qd = manipulation.reset_from_uniform(u, self.sys.init_q, self._params, xp=jnp)
    pipeline_state = self.pipeline_init(q, qd)
    zero = jnp.zeros(())
    metrics = {'reach_dist': zero, 'push_dist': zero, 'success': zero}
    return brax_base.State(pipeline_state, manipulation.observation(_frame(pipeline_state), xp=jnp), zero, zero,
                           metrics)

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    pipeline_state = self.pipeline_step(state.pipeline_state, action)
    frame = _frame(pipeline_state)
    terms = manipulation.reward_terms(frame, action, self._params, xp=jnp)
    reward = manipulation.reward(terms, self._params, xp=jnp)
    state.metrics.update(reach_dist=terms.reach_dist,
                         push_dist=terms.push_dist,
                         success=terms.success.astype(jnp.float32))
    return state.replace(pipeline_state=pipeline_state,
                         obs=manipulation.observation(frame, xp=jnp),
                         reward=reward,
                         done=terms.done.astype(jnp.float32))


brax_envs.register_environment(BRAX_NAME, PushCube)
