"""Stage calibration: each stage timed alone, compile excluded, at given batch sizes, in this process.

What is timed (one "call" of each stage, the unit the pipeline hands around):
  sim         one unroll (unroll_length env steps) of a group of E envs with fixed random actions:
              MJX: one jitted scan of `sim.stages.step_chunk`; native MuJoCo: `CpuEnvPool.step` per policy step;
  generation  the policy for the same unroll on E observations: one jitted scan of `generation.stages.act`
              (MJX), or `generation.stages.make_act` per policy step with host<->device copies (native MuJoCo);
  train       one `trainer.stages.train_step` on a whole iteration's batch, from a real collected rollout.

`per_env_step` divides each by the env steps it stands for (E * unroll_length for sim and generation, the
iteration's env steps for train): t_sim, t_gen, t_train of docs/benchmarks.md. Sequential floor 1 / (t_sim + t_gen +
t_train) and perfect-overlap ceiling 1 / max(...) follow. Each call is run `repeats` times after one warm-up
call (which compiles); the median is kept, and every sample is returned for the profile store.

The SM quota of the samples is this process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (100 without one): to
profile at a quota, run the calibration in a process started with that variable under an MPS daemon.

Device memory: after each group size's sim and generation, and after training, the process's high-water mark
(`memory_stats()['peak_bytes_in_use']` of the first device; None on the CPU, which keeps no statistics) is
recorded as that stage's `peak_bytes_in_use`. Each includes what was allocated before it (the train state; the
smaller group sizes, which run first), so it is an upper bound of the stage's own peak. The memory plan
(`resources.memory`, `--memory_profile`) raises its estimates to these.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import sim
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.sim import cpu_env
from ebrl_jax.trainer import stages as trainer_stages


def current_quota() -> int:
  """This process's SM quota in percent (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), 100 when unset."""
  value = os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')
  try:
    return max(1, min(100, int(float(value)))) if value else 100
  except ValueError:
    return 100


def peak_bytes_in_use() -> Optional[int]:
  """This process's high-water mark of device memory so far; None where the device keeps no statistics."""
  value = (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use')
  return None if value is None else int(value)


def _timed(fn: Callable[[], object], repeats: int) -> List[float]:
  fn()  # warm-up: compiles
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def _mjx_sim_gen(cfg, network, params, envs: int, repeats: int, env) -> Dict[str, List[float]]:
  from ebrl_jax.sim import stages as sim_stages  # lazy: brax and MJX load only when a calibration runs
  k = cfg.policy.action_chunk
  steps = cfg.algo.unroll_length // k
  state = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(0), envs, cfg.sim.group_size)
  action_dim = env.action_size
  actions = jax.random.uniform(jax.random.PRNGKey(1), (steps, envs, k, action_dim), minval=-1.0, maxval=1.0)

  @jax.jit
  def sim_unroll(state, actions):

    def body(s, a):
      s, res = sim_stages.step_chunk(env, s, a)
      return s, jnp.sum(res.reward)

    return jax.lax.scan(body, state, actions)

  obs = state.brax_state.obs

  @jax.jit
  def gen_unroll(params, obs, key):

    def body(acc, step_key):
      out = gen_stages.act(network, params, obs + acc[:, None] * 0.0, step_key, min_std=cfg.policy.min_std)
      return acc + out.log_probs, None

    acc, _ = jax.lax.scan(body, jnp.zeros(obs.shape[0]), jax.random.split(key, steps))
    return acc

  box = {'state': state}

  def run_sim():
    box['state'], rewards = sim_unroll(box['state'], actions)
    jax.block_until_ready(rewards)

  return {
      'sim': _timed(run_sim, repeats),
      'generation': _timed(lambda: jax.block_until_ready(gen_unroll(params, obs, jax.random.PRNGKey(2))), repeats)
  }


