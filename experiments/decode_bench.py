r"""Where W6's generation time goes: the token policy's KV-cache decoding (`token_policy.decode`) timed alone.

    python -m experiments.decode_bench --out=$OUT/decode_bench_h200.json            (GPU machine)
    python -m experiments.decode_bench --batch=8 --repeats=2 --out=/tmp/d.json       (a quick look on CPU)

For each compute dtype and `unroll` (token steps per iteration of the decoding `lax.scan`): compile seconds of
the jitted decode, then its median time over `--repeats` calls (ms per policy step = K*A tokens for the whole
batch), and beside it the teacher-forced pass training repeats per minibatch (`full_forward` plus its gradient,
the same sizes) and the prefill alone. W6's sizes by default (d 256 x 4 layers, 4 heads, 256 bins, chunks of 4
steps of push_cube's 3 action values = 12 tokens, 31 state values in tokens of 4, MLP critic, 1024 envs): how
much of a policy step is sequential token decoding, and whether unrolling the loop (fewer loop iterations, larger
fused programs) buys anything on the device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from ebrl_jax.generation import token_policy


def _timed(fn, args, repeats):
  """(compile seconds, median seconds per call after one warm call) of jitted `fn(*args)`."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times)


def _policy(args, dtype):
  return token_policy.TokenPolicy(action_dim=args.action_dim,
                                  action_chunk=args.action_chunk,
                                  num_bins=args.num_bins,
                                  d_model=args.d_model,
                                  num_layers=args.num_layers,
                                  num_heads=args.num_heads,
                                  dtype=dtype,
                                  tokenizer=token_policy.StateTokenizer(4),
                                  critic='mlp')


def measure(args, dtype_name: str) -> dict:
  """The rows of one compute dtype: prefill, decode per unroll, teacher-forced forward + gradient."""
  policy = _policy(args, jnp.dtype(dtype_name))
  key = jax.random.PRNGKey(0)
  obs = jax.random.normal(key, (args.batch, args.obs_size), jnp.float32)
  variables = token_policy.init(policy, key, obs)
  rows = {}
  prefill = lambda v, o: policy.apply(v, o, method=token_policy.TokenPolicy.prefill)
  c, t = _timed(prefill, (variables, obs), args.repeats)
  rows['prefill'] = {'compile_s': round(c, 3), 'ms': round(t * 1e3, 3)}
  tokens = None
  for unroll in args.unroll:
    decode = lambda v, o, k, u=unroll: token_policy.decode(policy, v, o, k, unroll=u)
    c, t = _timed(decode, (variables, obs, key), args.repeats)
    out = jax.jit(decode)(variables, obs, key)
    same = None if tokens is None else bool(jnp.array_equal(out.tokens, tokens))
    tokens = out.tokens if tokens is None else tokens
    rows[f'decode_unroll{unroll}'] = {'compile_s': round(c, 3), 'ms': round(t * 1e3, 3), 'same_tokens': same}

  def loss(v, o, tok):
    logits, values = token_policy.full_forward(policy, v, o, tok)
    return jnp.mean(token_policy.log_prob_and_entropy(logits, tok)[0]) + jnp.mean(values)

  grad = lambda v, o, tok: jax.grad(loss)(v, o, tok)
  c, t = _timed(grad, (variables, obs, tokens), args.repeats)
  rows['forward_and_grad'] = {'compile_s': round(c, 3), 'ms': round(t * 1e3, 3)}
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--batch', type=int, default=1024)
  parser.add_argument('--obs_size', type=int, default=31)
  parser.add_argument('--action_dim', type=int, default=3)
  parser.add_argument('--action_chunk', type=int, default=4)
  parser.add_argument('--num_bins', type=int, default=256)
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--num_layers', type=int, default=4)
  parser.add_argument('--num_heads', type=int, default=4)
  parser.add_argument('--unroll', type=int, nargs='+', default=[1, 3, 12])
  parser.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'])
  parser.add_argument('--repeats', type=int, default=30)
  args = parser.parse_args()
  result = {
      'device': jax.devices()[0].device_kind,
      'sizes': vars(args),
      'tokens_per_step': args.action_chunk * args.action_dim
  }
  for dtype in args.dtypes:
    result[dtype] = measure(args, dtype)
    print(dtype, json.dumps(result[dtype]), flush=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
