r"""How much of PPO's probability ratio is arithmetic: the ratio's spread when no parameter has changed.

  python -m experiments.ratio_noise --out=experiments/results/ratio_noise_h200.json        (GPU; W2's sizes)
  python -m experiments.ratio_noise --small --out=/tmp/ratio_noise_cpu.json                  (CPU; tiny sizes)

`train_step` takes the proximal log-probs from one forward pass over the whole batch, then each minibatch's loss
recomputes them inside its gradient. Before the first update the two are of the same parameters, so the ratio is
exactly 1 and PPO's approx KL and clip fraction are 0 — up to rounding: in bfloat16 the trunk's activations round
to 8 bits of mantissa, and two programs of different shapes (the whole batch, a minibatch under `jax.grad`) round
differently. This measures, per compute dtype, on W2's network (the 25 M transformer: d 512 x 8 layers, 8 heads,
chunk 2, separate MLP critic; Ant's 27 observations and 8 actions) and one W2 iteration's batch (8 steps x 8192
segments in 8 minibatches), at unchanged parameters: the loss's approx KL and clip fraction (`clip_epsilon` 0.2)
averaged over the minibatches, with the proximal log-probs taken (a) from the whole batch, as `train_step` does,
and (b) minibatch by minibatch in the loss's shapes, and the log-probs' absolute differences. Observations are
random (normal, scaled), actions sampled from the policy, the normaliser fitted to the batch first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import normalization
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.trainer import losses
from ebrl_jax.trainer import stages
from ebrl_jax.types import Transition

OBS, ACT, MIN_STD = 27, 8, 0.001
W2 = dict(d_model=512, num_layers=8, num_heads=8, unroll=8, batch_size=1024, num_minibatches=8)
SMALL = dict(d_model=32, num_layers=2, num_heads=2, unroll=4, batch_size=16, num_minibatches=4)


def _batch(network, params, key, t: int, s: int) -> Transition:
  k = jax.random.split(key, 3)
  obs = jax.random.normal(k[0], (t, s, OBS)) * 3.0 + 1.0
  out = jax.jit(lambda p, o, kk: gen_stages.act(network, p, o, kk, min_std=MIN_STD))(params, obs.reshape(t * s, OBS),
                                                                                     k[1])
  zeros = jnp.zeros((t, s))
  return Transition(obs=obs,
                    raw_action=out.raw_actions.reshape((t, s) + out.raw_actions.shape[1:]),
                    reward=jax.random.normal(k[2], (t, s)),
                    termination=zeros,
                    truncation=zeros,
                    next_obs=obs + 0.1,
                    behaviour_log_prob=out.log_probs.reshape(t, s),
                    mask=jnp.ones((t, s)),
                    policy_version=jnp.zeros((t, s), jnp.int32))


def _minibatches(tree, m: int):
  """Leaves [T, S, ...] -> [M, T, S/M, ...] (contiguous segments; the loss's minibatch layout)."""

  def split(x):
    x = x.reshape((x.shape[0], m, x.shape[1] // m) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1)

  return jax.tree_util.tree_map(split, tree)


def measure(dtype: str, sizes: dict, seed: int = 0) -> dict:
  """The loss's approx KL and clip fraction at unchanged parameters, with whole-batch and per-minibatch proximal
  log-probs, for one compute dtype."""
  cfg = PolicyConfig(kind='transformer',
                     d_model=sizes['d_model'],
                     num_layers=sizes['num_layers'],
                     num_heads=sizes['num_heads'],
                     mlp_ratio=4,
                     obs_token_size=4,
                     action_chunk=2,
                     critic='mlp',
                     compute_dtype=dtype)
  algo = AlgoConfig(clip_epsilon=0.2,
                    unroll_length=sizes['unroll'],
                    batch_size=sizes['batch_size'],
                    num_minibatches=sizes['num_minibatches'])
  t, s, m = sizes['unroll'], algo.segments_per_iteration, algo.num_minibatches
  network = policies.make_network(cfg, OBS, ACT)
  key = jax.random.PRNGKey(seed)
  params = gen_stages.init_policy_params(network, key, OBS, normalize_observations=True)
  batch = _batch(network, params, jax.random.fold_in(key, 1), t, s)
  params = params.replace(normalizer=normalization.update_stats(params.normalizer, batch.obs, batch.mask))
  whole = jax.jit(lambda p, b: stages._proximal_log_prob(network, p, b, MIN_STD))(params, batch)  # pylint: disable=protected-access

  per_mb = jax.jit(lambda p, b: jax.lax.map(lambda mb: stages._proximal_log_prob(network, p, mb, MIN_STD), b))(  # pylint: disable=protected-access
      params, _minibatches(batch, m))
  grad_fn = jax.jit(jax.grad(stages._minibatch_loss, has_aux=True), static_argnums=(1, 2, 3))  # pylint: disable=protected-access
  batches = _minibatches(batch, m)
  out = {}
  for name, proximal in (('whole_batch', _minibatches(whole, m)), ('per_minibatch', per_mb)):
    kls, clips = [], []
    for i in range(m):
      minibatch = (jax.tree_util.tree_map(lambda x: x[i], batches), proximal[i], jnp.zeros((s // m,)))
      _, metrics = grad_fn(params.network, network, algo, MIN_STD, params, minibatch, jax.random.PRNGKey(i))
      kls.append(float(metrics['approx_kl']))
      clips.append(float(metrics['clip_fraction']))
    out[name] = {'approx_kl': float(np.mean(kls)), 'clip_fraction': float(np.mean(clips))}
  diff = np.abs(np.asarray(_minibatches(whole, m)) - np.asarray(per_mb))
  out['logp_abs_diff_whole_vs_minibatch'] = {'mean': float(diff.mean()), 'max': float(diff.max())}
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--small', action='store_true', help='tiny sizes (CPU)')
  parser.add_argument('--dtypes', default='float32,bfloat16')
  args = parser.parse_args(argv)
  sizes = SMALL if args.small else W2
  result = {'sizes': sizes, 'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()]}
  for dtype in args.dtypes.split(','):
    t0 = time.time()
    result[dtype] = measure(dtype, sizes)
    result[dtype]['seconds'] = round(time.time() - t0, 1)
    print(dtype, json.dumps(result[dtype]), flush=True)
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == '__main__':
  sys.exit(main())
