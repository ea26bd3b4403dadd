r"""Plots eval return against wall-clock seconds and against env steps for every run in a result JSON.

  python experiments/plot_results.py experiments/results/w1_fused_vs_brax.json   # writes the .png beside it
  python experiments/plot_results.py experiments/results/w1_schedules.json

Understands the JSON of `w1_fused_vs_brax.py` (systems `ebrl_jax_fused`, `brax_ppo`) and of `bench_schedules.py`
(`runs.<schedule>.summary`). A file of neither shape is an error naming the file and the missing field.
"""
import json
import os
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top


def _curves(result: dict, path: str) -> dict:
  """{label: eval_curve} from either result format."""
  if 'runs' in result:
    curves = {name: run['summary']['eval_curve'] for name, run in result['runs'].items() if 'summary' in run}
  else:
    curves = {label: result[key]['eval_curve'] for key, label in
              (('ebrl_jax_fused', 'ebrl_jax fused'), ('brax_ppo', 'Brax PPO')) if key in result}
  if not curves:
    raise ValueError(f'{path}: no eval_curve found (expected runs.<name>.summary.eval_curve or '
                     'ebrl_jax_fused.eval_curve)')
  for label, curve in curves.items():
    for point in curve:
      for field in ('env_steps', 'wall_s', 'return'):
        if field not in point:
          raise ValueError(f'{path}: a point of {label}.eval_curve lacks the field {field!r}')
  return curves


def main(path: str) -> str:
  with open(path) as f:
    result = json.load(f)
  curves = _curves(result, path)
  target = result.get('target_return') or result.get('config', {}).get('schedule', {}).get('target_return')
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, curve in curves.items():
    for ax, key, scale in ((axes[0], 'wall_s', 1.0), (axes[1], 'env_steps', 1e-6)):
      ax.plot([p[key] * scale for p in curve], [p['return'] for p in curve], marker='o', ms=3, label=label)
  for ax, xlabel in ((axes[0], 'wall-clock seconds (start-up and compilation included)'),
                     (axes[1], 'env steps (millions)')):
    if target:
      ax.axhline(target, color='grey', ls='--', lw=1, label=f'target {target:g}')
    ax.set_xlabel(xlabel)
    ax.set_ylabel('eval episode return')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(os.path.basename(path))
  fig.tight_layout()
  out = os.path.splitext(path)[0] + '.png'
  fig.savefig(out, dpi=110)
  return out


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  print(main(sys.argv[1]))
