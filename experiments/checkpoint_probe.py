r"""How long a checkpoint save blocks training, synchronous vs in the background (`--checkpoint_async`).

  python experiments/checkpoint_probe.py [--out experiments/results/checkpoint_probe_2cpu.json]

Saves the W2 train state (the 25 M-parameter transformer of experiments/w2_transformer.flags, with Adam's
moments) a few times with `ebrl_jax.trainer.checkpoint.Checkpointer`, sleeping between saves as training would,
and reports the seconds each `save` call blocked and what `close` waited for at the end; then restores the last
step to check it is whole. Runs on the CPU (`JAX_PLATFORMS=cpu`) or on whatever JAX sees.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax.generation import policies
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import stages


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default=None, help='write the figures here as JSON')
  parser.add_argument('--saves', type=int, default=4)
  parser.add_argument('--between_s', type=float, default=2.0, help='seconds of "training" between saves')
  parser.add_argument('--dir', default=None, help='where to write (default: a temporary directory)')
  args = parser.parse_args()
  policy = config_lib.PolicyConfig(kind='transformer',
                                   d_model=512,
                                   num_layers=8,
                                   num_heads=8,
                                   mlp_ratio=4,
                                   obs_token_size=4,
                                   action_chunk=4)
  spec = sim.env_spec('ant', 1000, 1)
  network = policies.make_network(policy, spec.obs_dim, spec.action_dim)
  optimizer = stages.make_optimizer(config_lib.AlgoConfig(learning_rate=1e-4))
  state = stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), spec.obs_dim, True)
  state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  result = {
      'device': str(jax.devices()[0].device_kind),
      'machine': platform.platform(),
      'cpus': os.cpu_count(),
      'num_params': policies.count_params(state.params.network),
      'state_mib': state_bytes / 2**20,
      'between_s': args.between_s,
      'modes': {}
  }
  for mode in ('sync', 'async'):
    root = tempfile.mkdtemp(dir=args.dir)
    try:
      ckpt = checkpoint.Checkpointer(os.path.join(root, 'checkpoints'), async_save=mode == 'async')
      blocked = []
      for step in range(1, args.saves + 1):
        t0 = time.monotonic()
        ckpt.save(step, state, {'env_steps': step})
        blocked.append(time.monotonic() - t0)
        time.sleep(args.between_s)
      t0 = time.monotonic()
      ckpt.close()
      close_s = time.monotonic() - t0
      with checkpoint.Checkpointer(os.path.join(root, 'checkpoints')) as again:
        restored, extra, step = again.restore(state)
      whole = step == args.saves and extra['env_steps'] == args.saves and all(
          np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)))
    finally:
      shutil.rmtree(root, ignore_errors=True)
    result['modes'][mode] = {
        'save_blocked_s': blocked,
        'median_save_blocked_s': statistics.median(blocked),
        'close_waited_s': close_s,
        'restored_whole': whole
    }
    print(
        f'{mode}: save blocked {", ".join(f"{b:.3f}" for b in blocked)} s (median '
        f'{statistics.median(blocked):.3f}); close waited {close_s:.3f} s; restore whole: {whole}',
        flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=2)
    print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
