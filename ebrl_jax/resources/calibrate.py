"""Stage calibration: each stage timed alone, compile excluded, at given batch sizes, in this process.

What is timed (one "call" of each stage, the unit the pipeline hands around):
  sim         one unroll (`timed_unroll_steps` policy steps) of a group of E envs with fixed random actions:
              MJX: one jitted scan of `sim.stages.step_chunk`; native MuJoCo: `CpuEnvPool.step` per policy step;
  generation  the policy for the same unroll on E observations: one jitted scan of `generation.stages.act`
              (MJX), or `generation.stages.make_act` per policy step with host<->device copies (native MuJoCo);
  train       one `trainer.stages.train_step` on a whole iteration's batch (`train_batch` below).

With camera observations (`--obs=pixels`) the sim stage renders as the run's does (the native pool with its camera,
`rollout.cpu.make_pool`; the MJX-Warp env of `rollout.mjx.make_env`, whose step renders), generation and training
take the `types.PixelObs` it ended on.

`per_env_step` divides each by the env steps it stands for (E * the unroll's env steps for sim and generation, the
iteration's env steps for train): t_sim, t_gen, t_train of docs/benchmarks.md. Sequential floor 1 / (t_sim + t_gen +
t_train) and perfect-overlap ceiling 1 / max(...) follow. Each call is run `repeats` times after one warm-up
call (which compiles); the median is kept, and every sample is returned for the profile store.

The training batch has the iteration's exact shapes and dtypes (`types.transition_template`, what the rollout
hands the trainer) and is made of the stages' own output, not of a collection program of its own: the
observations the sim stage's last timed unroll ended on (its largest group size; repeated over envs when the run
has more), the actions and behaviour log-probs the policy (`generation.stages.make_act`) gives for them, so PPO's
ratios start at 1 as on a real first epoch, repeated over the iteration's steps and unrolls; rewards are seeded
normal draws, no episode ends, every mask 1, the train state's policy version. With --algo=grpo the iteration's
shapes are one whole episode per env (`Config.segment_shape`) and the train step takes the run's GRPO groups.
train_step is dense arithmetic (no branch or loop on the data), so its time depends on these shapes, not on the
values. Earlier versions
compiled the fused MJX collection program (and for native MuJoCo an MJX env) only to make this batch: most of a
native-MuJoCo calibration's time on the CPU (experiments/results/calibration_cost_cpu.json).

Where the time goes: `phase_s` records each phase's wall seconds (setup, env build, each group size, the
training batch, training) and `warmup_s` each stage's first (compiling) call, so a slow calibration says why.

The SM quota of the samples is this process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (100 without one): to
profile at a quota, run the calibration in a process started with that variable under an MPS daemon.

Device memory: after each group size's sim and generation, and after training, the process's high-water mark
(`memory_stats()['peak_bytes_in_use']` of the first device; None on the CPU, which keeps no statistics) is
recorded as that stage's `peak_bytes_in_use`. Each includes what was allocated before it (the train state; the
smaller group sizes, which run first; on MJX the largest size's reset state, which the smaller sizes' states are
cut from so that reset compiles once), so it is an upper bound of the stage's own peak. The memory plan
(`resources.memory`, `--memory_profile`) raises its estimates to these.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.rollout import cpu as cpu_rollout
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


class Timed(NamedTuple):
  """What `_timed` measured: the warm-up call's seconds (it compiles) and each timed call's."""
  warmup_s: float
  samples_s: List[float]


def _timed(fn: Callable[[], object], repeats: int) -> Timed:
  """`repeats` timed calls after one warm-up call."""
  t0 = time.perf_counter()
  fn()
  warmup = time.perf_counter() - t0
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return Timed(warmup, out)


class _Phases:
  """Wall seconds of each phase of a calibration, in order (`lap(name)` closes the phase that ran since the last)."""

  def __init__(self):
    self.seconds: Dict[str, float] = {}
    self._t0 = time.perf_counter()

  def lap(self, name: str) -> None:
    now = time.perf_counter()
    self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t0
    self._t0 = now


def _mjx_reset(cfg, env, sizes: Sequence[int]):
  """`reset(E)` for each group size E, compiled once: the largest size's state, whose first E envs (whole reset
  groups: every size is a multiple of --group_size) are the state of E envs. Where a leaf has no env axis in
  front, each size is reset on its own."""
  from ebrl_jax.sim import stages as sim_stages  # lazy: brax and MJX load only when a calibration runs
  reset = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))
  n = max(sizes)
  full = reset(env, jax.random.PRNGKey(0), n, cfg.sim.group_size)
  if all(x.ndim and x.shape[0] == n for x in jax.tree.leaves(full)):
    first = jax.jit(lambda state, e: jax.tree.map(lambda x: x[:e], state), static_argnums=(1,))
    return lambda e: full if e == n else first(full, e)
  return lambda e: reset(env, jax.random.PRNGKey(0), e, cfg.sim.group_size)


def timed_unroll_steps(cfg) -> int:
  """Policy steps of the one sim and generation call timed here (`cfg` a `config.Config`): a PPO segment's; GRPO,
  whose segment is a whole episode, times --unroll_length's worth (within the episode) rounded down to whole action
  chunks, at least one."""
  k = cfg.policy.action_chunk
  if cfg.algo.episodic:
    return max(1, min(cfg.algo.unroll_length, cfg.sim.episode_length) // k)
  return cfg.algo.unroll_length // k


def _mjx_sim_gen(cfg, network, params, state, repeats: int, env) -> dict:
  """{'sim': Timed, 'generation': Timed, 'obs': the observations of E envs the last timed unroll ended on (a
  `types.PixelObs` with a camera: the sim stage renders), from `state` (E envs just reset)."""
  from ebrl_jax.sim import stages as sim_stages  # lazy: brax and MJX load only when a calibration runs
  k = cfg.policy.action_chunk
  steps = timed_unroll_steps(cfg)
  envs = state.episode_return.shape[0]
  action_dim = env.action_size
  actions = jax.random.uniform(jax.random.PRNGKey(1), (steps, envs, k, action_dim), minval=-1.0, maxval=1.0)

  @jax.jit
  def sim_unroll(state, actions):

    def body(s, a):
      s, res = sim_stages.step_chunk(env, s, a)
      return s, jnp.sum(res.reward)

    return jax.lax.scan(body, state, actions)

  obs = sim_stages.observation(state)

  @jax.jit
  def gen_unroll(params, obs, key):

    def body(acc, step_key):  # every input depends on the carry, so XLA cannot hoist any of act out of the loop
      step_obs = jax.tree.map(lambda x: x + (acc.reshape((-1,) + (1,) * (x.ndim - 1)) * 0.0).astype(x.dtype), obs)
      out = gen_stages.act(network, params, step_obs, step_key, min_std=cfg.policy.min_std)
      return acc + out.log_probs, None

    acc, _ = jax.lax.scan(body, jnp.zeros(envs), jax.random.split(key, steps))
    return acc

  box = {'state': state}

  def run_sim():
    box['state'], rewards = sim_unroll(box['state'], actions)
    jax.block_until_ready(rewards)

  sim_timed = _timed(run_sim, repeats)
  gen = _timed(lambda: jax.block_until_ready(gen_unroll(params, obs, jax.random.PRNGKey(2))), repeats)
  return {'sim': sim_timed, 'generation': gen, 'obs': jax.tree.map(np.asarray, sim_stages.observation(box['state']))}


def _cpu_sim_gen(cfg, act, params, envs: int, repeats: int, threads: int) -> dict:
  """As `_mjx_sim_gen`, for native MuJoCo: the pool's steps (rendering with a camera, as the run's pool does:
  `rollout.cpu.make_pool`), then the policy on its last observations."""
  k = cfg.policy.action_chunk
  steps = timed_unroll_steps(cfg)
  rng = np.random.default_rng(0)
  sim = dataclasses.replace(cfg.sim, num_threads=threads or cfg.sim.num_threads)
  with cpu_rollout.make_pool(sim, envs, seed=0, auto_reset=True) as pool:
    box = {'obs': cpu_rollout.observe(pool, pool.reset())}
    spec = pool.spec
    actions = rng.uniform(-1.0, 1.0, (steps, envs, k, spec.action_dim)).astype(np.float32)

    def run_sim():
      for t in range(steps):
        box['obs'] = cpu_rollout.observe(pool, pool.step(actions[t]).obs)

    sim_timed = _timed(run_sim, repeats)
  key = jax.random.PRNGKey(2)
  obs = box['obs']

  def run_gen():
    for t in range(steps):
      out = act(params, obs, key, t)
      np.asarray(out.actions)  # the host copy the sim worker waits for

  return {'sim': sim_timed, 'generation': _timed(run_gen, repeats), 'obs': jax.tree.map(np.asarray, obs)}


def train_batch(cfg, spec: types.EnvSpec, act, params, version, obs) -> types.Transition:
  """One iteration's training batch [T, S] (the module doc): `obs` of E envs ([E, O], or a `types.PixelObs` with
  a camera) repeated to the run's envs, the policy's actions and log-probs for them (`act`, a `make_act`),
  repeated over the iteration's T steps and unrolls."""
  unrolls, steps = cfg.segment_shape
  n = cfg.sim.num_envs
  template = types.transition_template(steps, unrolls * n, spec.obs_dim, cfg.policy.action_chunk, spec.action_dim,
                                       spec.pixel_shape)
  if jax.tree.structure(obs) != jax.tree.structure(template.obs):
    raise ValueError(f'observations {jax.tree.structure(obs)} do not match the env spec\'s '
                     f'{jax.tree.structure(template.obs)} (pixel_shape {spec.pixel_shape}).')
  # The observed envs, repeated in order to the run's n envs.
  rows = jax.tree.map(lambda x, t: np.resize(np.asarray(x, t.dtype), (n,) + t.shape[2:]), obs, template.obs)
  out = act(params, jax.tree.map(jnp.asarray, rows), jax.random.PRNGKey(4), 0)

  def per_segment(x):  # [n, ...] -> [T, U * n, ...]: env e's value in every unroll and step
    x = np.asarray(x)
    return np.broadcast_to(np.concatenate([x] * unrolls)[None], (steps, unrolls * n) + x.shape[1:])

  shape = (steps, unrolls * n)
  rewards = np.random.default_rng(4).normal(size=shape)
  values = types.Transition(obs=jax.tree.map(per_segment, rows),
                            raw_action=per_segment(out.raw_actions),
                            reward=rewards,
                            termination=np.zeros(shape),
                            truncation=np.zeros(shape),
                            next_obs=jax.tree.map(per_segment, rows),
                            behaviour_log_prob=per_segment(out.log_probs),
                            mask=np.ones(shape),
                            policy_version=np.full(shape, int(version)))
  return jax.tree.map(lambda x, t: jnp.asarray(np.ascontiguousarray(x, dtype=t.dtype).reshape(t.shape)), values,
                      template)


