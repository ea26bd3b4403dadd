r"""Turns benchmark results into a Markdown table and plots.

  python -m experiments.bench.report experiments/results/w1_schedules.json [more.json ...] [--md table.md]

Reads the JSON of `experiments.bench.run` (runs.<schedule> = a list of seeds), of the older single-seed
schedule runs (runs.<schedule> = one run) and of the former `experiments/w1_fused_vs_brax.py`. For each input file it writes
`<file>.png` (eval return against wall-clock seconds and against env steps, one thin line per seed, the seeds'
mean bold; throughput bars) and prints one Markdown table of all of them. A file of none of these shapes, or a
run missing a field, is an error that names the file and the field.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

REQUIRED = ('env_steps', 'env_steps_per_s', 'eval_curve')
CURVE_FIELDS = ('env_steps', 'wall_s', 'return')


class ResultError(ValueError):
  """A result file that cannot be read; the message names the file and the field."""


def _summaries_of(run, path: str, where: str) -> List[dict]:
  runs = run if isinstance(run, list) else [run]
  out = []
  for i, r in enumerate(runs):
    if not isinstance(r, dict):
      raise ResultError(f'{path}: {where}[{i}] is not an object')
    if 'summary' in r:
      out.append(r['summary'])
    elif 'error_tail' not in r:
      raise ResultError(f'{path}: {where}[{i}] has neither "summary" nor "error_tail"')
  return out


def load(path: str) -> Dict[str, List[dict]]:
  """{label: [summary per finished seed]} from any supported result file, validated."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ResultError(f'{path}: cannot read it as JSON ({e})') from None
  if not isinstance(data, dict):
    raise ResultError(f'{path}: the top level must be an object')
  if 'runs' in data:
    if not isinstance(data['runs'], dict):
      raise ResultError(f'{path}: field "runs" must map schedule names to runs')
    runs = {name: _summaries_of(run, path, f'runs.{name}') for name, run in data['runs'].items()}
  elif 'ebrl_jax_fused' in data:
    runs = {'ebrl_jax fused': [data['ebrl_jax_fused']]}
    if 'brax_ppo' in data:  # Brax's run has its own fields; take what the table and plot need
      brax = data['brax_ppo']
      runs['Brax PPO'] = [dict(brax, env_steps=brax['eval_curve'][-1]['env_steps'] if brax.get('eval_curve') else
                               None)]
  else:
    raise ResultError(f'{path}: no field "runs" (bench results) nor "ebrl_jax_fused" (the W1 comparison)')
  for label, summaries in runs.items():
    for i, s in enumerate(summaries):
      for field in REQUIRED:
        if field not in s:
          raise ResultError(f'{path}: {label} seed #{i}: missing field "{field}"')
      for point in s['eval_curve']:
        for field in CURVE_FIELDS:
          if field not in point or not isinstance(point[field], (int, float)) or not math.isfinite(point[field]):
            raise ResultError(f'{path}: {label} seed #{i}: an eval_curve point has no finite "{field}"')
  return runs


def _mean(values):
  values = [v for v in values if isinstance(v, (int, float))]
  return sum(values) / len(values) if values else None


def _fmt(value, digits=0, scale=1.0, suffix=''):
  return '—' if value is None else f'{value * scale:,.{digits}f}{suffix}'


def table(results: Dict[str, Dict[str, List[dict]]]) -> str:
  lines = ['| result | run | seeds | env steps/s | compile s | wall s to target | env steps to target | best return |',
           '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for path, runs in results.items():
    for label, seeds in runs.items():
      lines.append('| {} | {} | {} | {} | {} | {} | {} | {} |'.format(
          os.path.basename(path), label, len(seeds), _fmt(_mean([s.get('env_steps_per_s') for s in seeds])),
          _fmt(_mean([s.get('compile_s') for s in seeds]), 1),
          _fmt(_mean([s.get('wall_s_to_target') for s in seeds]), 1),
          _fmt(_mean([s.get('env_steps_to_target') for s in seeds]), 2, 1e-6, ' M'),
          _fmt(_mean([s.get('best_eval_return', s.get('best_return')) for s in seeds]), 1)))
  return '\n'.join(lines)


def plot(path: str, runs: Dict[str, List[dict]]) -> str:
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={'width_ratios': [2, 2, 1]})
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, (label, seeds) in enumerate(runs.items()):
    color = colors[i % len(colors)]
    for ax, key, scale in ((axes[0], 'wall_s', 1.0), (axes[1], 'env_steps', 1e-6)):
      for s in seeds:
        xs = [p[key] * scale for p in s['eval_curve']]
        ax.plot(xs, [p['return'] for p in s['eval_curve']], color=color, lw=2 if len(seeds) == 1 else 0.8,
                alpha=1.0 if len(seeds) == 1 else 0.5, label=label if len(seeds) == 1 else None)
      if len(seeds) > 1:  # the mean over seeds at each evaluation index they share
        n = min(len(s['eval_curve']) for s in seeds)
        xs = [_mean([s['eval_curve'][j][key] for s in seeds]) * scale for j in range(n)]
        ys = [_mean([s['eval_curve'][j]['return'] for s in seeds]) for j in range(n)]
        ax.plot(xs, ys, color=color, lw=2, label=f'{label} (mean of {len(seeds)})')
    rate = _mean([s.get('env_steps_per_s') for s in seeds])
    axes[2].bar(i, rate or 0.0, color=color)
  axes[0].set_xlabel('wall-clock seconds (start-up included)')
  axes[1].set_xlabel('env steps (millions)')
  for ax in axes[:2]:
    ax.set_ylabel('eval episode return')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[2].set_xticks(range(len(runs)), list(runs), rotation=30, ha='right', fontsize=8)
  axes[2].set_ylabel('env steps / s (end to end)')
  axes[2].grid(alpha=0.3, axis='y')
  fig.suptitle(os.path.basename(path))
  fig.tight_layout()
  out = os.path.splitext(path)[0] + '.png'
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('results', nargs='+', help='result JSON files')
  parser.add_argument('--md', help='also write the Markdown table to this file')
  parser.add_argument('--no_plots', action='store_true')
  args = parser.parse_args(argv)
  try:
    results = {path: load(path) for path in args.results}
  except ResultError as e:
    print(f'report: {e}', file=sys.stderr)
    return 2
  md = table(results)
  print(md)
  if args.md:
    with open(args.md, 'w') as f:
      f.write(md + '\n')
  if not args.no_plots:
    for path, runs in results.items():
      print(f'wrote {plot(path, runs)}', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