def _cpu_sim_gen(cfg, network, params, envs: int, repeats: int, threads: int = 0) -> Dict[str, List[float]]:
  k = cfg.policy.action_chunk
  steps = cfg.algo.unroll_length // k
  rng = np.random.default_rng(0)
  with cpu_env.CpuEnvPool(cfg.sim.task,
                          envs,
                          cfg.sim.episode_length,
                          cfg.sim.action_repeat,
                          num_threads=threads or cfg.sim.num_threads,
                          seed=0) as pool:
    obs = pool.reset()
    spec = pool.spec
    actions = rng.uniform(-1.0, 1.0, (steps, envs, k, spec.action_dim)).astype(np.float32)

    def run_sim():
      for t in range(steps):
        pool.step(actions[t])

    sim = _timed(run_sim, repeats)
  act = gen_stages.make_act(network, cfg.policy.min_std)
  key = jax.random.PRNGKey(2)

  def run_gen():
    for t in range(steps):
      out = act(params, obs, key, t)
      np.asarray(out.actions)  # the host copy the sim worker waits for

  return {'sim': sim, 'generation': _timed(run_gen, repeats)}


def _train(cfg, env, network, optimizer, train_state, repeats: int) -> List[float]:
  """train_step on one real iteration batch (collected by the fused collection stage on MJX, or made of the
  right shapes from the native pool's observations)."""
  from ebrl_jax.rollout import mjx as rollout  # lazy: as above
  from ebrl_jax.sim import stages as sim_stages  # lazy: brax and MJX load only when a calibration runs
  n = cfg.sim.num_envs
  state = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(3), n, cfg.sim.group_size)
  collect = jax.jit(lambda p, v, s, key: rollout.collect_iteration(env, network, cfg.collect_spec, n, p, v, s, key))
  _, batch, _ = collect(train_state.params, train_state.policy_version, state, jax.random.PRNGKey(4))
  step = jax.jit(trainer_stages.train_step,
                 static_argnums=(0, 1, 2, 3),
                 static_argnames=('group_size', 'recompute_proximal'),
                 donate_argnums=(4,))
  box = {'state': train_state}

  def run():
    box['state'], metrics = step(network,
                                 optimizer,
                                 cfg.algo,
                                 cfg.policy.min_std,
                                 box['state'],
                                 batch,
                                 jax.random.PRNGKey(5),
                                 group_size=cfg.sim.group_size,
                                 recompute_proximal=cfg.schedule.name == 'async')
    jax.block_until_ready(metrics)

  return _timed(run, repeats)