def _train(cfg, network, optimizer, train_state, batch, repeats: int) -> Timed:
  """train_step on `batch` (`train_batch`); donates `train_state`."""
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


def _stage(timed: Timed, env_steps: int) -> dict:
  med = statistics.median(timed.samples_s)
  return {
      'samples_s': timed.samples_s,
      'median_s': med,
      'per_env_step_s': med / env_steps,
      'env_steps': env_steps,
      'warmup_s': timed.warmup_s
  }


def _mjx_env(cfg):
  """The env the run steps (`rollout.mjx.make_env`, memoised: its randomisation and camera included, so the
  profile times what the run runs)."""
  from ebrl_jax.rollout import mjx as mjx_rollout  # lazy: brax and MJX load only when an MJX calibration runs
  return mjx_rollout.make_env(cfg.sim, auto_reset=not cfg.algo.episodic)


def _time_groups(cfg, network, act, params, envs_per_group, repeats, all_groups_threads, mjx_env, phases):
  """Sim and generation at each group size, smallest first (so each peak bounds its own size's): ({'sim': Timed,
  'generation': Timed}, peaks, sim threads (native MuJoCo), per size; the largest size's last observations)."""
  times, peaks, threads = {}, {}, {}
  sizes = sorted({int(e) for e in envs_per_group})
  reset = _mjx_reset(cfg, mjx_env, sizes) if mjx_env is not None else None
  for e in sizes:
    if mjx_env is not None:
      times[e] = _mjx_sim_gen(cfg, network, params, reset(e), repeats, mjx_env)
    else:
      threads[e] = cfg.sim.num_threads * (max(1, e // cfg.group_envs) if all_groups_threads else 1)
      times[e] = _cpu_sim_gen(cfg, act, params, e, repeats, threads[e])
    peaks[e] = peak_bytes_in_use()
    phases.lap(f'group_size_{e}')
  last_obs = times[max(times)]['obs']  # the largest size's: the most distinct envs
  for entry in times.values():
    del entry['obs']
  return times, peaks, threads, last_obs


def profile_stages(cfg, envs_per_group: Sequence[int], repeats: int = 5, all_groups_threads: bool = False) -> dict:
  """Times sim and generation at each group size and training once; see the module doc for what and how.

  Returns {'quota', 'device', 'backend', 'num_params', 'steps_per_iteration', 'train': {...}, 'groups': {E: {...}},
  'phase_s': {phase: s}}, each stage with 'samples_s', 'median_s', 'per_env_step_s' and 'warmup_s'; per group size
  also the sequential floor and overlap ceiling (env steps/s) for that group size with the iteration's training;
  'train' and each group size with 'peak_bytes_in_use' (see the module doc).

  Native MuJoCo with `all_groups_threads` and --num_threads > 0: a batch of E envs is stepped with the threads
  the run gives them, --num_threads per group of num_envs / num_groups (so the whole batch stands for every
  group stepping at once, the overlap ceiling's case); otherwise with --num_threads, one group's (the planner's
  case: a group's time at each group size it may choose). The count is recorded per size as 'sim_threads'.
  """
  for e in envs_per_group:
    if e <= 0:
      raise ValueError(f'calibration batch size {e} must be > 0.')
  phases = _Phases()
  spec = sim.spec_of(cfg.sim)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  train_state = trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(cfg.schedule.seed), spec.obs_dim,
                                                cfg.policy.normalize_observations, spec.pixel_shape,
                                                cfg.algo.value_norm_rate is not None)
  act = gen_stages.make_act(network, cfg.policy.min_std)
  unroll_steps = timed_unroll_steps(cfg) * cfg.policy.action_chunk * cfg.sim.action_repeat  # per env, one call
  iteration_steps = cfg.env_steps_per_iteration

  out = {
      'quota': current_quota(),
      'device': str(jax.devices()[0].device_kind),
      'backend': cfg.sim.backend,
      'num_params': policies.count_params(train_state.params.network),
      'steps_per_iteration': iteration_steps,
      'groups': {}
  }
  phases.lap('setup')
  mjx_env = None
  if cfg.sim.backend != 'mujoco_cpu':  # one MJX env serves every group size
    mjx_env = _mjx_env(cfg)
    phases.lap('env_build')
  times, peaks, threads, last_obs = _time_groups(cfg, network, act, train_state.params, envs_per_group, repeats,
                                                 all_groups_threads, mjx_env, phases)
  batch = train_batch(cfg, spec, act, train_state.params, train_state.policy_version, last_obs)
  phases.lap('train_batch')
  train = _stage(_train(cfg, network, optimizer, train_state, batch, repeats), iteration_steps)  # donates train_state
  train['peak_bytes_in_use'] = peak_bytes_in_use()
  phases.lap('train')
  out['train'] = train
  for e in envs_per_group:
    entry = {name: _stage(timed, int(e) * unroll_steps) for name, timed in times[int(e)].items()}
    entry['peak_bytes_in_use'] = peaks[int(e)]
    if threads:
      entry['sim_threads'] = threads[int(e)] or None  # None: one per available core
    per_step = [entry['sim']['per_env_step_s'], entry['generation']['per_env_step_s'], train['per_env_step_s']]
    entry['sequential_floor_steps_per_s'] = 1.0 / sum(per_step)
    entry['overlap_ceiling_steps_per_s'] = 1.0 / max(per_step)
    out['groups'][str(int(e))] = entry
  out['phase_s'] = phases.seconds
  logging.info('calibration at quota %d %%: %s', out['quota'],
               ', '.join(f'{name} {s:.1f} s' for name, s in phases.seconds.items()))
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
