r"""Brax's own PPO trainer on a workload flagfile, reporting like an ebrl_jax run (`<run_dir>/summary.json`).

  python -m experiments.bench.brax_ppo --flagfile=experiments/w1_ant.flags --run_dir=/tmp/brax_w1 --seed=0

The bench harness runs it as the pseudo-schedule `brax` (`--schedules=fused,sync,async,brax`). The workload's
flags map one to one onto `brax.training.agents.ppo.train` (task, backend, num_envs, episode_length, action
repeat, unroll length, batch size, minibatches, updates per batch, discount, learning rate, entropy cost, reward
scaling, evaluations, seed); for W1 these are Brax's published Ant hyperparameters. `--backend=mjx` trains Brax's
own env (MJX's JAX implementation); `--backend=mjx_warp` trains the same env with its physics on MJX-Warp, batched
by the wrappers our `mjx_warp` runs use (`warp_env`), as MuJoCo Playground trains its Warp envs with this trainer. Only MLP policies with
Brax's default network sizes and PPO are accepted: anything else is not Brax's trainer and is refused by name.

It uses the same persistent compilation cache (`--compilation_cache_dir`) as our runs. Like our runs, training
stops at the first evaluation whose return reaches the target (`--target_return`).

Clocks (docs/benchmarks.md): the same as our runs'. Every time is seconds since this process started
(`ebrl_jax.main.process_start_unix`). `compile_s` is start-up, process start -> the first training work counted
in the rate: the step-0 evaluation's end plus the first training epoch's compile, which Brax times inside that
epoch (`training/walltime`), estimated as the first epoch's time minus the median of the later epochs' (they do
the same work). Its parts (`compile_breakdown`): imports (interpreter, flags, JAX), env_build, init_and_first_eval
(Brax's network and state init, the reset and evaluation compiles, the step-0 evaluation), compile (the training
epoch's). `env_steps_per_s` is env steps over `train_wall_s`, Brax's own training time (its epochs, evaluation
excluded) less that compile, so the first epoch's steps count at the pace of the others. With one training epoch
(`--num_evals=2`) the compile cannot be told apart: it stays in `train_wall_s` and
`extra.train_compile_in_rate` says so.

brax 0.14.2 calls `jax.device_put_replicated`, which JAX removed in 0.10.2; this module (and only this module)
provides it for the duration of the run.
"""
from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from ebrl_jax import main as ebrl_main  # defines the workload flags read from --flagfile
from ebrl_jax import config as config_lib
from ebrl_jax.runtime import errors
from ebrl_jax.sim import mjx_env

# Brax's defaults for `ppo_networks.make_ppo_networks` (policy 4 x 32, value 5 x 256).
_BRAX_POLICY_HIDDEN = (32, 32, 32, 32)
_BRAX_VALUE_HIDDEN = (256, 256, 256, 256, 256)

# --backend values Brax's trainer runs: its own MJX env (MJX's JAX implementation), and the same env with the
# physics on MJX-Warp, batched by the wrappers of our --backend=mjx_warp runs (`warp_env`).
BACKENDS = ('mjx', 'mjx_warp')


class _TargetReached(Exception):
  """Raised from Brax's progress callback to end training at the target, as our runs end."""


class _Stopped(Exception):
  """Raised from Brax's progress callback at the first evaluation after a held SIGTERM / SIGINT."""


def device_put_replicated(x, devices):
  """What brax 0.14.2 expects of `jax.device_put_replicated`: x stacked once per device, slice i on device i."""

  def replicate(leaf):
    stacked = jnp.stack([jnp.asarray(leaf)] * len(devices))
    if len(devices) == 1:
      return jax.device_put(stacked, devices[0])
    sharding = jax.sharding.PmapSharding.default(stacked.shape, 0, devices)
    return jax.device_put(stacked, sharding)

  return jax.tree.map(replicate, x)


def check_supported(cfg: config_lib.Config) -> None:
  """Refuses, by name, a workload Brax's PPO trainer cannot run as written."""
  problems = []
  if cfg.algo.name != 'ppo':
    problems.append(f'--algo={cfg.algo.name} (Brax runs ppo)')
  if cfg.policy.kind != 'mlp':
    problems.append(f'--policy={cfg.policy.kind} (Brax runs its MLP)')
  elif (tuple(cfg.policy.policy_hidden_sizes) != _BRAX_POLICY_HIDDEN or
        tuple(cfg.policy.value_hidden_sizes) != _BRAX_VALUE_HIDDEN):
    problems.append(
        f'--policy_hidden_sizes={cfg.policy.policy_hidden_sizes} / --value_hidden_sizes={cfg.policy.value_hidden_sizes} '
        f'(Brax defaults are {_BRAX_POLICY_HIDDEN} / {_BRAX_VALUE_HIDDEN})')
  if cfg.sim.backend not in BACKENDS:
    problems.append(f'--backend={cfg.sim.backend} (Brax trains on MJX envs: {", ".join(BACKENDS)})')
  if cfg.sim.randomization.enabled:
    problems.append('--randomize (Brax takes a randomization_fn of its own; not mapped)')
  if cfg.sim.solver_iterations or cfg.sim.ls_iterations:
    problems.append('--solver_iterations / --ls_iterations (not mapped onto the env Brax builds)')
  if problems:
    raise ValueError('Brax PPO cannot run this workload: ' + '; '.join(problems))


