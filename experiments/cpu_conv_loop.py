r"""What XLA:CPU's loops cost a pixel train step: `trainer.stages.train_step` with its epoch and minibatch loops
as `lax.scan` (rolled, the default) and traced step by step (`unroll=True`), beside one minibatch's loss
gradient alone, for push_cube_pixels.flags' network (IMPALA CNN
16/32/32 x 2 blocks, 256 features, 9 state values, MLP heads 256 x 256) on random 64 x 64 x 9 frames.

  JAX_PLATFORMS=cpu python -m experiments.cpu_conv_loop --out=experiments/results/cpu_conv_loop_2cpu.json

Each program is compiled and run once, then timed on a second run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.trainer import stages


def _timed(fn, *args):
  t0 = time.monotonic()
  jax.block_until_ready(fn(*args))
  first = time.monotonic() - t0
  t0 = time.monotonic()
  jax.block_until_ready(fn(*args))
  return {'compile_and_run_s': round(first, 3), 'run_s': round(time.monotonic() - t0, 3)}


def random_batch(envs: int, steps: int, obs_dim: int, action_dim: int, shape, seed: int = 0):
  """A Transition [steps, envs] of random frames (uint8) and small random floats, every step valid (mask 1) and no
  episode ending (termination and truncation 0): a batch any train step takes."""
  rng = np.random.default_rng(seed)

  def fill(x):
    if x.dtype == np.uint8:
      return jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
    if x.dtype == np.bool_:
      return jnp.zeros(x.shape, bool)
    return jnp.asarray(0.1 * rng.normal(size=x.shape).astype(x.dtype))

  batch = jax.tree.map(fill, types.transition_template(steps, envs, obs_dim, 1, action_dim, shape))
  return batch._replace(mask=jnp.ones_like(batch.mask),
                        termination=jnp.zeros_like(batch.termination),
                        truncation=jnp.zeros_like(batch.truncation))


def measure(envs: int, minibatches: int, epochs: int, image: int) -> dict:
  policy = config_lib.PolicyConfig(kind='mlp',
                                   cnn_channels=(16, 32, 32),
                                   cnn_blocks=2,
                                   d_model=256,
                                   policy_hidden_sizes=(256, 256),
                                   value_hidden_sizes=(256, 256))
  algo = config_lib.AlgoConfig(batch_size=envs // minibatches,
                               num_minibatches=minibatches,
                               num_updates_per_batch=epochs,
                               unroll_length=10)
  shape, obs_dim = (image, image, 9), 9
  network = policies.make_network(policy, obs_dim, 3, shape)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), obs_dim, True, shape)
  batch = random_batch(envs, 10, obs_dim, 3, shape)
  key = jax.random.PRNGKey(1)
  out = {'envs': envs, 'steps': 10, 'minibatches': minibatches, 'epochs': epochs, 'image': image}
  for name, unroll in (('rolled', False), ('unrolled', True)):
    step = jax.jit(functools.partial(stages.train_step, network, optimizer, algo, 1e-3, unroll=unroll))
    out[f'train_step_{name}'] = _timed(lambda s, b: step(s, b, key)[1], state, batch)
  per = envs // minibatches
  minibatch = (jax.tree.map(lambda x: x[:, :per], batch), jnp.zeros((10, per)), jnp.zeros((per,)))
  loss = functools.partial(stages._minibatch_loss, network=network, algo=algo, min_std=1e-3, key=key)  # pylint: disable=protected-access
  grad = jax.jit(jax.grad(lambda net_params, params, mb: loss(net_params, params=params, minibatch=mb)[0]))
  out['minibatch_gradient_alone'] = _timed(grad, state.params.network, state.params, minibatch)
  out['rolled_over_unrolled'] = round(out['train_step_rolled']['run_s'] / out['train_step_unrolled']['run_s'], 2)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--envs', type=int, default=16)
  parser.add_argument('--minibatches', type=int, default=2)
  parser.add_argument('--epochs', type=int, default=1)
  parser.add_argument('--image', type=int, default=64)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  result = {
      'backend': jax.default_backend(),
      'machine': {
          'platform': platform.platform(),
          'cpu_count': os.cpu_count()
      },
      'jax': jax.__version__,
      **measure(args.envs, args.minibatches, args.epochs, args.image)
  }
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