def profile_stages(cfg, envs_per_group: Sequence[int], repeats: int = 5, all_groups_threads: bool = False) -> dict:
  """Times sim and generation at each group size and training once; see the module doc for what and how.

  Returns {'quota', 'device', 'backend', 'num_params', 'steps_per_iteration', 'train': {...}, 'groups': {E: {...}}},
  each stage with 'samples_s', 'median_s', 'per_env_step_s'; per group size also the sequential floor and overlap
  ceiling (env steps/s) for that group size with the iteration's training; 'train' and each group size with
  'peak_bytes_in_use' (see the module doc).

  Native MuJoCo with `all_groups_threads` and --num_threads > 0: a batch of E envs is stepped with the threads
  the run gives them, --num_threads per group of num_envs / num_groups (so the whole batch stands for every
  group stepping at once, the overlap ceiling's case); otherwise with --num_threads, one group's (the planner's
  case: a group's time at each group size it may choose). The count is recorded per size as 'sim_threads'.
  """
  from ebrl_jax.sim import stages as sim_stages  # lazy: brax and MJX load only when a calibration runs
  if cfg.algo.episodic:
    raise ValueError('calibration times PPO unrolls; --algo=grpo is not supported by it yet.')
  for e in envs_per_group:
    if e <= 0:
      raise ValueError(f'calibration batch size {e} must be > 0.')
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  train_state = trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(cfg.schedule.seed), spec.obs_dim,
                                                cfg.policy.normalize_observations)
  unroll_steps = cfg.algo.unroll_length * cfg.sim.action_repeat  # env steps per env in one sim/gen call
  iteration_steps = cfg.env_steps_per_iteration

  def stage(samples, env_steps):
    med = statistics.median(samples)
    return {'samples_s': samples, 'median_s': med, 'per_env_step_s': med / env_steps, 'env_steps': env_steps}

  out = {
      'quota': current_quota(),
      'device': str(jax.devices()[0].device_kind),
      'backend': cfg.sim.backend,
      'num_params': policies.count_params(train_state.params.network),
      'steps_per_iteration': iteration_steps,
      'groups': {}
  }
  # One MJX env serves the MJX sim/generation timings and the training batch (collected on MJX for every backend;
  # native-MuJoCo runs time their CPU pool separately).
  impl = 'jax' if cfg.sim.backend == 'mujoco_cpu' else sim_stages.impl_for_backend(cfg.sim.backend)
  mjx_env = sim_stages.make_mjx_env(cfg.sim.task,
                                    cfg.sim.episode_length,
                                    cfg.sim.action_repeat,
                                    auto_reset=not cfg.algo.episodic,
                                    impl=impl)
  times, peaks, threads = {}, {}, {}
  for e in sorted({int(e) for e in envs_per_group}):  # smallest first: each peak bounds its own size's
    if cfg.sim.backend != 'mujoco_cpu':
      times[e] = _mjx_sim_gen(cfg, network, train_state.params, e, repeats, env=mjx_env)
    else:
      threads[e] = cfg.sim.num_threads * (max(1, e // cfg.group_envs) if all_groups_threads else 1)
      times[e] = _cpu_sim_gen(cfg, network, train_state.params, e, repeats, threads=threads[e])
    peaks[e] = peak_bytes_in_use()
  train = stage(_train(cfg, mjx_env, network, optimizer, train_state, repeats), iteration_steps)  # donates train_state
  train['peak_bytes_in_use'] = peak_bytes_in_use()
  out['train'] = train
  for e in envs_per_group:
    entry = {name: stage(samples, int(e) * unroll_steps) for name, samples in times[int(e)].items()}
    entry['peak_bytes_in_use'] = peaks[int(e)]
    if threads:
      entry['sim_threads'] = threads[int(e)] or None  # None: one per available core
    per_step = [entry['sim']['per_env_step_s'], entry['generation']['per_env_step_s'], train['per_env_step_s']]
    entry['sequential_floor_steps_per_s'] = 1.0 / sum(per_step)
    entry['overlap_ceiling_steps_per_s'] = 1.0 / max(per_step)
    out['groups'][str(int(e))] = entry
  return out


def add_to_store(store, profile: dict) -> None:
  """Feeds a calibration into a `profiles.ProfileStore` in the planner's units: 'sim' and 'generation' are the
  seconds of one env step of a batch of E envs (an unroll's time over its env steps per env), 'train' the seconds
  of one train_step on an iteration's batch (batch = the iteration's env steps)."""
  q = profile['quota']
  for e, entry in profile['groups'].items():
    for name in ('sim', 'generation'):
      steps_per_env = entry[name]['env_steps'] / int(e)
      for t in entry[name]['samples_s']:
        store.profile(name).add_sample(int(e), q, t / steps_per_env)
  for t in profile['train']['samples_s']:
    store.profile('train').add_sample(profile['steps_per_iteration'], q, t)


def calibrate_main(cfg,
                   envs_per_group: Sequence[int],
                   repeats: int,
                   out_path: str,
                   env=None,
                   all_groups_threads: bool = False) -> None:
  """Process entry point: applies the worker environment (SM quota, memory share), profiles, writes JSON."""
  startup.apply_worker_env(env)
  startup.configure_jax(cfg.resources.platform, cfg.schedule.compilation_cache_dir)
  profile = profile_stages(cfg, envs_per_group, repeats, all_groups_threads)
  storage.write_json(out_path, profile, indent=2, allow_nan=False)
