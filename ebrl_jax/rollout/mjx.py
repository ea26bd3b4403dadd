"""Pure rollout stages for JAX-native (MJX) simulation: policy steps composed with env steps in a `lax.scan`.

These are what the fused MJX schedule jits into one program per iteration (as Brax's PPO does). They import only
stage modules, so other JAX projects can use them too:
`from ebrl_jax.rollout import mjx as rollout; jax.jit(rollout.collect_segment, static_argnums=(0, 1, 5, 6))`.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

import jax
import jax.numpy as jnp

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.sim import render
from ebrl_jax.sim import stages as sim_stages


def make_env(sim: config_lib.SimConfig, auto_reset: bool):
  """The batched MJX env of `sim` (memoised): its task, backend's implementation and randomisation, and with
  `--obs=pixels` (on `--backend=mjx_warp`) the square camera that the simulation stage renders and stacks."""
  return sim_stages.make_mjx_env(sim.task,
                                 sim.episode_length,
                                 sim.action_repeat,
                                 auto_reset=auto_reset,
                                 impl=sim_stages.impl_for_backend(sim.backend),
                                 randomization=sim.randomization,
                                 camera=render.camera_of(sim),
                                 solver=(sim.solver_iterations, sim.ls_iterations))


def collect_segment(env: Any,
                    network: Any,
                    params: gen_stages.PolicyParams,
                    policy_version: jax.Array,
                    env_state: Any,
                    num_steps: int,
                    episodic: bool,
                    key: types.PRNGKey,
                    active: jax.Array,
                    min_std: float = 0.001) -> Tuple[Any, jax.Array, types.Transition, types.EpisodeStats]:
  """Runs `num_steps` policy steps (each an action chunk of K env steps) for every env of `env_state`.

  Args:
    active: [B] 1.0 for envs whose episode is still running. Only episodic (GRPO) rollouts use it: an env whose
      episode has ended keeps stepping but its transitions get mask 0. Continuing rollouts pass ones.
  Returns:
    (env_state, active, segment with leading [T, B], episode statistics).
  """

  def body(carry, step_key):
    env_state, active = carry
    out = gen_stages.act(network, params, sim_stages.observation(env_state), step_key, min_std=min_std)
    env_state, active, transition, stats = step_transition(env, env_state, active, out, policy_version, episodic)
    return (env_state, active), (transition, stats)

  keys = jax.random.split(key, num_steps)
  (env_state, active), (segment, stats) = jax.lax.scan(body, (env_state, active), keys)
  stats = jax.tree.map(jnp.sum, stats)
  return env_state, active, segment, stats


def step_transition(env: Any, env_state: Any, active: jax.Array, out: gen_stages.ActOutput, policy_version: jax.Array,
                    episodic: bool) -> Tuple[Any, jax.Array, types.Transition, types.EpisodeStats]:
  """The simulation half of one policy step: the env steps the action chunk `out` (actions [B, K, A], raw
  actions, log-probs [B]) chose for `env_state`'s observations. Returns (env_state, active, the step's transition
  [B, ...], the episodes it finished). `collect_segment` and the rollout worker a generation worker serves
  (rollout/mjx_remote.py) both step through it, so a served step is a co-located one given the same actions.
  `policy_version`: [] or [B] int32."""
  obs = sim_stages.observation(env_state)  # a PixelObs with --obs=pixels
  env_state, res = sim_stages.step_chunk(env, env_state, out.actions)
  done = res.done.astype(jnp.float32)
  truncation = res.truncation.astype(jnp.float32)
  mask = active if episodic else jnp.ones_like(done)
  transition = types.Transition(obs=obs,
                                raw_action=out.raw_actions,
                                reward=res.reward * mask,
                                termination=done * (1.0 - truncation),
                                truncation=truncation,
                                next_obs=res.obs,
                                behaviour_log_prob=out.log_probs,
                                mask=mask,
                                policy_version=jnp.broadcast_to(jnp.asarray(policy_version, jnp.int32), done.shape))
  finished = done * mask
  stats = types.EpisodeStats(jnp.sum(res.episode_return * finished), jnp.sum(res.episode_length * finished),
                             jnp.sum(finished))
  if episodic:
    active = active * (1.0 - done)
  return env_state, active, transition, stats


def evaluate_policy(env: Any,
                    network: Any,
                    params: gen_stages.PolicyParams,
                    key: types.PRNGKey,
                    num_envs: int,
                    num_steps: int,
                    min_std: float = 0.001,
                    deterministic: bool = True) -> Tuple[jax.Array, jax.Array]:
  """The policy (its mode, or sampled) on `num_envs` fresh envs for one episode each: mean return and length.

  `env` must be built without auto-reset; steps after an env's episode ended do not count.
  """
  reset_key, act_key = jax.random.split(key)
  env_state = sim_stages.reset(env, reset_key, num_envs)

  def body(carry, step_key):
    env_state, active, ret, length = carry
    out = gen_stages.act(network,
                         params,
                         sim_stages.observation(env_state),
                         step_key,
                         deterministic=deterministic,
                         min_std=min_std)
    env_state, res = sim_stages.step_chunk(env, env_state, out.actions)
    ret = ret + res.reward * active
    steps = jnp.asarray(out.actions.shape[1], jnp.float32)  # K env steps per policy step
    length = length + steps * active
    active = active * (1.0 - res.done.astype(jnp.float32))
    return (env_state, active, ret, length), None

  ones = jnp.ones((num_envs,), jnp.float32)
  init = (env_state, ones, jnp.zeros_like(ones), jnp.zeros_like(ones))
  (_, _, ret, length), _ = jax.lax.scan(body, init, jax.random.split(act_key, num_steps))
  return jnp.mean(ret), jnp.mean(length)


def merge_unrolls(segments: types.Transition) -> types.Transition:
  """[U, T, B, ...] (U unrolls of T steps for B envs) -> [T, U*B, ...]: each (unroll, env) pair is a segment."""

  def merge(x):
    x = jnp.swapaxes(x, 0, 1)  # [T, U, B, ...]
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])

  return jax.tree.map(merge, segments)


def collect_iteration(env, network, spec: config_lib.CollectSpec, num_envs: int, params, version, env_state, key):
  """One iteration's collection for `num_envs` envs: `spec.unrolls` unrolls of `spec.steps` policy steps each
  (PPO), or one episode each after a group reset (GRPO). Returns (env_state, segments [T, S, ...], summed
  types.EpisodeStats). Shared by the fused MJX program and the MJX rollout workers."""
  active = jnp.ones((num_envs,), jnp.float32)
  if spec.episodic:
    reset_key, key = jax.random.split(key)
    env_state = sim_stages.reset(env, reset_key, num_envs, spec.group_size)
    env_state, _, batch, stats = collect_segment(env, network, params, version, env_state, spec.steps, True, key,
                                                 active, spec.min_std)
    return env_state, batch, stats

  def unroll(env_state, unroll_key):
    env_state, _, segment, stats = collect_segment(env, network, params, version, env_state, spec.steps, False,
                                                   unroll_key, active, spec.min_std)
    return env_state, (segment, stats)

  env_state, (segments, stats) = jax.lax.scan(unroll, env_state, jax.random.split(key, spec.unrolls))
  return env_state, merge_unrolls(segments), jax.tree.map(jnp.sum, stats)