def progress_recorder(curve: list, start_unix: float, target):
  """Brax's `progress_fn`: appends each evaluation to `curve` on the process clock; ends training (raises) at the
  first evaluation that reaches `target`, or the first after a held SIGTERM / SIGINT (`errors.deferred_stops`)."""

  def progress(step, metrics):
    curve.append({
        'env_steps': int(step),
        'wall_s': round(time.time() - start_unix, 3),
        'unix': time.time(),
        'return': float(metrics['eval/episode_reward']),
        'sps': float(metrics.get('training/sps', 0.0)),
        'walltime': float(metrics.get('training/walltime', 0.0))
    })
    logging.info('brax: step %d return %.1f wall %.1f s', step, curve[-1]['return'], curve[-1]['wall_s'])
    if target is not None and curve[-1]['return'] >= target and step > 0:
      raise _TargetReached()
    held = errors.pending_stop()
    if held:  # a signal held while Brax's epoch ran: the run ends here, this evaluation in its curve
      raise _Stopped(held)

  return progress


def warp_env(task: str, episode_length: int, action_repeat: int):
  """(environment, wrap_env_fn) for `ppo.train` on MJX-Warp, as MuJoCo Playground trains its Warp envs with Brax's
  PPO: the unbatched Brax env whose physics run on MJX-Warp, and the `wrap_env_fn` Brax calls to batch it for
  training and for evaluation. That wrapper is the chain our own `--backend=mjx_warp` runs step
  (`mjx_env.make_mjx_env(task, ..., impl='warp')`: WarpVmapWrapper -> EpisodeWrapper -> WhereAutoResetWrapper,
  the Warp-aware batching and auto-reset), so both trainers step one env object, not two alike."""
  batched = mjx_env.make_mjx_env(task, episode_length, action_repeat, impl='warp')
  environment = batched.unwrapped

  def wrap(env, episode_length: int, action_repeat: int, randomization_fn=None):
    if randomization_fn is not None:
      raise ValueError('Brax PPO on --backend=mjx_warp takes no randomization_fn.')
    wrapped = mjx_env.make_mjx_env(task, episode_length, action_repeat, impl='warp')
    if wrapped.unwrapped is not env:
      raise ValueError(f'wrap_env_fn got {env}, not the Warp env {environment} it batches.')
    return wrapped

  return environment, wrap


