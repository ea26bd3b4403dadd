r"""Plots a W1 result (ours vs Brax's PPO): eval return against wall-clock seconds and against env steps.

  python experiments/plot_w1.py experiments/results/w1_fused_vs_brax.json   # writes the .png beside it
"""
import json
import os
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top


def _curve(result: dict, system: str, key: str):
  if system not in result or 'eval_curve' not in result[system]:
    raise ValueError(f'{result.get("_path")}: field {system}.eval_curve is missing')
  points = result[system]['eval_curve']
  return [p[key] for p in points], [p['return'] for p in points]


def main(path: str) -> str:
  with open(path) as f:
    result = json.load(f)
  result['_path'] = path
  target = result.get('target_return', 3000)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for system, label in (('ebrl_jax_fused', 'ebrl_jax fused'), ('brax_ppo', "Brax PPO")):
    if system not in result:
      continue
    for ax, key, scale in ((axes[0], 'wall_s', 1.0), (axes[1], 'env_steps', 1e-6)):
      xs, ys = _curve(result, system, key)
      ax.plot([x * scale for x in xs], ys, marker='o', ms=3, label=label)
  for ax, xlabel in ((axes[0], 'wall-clock seconds (start-up and compilation included)'),
                     (axes[1], 'env steps (millions)')):
    ax.axhline(target, color='grey', ls='--', lw=1, label=f'target {target:g}')
    ax.set_xlabel(xlabel)
    ax.set_ylabel('eval episode return')
    ax.grid(alpha=0.3)
    ax.legend()
  machine = result.get('machine', {}).get('gpu') or result.get('machine', {}).get('device', '')
  fig.suptitle(f'W1: MJX Ant, 4096 envs, PPO ({machine})')
  fig.tight_layout()
  out = os.path.splitext(path)[0] + '.png'
  fig.savefig(out, dpi=110)
  return out


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  print(main(sys.argv[1]))
