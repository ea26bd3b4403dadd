r"""Evaluation curves from runs' `metrics.jsonl`, for runs that ended without a summary (killed, crashed, cut by a
time limit before this project held signals on MJX) or to put several runs on one plot:

  python -m experiments.curves --run=state=runs/a/metrics.jsonl --run=pixels=runs/b/metrics.jsonl.gz \
      --target=0 --out=experiments/results/manip_screen_h200.json

Writes `--out` (per label: every evaluation's env steps, its `wall_s` as logged and return (the run clock, seconds
from process start, since this tool came; a logger clock from the driver's start before), and the process it came
from (`process`, 0 first: a run continued with --resume appends to the same metrics.jsonl, its clock starting again,
so `wall_s_to_target` is on the clock of `process_of_target`),
`compile_s` when the run logged it, best return, the first evaluation at or above `--target`, the env steps/s
logged while training, and each `--train_metrics` name's values as logged: the mean over each chunk of
iterations) and `--out` with `.png` (return against env steps and against wall-clock seconds).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
from typing import Dict, List, Optional

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

RETURN = 'eval/episode_return'
RATE = 'rollout/env_steps_per_s'


def read_metrics(path: str) -> List[dict]:
  """The records of a metrics.jsonl (or .jsonl.gz); a line that is not JSON (a write cut by a kill) ends it."""
  opener = gzip.open if path.endswith('.gz') else open
  records = []
  with opener(path, 'rt') as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


def curve_of(records: List[dict], target: Optional[float], train_metrics: tuple = ()) -> dict:
  """One run's figures from its metrics records (see the module's docstring). Raises ValueError without any
  evaluation."""
  points, process, last_wall = [], 0, None
  for r in records:
    if last_wall is not None and r['wall_s'] < last_wall:  # a resumed process's records: its clock starts again
      process += 1
    last_wall = r['wall_s']
    if RETURN in r:
      points.append({'env_steps': r['env_steps'], 'wall_s': r['wall_s'], 'return': r[RETURN], 'process': process})
  if not points:
    raise ValueError('no evaluation in the metrics')
  compile_s = next((r['time/compile_s'] for r in records if 'time/compile_s' in r), None)
  rates = [r[RATE] for r in records if RATE in r]
  hit = next((p for p in points if target is not None and p['return'] >= target and p['env_steps'] > 0), None)
  return {
      'eval_curve': points,
      'best_eval_return': max(p['return'] for p in points),
      'final_eval_return': points[-1]['return'],
      'env_steps': points[-1]['env_steps'],
      'compile_s': compile_s,
      'target_return': target,
      'env_steps_to_target': hit['env_steps'] if hit else None,
      'wall_s_to_target': hit['wall_s'] if hit else None,
      'processes': process + 1,
      'process_of_target': hit['process'] if hit else None,
      'rollout_env_steps_per_s_median': sorted(rates)[len(rates) // 2] if rates else None,
      'train_metrics': {
          name: [{
              'env_steps': r['env_steps'],
              'value': r[name]
          } for r in records if name in r] for name in train_metrics
      },
  }


def plot(curves: Dict[str, dict], path: str, target: Optional[float]) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, c in curves.items():
    steps = [p['env_steps'] / 1e6 for p in c['eval_curve']]
    returns = [p['return'] for p in c['eval_curve']]
    line, = axes[0].plot(steps, returns, marker='o', label=label)
    for k in sorted({p.get('process', 0) for p in c['eval_curve']}):  # one line per process: clocks restart
      mine = [p for p in c['eval_curve'] if p.get('process', 0) == k]
      axes[1].plot([p['wall_s'] for p in mine], [p['return'] for p in mine],
                   marker='o' if k == 0 else 's',
                   color=line.get_color(),
                   linestyle='-' if k == 0 else ':')
  for ax, xlabel in zip(axes,
                        ('env steps (M)', 'wall_s of metrics.jsonl (s; a resumed process dotted, from its start)')):
    ax.set_xlabel(xlabel)
    ax.set_ylabel('eval return')
    if target is not None:
      ax.axhline(target, color='grey', linestyle='--', linewidth=1)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--run', action='append', required=True, help='label=path of a metrics.jsonl[.gz]')
  parser.add_argument('--target', type=float, default=None)
  parser.add_argument('--train_metrics',
                      default='',
                      help='comma-separated metric names to keep, e.g. '
                      'train/ppo/approx_kl,train/ppo/clip_fraction')
  parser.add_argument('--out', required=True)
  args = parser.parse_args(argv)
  curves = {}
  for spec in args.run:
    label, sep, path = spec.partition('=')
    if not sep or not label or not path:
      parser.error(f'--run={spec} must be label=path')
    if not os.path.exists(path):
      parser.error(f'--run={spec}: {path} does not exist')
    try:
      names = tuple(n for n in args.train_metrics.split(',') if n)
      curves[label] = dict(curve_of(read_metrics(path), args.target, names), metrics=path)
    except ValueError as e:
      parser.error(f'--run={spec}: {e}')
  with open(args.out, 'w') as f:
    json.dump({'runs': curves}, f, indent=1)
  plot(curves, os.path.splitext(args.out)[0] + '.png', args.target)
  for label, c in curves.items():
    print(f"{label}: best {c['best_eval_return']:.1f} at up to {c['env_steps']:,} env steps; target reached at "
          f"{c['env_steps_to_target']} env steps, {c['wall_s_to_target']} s")
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