def startup_split(curve: list, imports_s: float, env_build_s: float) -> dict:
  """compile_s, its parts and the training time counted in the rate, from the evaluation curve's wall times
  (process clock) and Brax's cumulative `training/walltime` at each evaluation (see the module's Clocks)."""
  walltimes = [c['walltime'] for c in curve[1:]]
  epochs = [b - a for a, b in zip([0.0] + walltimes[:-1], walltimes)]
  train_compile = None
  if len(epochs) >= 2:
    later = sorted(epochs[1:])
    steady = later[len(later) // 2] if len(later) % 2 else (later[len(later) // 2 - 1] + later[len(later) // 2]) / 2
    train_compile = max(0.0, epochs[0] - steady)
  first_eval_end = curve[0]['wall_s']
  parts = {
      'imports': imports_s,
      'env_build': env_build_s,
      'init_and_first_eval': max(0.0, first_eval_end - imports_s - env_build_s),
      'compile': train_compile or 0.0
  }
  train_wall = (walltimes[-1] - (train_compile or 0.0)) if walltimes else None
  return {
      'compile_s': first_eval_end + (train_compile or 0.0),
      'compile_breakdown': {
          k: round(v, 3) for k, v in parts.items()
      },
      'train_wall_s': train_wall,
      'train_compile_in_rate': bool(walltimes) and train_compile is None
  }


def run(cfg: config_lib.Config, start_unix: float) -> dict:
  """Trains with Brax's PPO; returns a summary with the fields of ebrl_jax's RunSummary that apply, every time
  on the clock of this process (`start_unix`: when it started)."""
  check_supported(cfg)
  from brax import envs  # pylint: disable=g-import-not-at-top
  from brax.training.agents.ppo import train as ppo  # pylint: disable=g-import-not-at-top
  s, a, sc = cfg.sim, cfg.algo, cfg.schedule
  target = sc.target_return
  imports_s = time.time() - start_unix
  if s.backend == 'mjx_warp':
    env, wrap_env_fn = warp_env(s.task, s.episode_length, s.action_repeat)
  else:
    env, wrap_env_fn = envs.get_environment(s.task, backend='mjx'), None
  env_build_s = time.time() - start_unix - imports_s
  curve = []
  progress = progress_recorder(curve, start_unix, target)

  saved = getattr(jax, 'device_put_replicated', None)
  jax.device_put_replicated = device_put_replicated
  try:
    ppo.train(environment=env,
              num_timesteps=sc.num_timesteps,
              num_evals=sc.num_evals,
              reward_scaling=a.reward_scaling,
              episode_length=s.episode_length,
              normalize_observations=True,
              action_repeat=s.action_repeat,
              unroll_length=a.unroll_length,
              num_minibatches=a.num_minibatches,
              num_updates_per_batch=a.num_updates_per_batch,
              discounting=a.discount,
              learning_rate=a.learning_rate,
              entropy_cost=a.entropy_cost,
              num_envs=s.num_envs,
              num_eval_envs=s.num_eval_envs,
              batch_size=a.batch_size,
              seed=sc.seed,
              deterministic_eval=sc.deterministic_eval,
              wrap_env_fn=wrap_env_fn,
              progress_fn=progress)
  except _TargetReached:
    stopped = 'target_return'
  except _Stopped as stop:
    stopped = str(stop)
  else:
    stopped = 'num_timesteps'
  finally:
    if saved is None:
      del jax.device_put_replicated
    else:
      jax.device_put_replicated = saved
  wall = time.time() - start_unix
  if not curve:
    raise RuntimeError('Brax PPO reported no evaluation.')
  hit = next((c for c in curve if target is not None and c['return'] >= target and c['env_steps'] > 0), None)
  env_steps = curve[-1]['env_steps']
  split = startup_split(curve, imports_s, env_build_s)
  train_wall = split['train_wall_s']
  sps = env_steps / train_wall if train_wall else None
  returns = [c['return'] for c in curve]
  return {
      'env_steps': env_steps,
      'wall_s': wall,
      'compile_s': split['compile_s'],
      'compile_breakdown': split['compile_breakdown'],
      'start_unix': start_unix,
      'stopped': stopped,
      'train_wall_s': train_wall,
      'env_steps_per_s': sps,
      'final_eval_return': returns[-1],
      'best_eval_return': max(returns),
      'target_return': target,
      'env_steps_to_target': hit['env_steps'] if hit else None,
      'wall_s_to_target': hit['wall_s'] if hit else None,
      'train_s_to_target': hit['env_steps'] / sps if hit and sps else None,
      'eval_curve': [{
          k: c[k] for k in ('env_steps', 'wall_s', 'unix', 'return')
      } for c in curve],
      'schedule': 'brax',
      'backend': s.backend,
      'task': s.task,
      'device': str(jax.devices()[0].device_kind),
      'extra': {
          'trainer': 'brax.training.agents.ppo',
          'sps_per_eval': [c['sps'] for c in curve],
          'train_compile_in_rate': split['train_compile_in_rate']
      },
  }


def main(argv):
  del argv
  start_unix = ebrl_main.process_start_unix()
  try:
    cfg = ebrl_main.config_from_flags()
    from ebrl_jax.runtime import startup  # pylint: disable=g-import-not-at-top
    startup.configure_jax(cfg.resources.platform, cfg.schedule.compilation_cache_dir
                         )  # the same persistent compilation cache as our runs, so seeds after the first
    # SIGTERM (the harness's time limit) and Ctrl-C are held until Brax's next evaluation (on MJX-Warp an
    # exception raised inside the simulator's Python callback aborts the process), which ends the run there.
    with errors.deferred_stops():
      summary = run(cfg, start_unix)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  os.makedirs(cfg.schedule.run_dir, exist_ok=True)
  path = os.path.join(cfg.schedule.run_dir, 'summary.json')
  with open(path + '.tmp', 'w') as f:
    json.dump(summary, f, indent=2, allow_nan=False)
  os.replace(path + '.tmp', path)
  logging.info('Wrote %s', path)
  if summary['stopped'] in ebrl_main.EXIT_SIGNAL:  # as our runs exit after a stop: 143 / 130
    return ebrl_main.EXIT_SIGNAL[summary['stopped']]
  return 0


if __name__ == '__main__':
  app.run(main)
