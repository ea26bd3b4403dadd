r"""W1: ebrl_jax `fused` PPO on MJX Ant beside Brax's own PPO, in one invocation on one machine.

  python experiments/w1_fused_vs_brax.py --flagfile=experiments/w1_ant.flags \
      --out=experiments/results/w1_fused_vs_brax.json

Brax's trainer is run with Brax's published Ant hyperparameters. brax 0.14.2 calls
`jax.device_put_replicated`, which JAX removed; this script (and only this script) provides it.
The JSON holds, per system: eval return curve (env steps, wall seconds), env steps/s, compile/start-up time,
env steps and wall time to the target return, and the ratios ours/brax.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from ebrl_jax import main as ebrl_main  # defines the ebrl_jax flags read from --flagfile
from ebrl_jax import controller

_OUT = flags.DEFINE_string('out', 'experiments/results/w1_fused_vs_brax.json', 'Where to write the JSON result.')
_BRAX_STEPS = flags.DEFINE_integer('brax_timesteps', 50_000_000, "Env steps for Brax's PPO (0 skips it).")
_BRAX_EVALS = flags.DEFINE_integer('brax_num_evals', 20, "Evaluations during Brax's run.")


def _device_put_replicated(x, devices):
  """The function brax 0.14.2 expects: x stacked once per device, each slice placed on its device."""
  def replicate(leaf):
    stacked = jnp.stack([jnp.asarray(leaf)] * len(devices))
    if len(devices) == 1:
      return jax.device_put(stacked, devices[0])
    sharding = jax.sharding.PmapSharding.default(stacked.shape, 0, devices)
    return jax.device_put(stacked, sharding)
  return jax.tree.map(replicate, x)


def _run_brax(target: float, num_timesteps: int, num_evals: int, seed: int) -> dict:
  from brax import envs  # pylint: disable=g-import-not-at-top
  from brax.training.agents.ppo import train as ppo  # pylint: disable=g-import-not-at-top
  jax.device_put_replicated = _device_put_replicated  # the shim; JAX >= 0.10.2 lacks it
  env = envs.get_environment('ant', backend='mjx')
  curve, start = [], time.monotonic()

  def progress(step, metrics):
    curve.append({'env_steps': int(step), 'wall_s': round(time.monotonic() - start, 3),
                  'return': float(metrics['eval/episode_reward']),
                  'sps': float(metrics.get('training/sps', 0.0))})
    logging.info('brax: step %d return %.1f wall %.1f s', step, curve[-1]['return'], curve[-1]['wall_s'])

  ppo.train(environment=env, num_timesteps=num_timesteps, num_evals=num_evals, reward_scaling=10,
            episode_length=1000, normalize_observations=True, action_repeat=1, unroll_length=5,
            num_minibatches=32, num_updates_per_batch=4, discounting=0.97, learning_rate=3e-4,
            entropy_cost=1e-2, num_envs=4096, batch_size=2048, seed=seed, progress_fn=progress)
  hit = next((c for c in curve if c['return'] >= target), None)
  steady = [c['sps'] for c in curve[2:] if c['sps'] > 0]
  return {
      'eval_curve': curve,
      'wall_s': time.monotonic() - start,
      'startup_s': curve[0]['wall_s'] if curve else None,  # env + eval compile before the first evaluation
      'env_steps_per_s': sum(steady) / len(steady) if steady else None,
      'env_steps_to_target': hit['env_steps'] if hit else None,
      'wall_s_to_target': hit['wall_s'] if hit else None,
      'best_return': max(c['return'] for c in curve) if curve else None,
  }


def _machine() -> dict:
  info = {'platform': platform.platform(), 'python': platform.python_version(), 'jax': jax.__version__,
          'device': str(jax.devices()[0].device_kind), 'cpu_count': os.cpu_count()}
  try:
    info['gpu'] = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version', '--format=csv,noheader'],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    info['gpu'] = None
  return info


def _commit() -> str:
  try:
    out = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() if out.returncode == 0 else os.environ.get('EBRL_COMMIT', 'unknown')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def _ratio(a, b):
  return None if a is None or b is None or not b else a / b


def main(argv):
  del argv
  cfg = ebrl_main.config_from_flags()
  target = cfg.schedule.target_return if cfg.schedule.target_return is not None else 3000.0
  result = {'commit': _commit(), 'machine': _machine(), 'config': dataclasses.asdict(cfg), 'target_return': target}
  t0 = time.monotonic()
  ours = dataclasses.asdict(controller.run(cfg))
  ours['wall_s_total'] = time.monotonic() - t0
  result['ebrl_jax_fused'] = ours
  if _BRAX_STEPS.value:
    result['brax_ppo'] = _run_brax(target, _BRAX_STEPS.value, _BRAX_EVALS.value, cfg.schedule.seed)
    brax = result['brax_ppo']
    result['ratios'] = {
        'env_steps_per_s (ours/brax)': _ratio(ours['env_steps_per_s'], brax['env_steps_per_s']),
        'wall_s_to_target (brax/ours, >1 is faster)': _ratio(brax['wall_s_to_target'], ours['wall_s_to_target']),
        'env_steps_to_target (brax/ours)': _ratio(brax['env_steps_to_target'], ours['env_steps_to_target']),
    }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2)
  logging.info('Wrote %s: %s', _OUT.value, json.dumps(result.get('ratios', {})))


if __name__ == '__main__':
  app.run(main)
