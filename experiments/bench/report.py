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

from experiments.bench import figures

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
      runs['Brax PPO'] = [dict(brax, env_steps=brax['eval_curve'][-1]['env_steps'] if brax.get('eval_curve') else None)]
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


def run_extras(path: str) -> Dict[str, dict]:
  """Per label of a bench result: mean SM activity of its finished runs (whole runs, and over their steady
  windows) and its overlap efficiency, where recorded."""
  with open(path) as f:
    data = json.load(f)
  out = {}
  for label, runs in data.get('runs', {}).items():
    runs = runs if isinstance(runs, list) else [runs]
    done = [r for r in runs if isinstance(r, dict) and 'summary' in r]
    sm = _mean([(r.get('gpm') or {}).get('sm_activity_pct') for r in done])
    steady_sm = _mean([(r.get('gpm_steady') or {}).get('sm_activity_pct') for r in done])
    overlap = (data.get('overlap') or {}).get(label, {}).get('overlap_efficiency')
    out[label] = {'sm_activity_pct': sm, 'steady_sm_activity_pct': steady_sm, 'overlap_efficiency': overlap}
  return out


def _rate_cell(figure: dict, total: int) -> str:
  """'mean ± sd', the seeds it covers where fewer than all, and † for the older end-to-end definition."""
  if figure['mean'] is None:
    return '—'
  cell = _fmt(figure['mean']) + (f' ± {_fmt(figure["sd"])}' if figure['sd'] is not None else '')
  if figure['seeds'] < total:
    cell += f' ({figure["seeds"]} of {total} seeds)'
  return cell + (' †' if figure.get('counts_first_iteration') else '')


FOOTNOTE = ('Rates are means ± sample standard deviation over seeds. † end to end as measured before 29df545: a '
            'process schedule\'s first iteration (worker start-up, compiles) counted as throughput; later runs '
            'count it as start-up, and the two are not averaged together.')


def table(results: Dict[str, Dict[str, List[dict]]], extras: Dict[str, Dict[str, dict]] = None) -> str:
  """One row per (file, label): means over seeds; time to target over the seeds that reached it (count shown)."""
  extras = extras or {}
  lines = [
      '| result | run | seeds | env steps/s | steady env steps/s | rollout env steps/s | compile s | '
      'reached target | wall s to target | env steps to target | best return | SM activity % | '
      'steady SM activity % | overlap eff. | env steps lost per quota change |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |'
  ]
  for path, runs in results.items():
    for label, kept in runs.items():
      x = extras.get(path, {}).get(label, {})
      seeds = [s for s in kept if figures.has_rate(s)]  # as the harness's means (a run with no rate: out)
      reached = sum(s.get('env_steps_to_target') is not None for s in seeds)
      lost = _mean([w.get('env_steps_lost') for s in seeds for w in figures.quota_swaps(s)])
      lines.append('| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |'.format(
          os.path.basename(path), label, len(seeds), _rate_cell(figures.end_to_end(seeds), len(seeds)),
          _rate_cell(figures.steady(seeds), len(seeds)),
          _fmt(_mean([figures.rollout_env_steps_per_s(s) for s in seeds])),
          _fmt(_mean([s.get('compile_s') for s in seeds]), 1), f'{reached}/{len(seeds)}',
          _fmt(_mean([s.get('wall_s_to_target') for s in seeds]), 1),
          _fmt(_mean([s.get('env_steps_to_target') for s in seeds]), 2, 1e-6, ' M'),
          _fmt(_mean([s.get('best_eval_return', s.get('best_return')) for s in seeds]), 1),
          _fmt(x.get('sm_activity_pct'), 1), _fmt(x.get('steady_sm_activity_pct'), 1),
          _fmt(x.get('overlap_efficiency'), 2), _fmt(lost)))
  return '\n'.join(lines + ['', FOOTNOTE])


def _read_jsonl(path: str) -> List[dict]:
  try:
    return figures.read_jsonl(path)
  except (OSError, ValueError) as e:
    raise ResultError(f'{path}: cannot read it as JSON lines ({e})') from None


def plot_sm_activity(path: str, telemetry_paths: List[str]) -> str:
  """Device-wide SM activity (NVML GPM) over time, one panel per telemetry log (one per GPU), with the bench
  result's runs on that GPU marked as spans."""
  with open(path) as f:
    data = json.load(f)
  fig, axes = plt.subplots(len(telemetry_paths), 1, figsize=(14, 2.8 * len(telemetry_paths)), squeeze=False)
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  labels = list(data.get('runs', {}))
  for ax, tel_path in zip(axes[:, 0], telemetry_paths):
    records = [r for r in _read_jsonl(tel_path) if 'sm_activity_pct' in r]
    if not records:
      raise ResultError(f'{tel_path}: no record has "sm_activity_pct"')
    t0 = records[0]['t']
    ax.plot([r['t'] - t0 for r in records], [r['sm_activity_pct'] for r in records],
            lw=0.6,
            color='k',
            label='SM activity %')
    ax.plot([r['t'] - t0 for r in records], [r.get('sm_occupancy_pct', float('nan')) for r in records],
            lw=0.6,
            color='tab:gray',
            alpha=0.6,
            label='SM occupancy %')
    gpu = next((c for c in os.path.basename(tel_path).split('_') if c.startswith('gpu')), '')
    for label, runs in data.get('runs', {}).items():
      for r in runs if isinstance(runs, list) else [runs]:
        if gpu and f'gpu{r.get("gpu")}' != gpu.split('.')[0]:
          continue
        if r.get('start_unix', 0) <= records[-1]['t'] and r.get('end_unix', 0) >= records[0]['t']:
          ax.axvspan(r['start_unix'] - t0,
                     r['end_unix'] - t0,
                     alpha=0.15,
                     color=colors[labels.index(label) % len(colors)])
          ax.text(max(r['start_unix'] - t0, 0) + 1, 95, label, fontsize=7, va='top')
    ax.set_ylim(0, 100)
    ax.set_ylabel('%')
    ax.set_title(os.path.basename(tel_path), fontsize=9)
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=8, loc='upper right')
  axes[-1, 0].set_xlabel('seconds since the first sample')
  fig.tight_layout()
  out = os.path.splitext(path)[0] + '_sm.png'
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def plot_timeline(trace_path: str, window_s: float = 3.0) -> str:
  """The stage spans of every process in a Chrome/Perfetto trace, over `window_s` seconds from the middle of
  the run: one row per process, one colour per stage."""
  try:
    with open(trace_path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ResultError(f'{trace_path}: cannot read it as JSON ({e})') from None
  events = data['traceEvents'] if isinstance(data, dict) else data
  names = {e['pid']: e['args']['name'] for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  spans = [e for e in events if e.get('ph') == 'X']
  if not spans:
    raise ResultError(f'{trace_path}: no complete ("X") span events')
  t_lo = min(e['ts'] for e in spans)
  t_hi = max(e['ts'] + e['dur'] for e in spans)
  start = t_lo + (t_hi - t_lo) / 2
  end = start + window_s * 1e6
  pids = sorted({e['pid'] for e in spans}, key=lambda p: names.get(p, str(p)))
  stages = sorted({e['name'] for e in spans})
  colors = plt.get_cmap('tab10')
  fig, ax = plt.subplots(figsize=(14, 0.6 * len(pids) + 1.5))
  for row, pid in enumerate(pids):
    for e in spans:
      if e['pid'] == pid and e['ts'] < end and e['ts'] + e['dur'] > start:
        ax.broken_barh([((e['ts'] - start) / 1e3, e['dur'] / 1e3)], (row - 0.4, 0.8),
                       color=colors(stages.index(e['name']) % 10))
  ax.set_yticks(range(len(pids)), [names.get(p, str(p)) for p in pids])
  ax.set_xlim(0, window_s * 1e3)
  ax.set_xlabel(f'milliseconds ({window_s:g} s from the middle of the run)')
  handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(stages))]
  ax.legend(handles, stages, fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  ax.set_title(os.path.basename(trace_path), fontsize=9)
  fig.tight_layout()
  out = os.path.splitext(trace_path)[0] + '_timeline.png'
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def plot(path: str, runs: Dict[str, List[dict]]) -> str:
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={'width_ratios': [2, 2, 1]})
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, (label, seeds) in enumerate(runs.items()):
    color = colors[i % len(colors)]
    for ax, key, scale in ((axes[0], 'wall_s', 1.0), (axes[1], 'env_steps', 1e-6)):
      for s in seeds:
        xs = [p[key] * scale for p in s['eval_curve']]
        ax.plot(xs, [p['return'] for p in s['eval_curve']],
                color=color,
                lw=2 if len(seeds) == 1 else 0.8,
                alpha=1.0 if len(seeds) == 1 else 0.5,
                label=label if len(seeds) == 1 else None)
      if len(seeds) > 1:  # the mean over seeds at each evaluation index they share
        n = min(len(s['eval_curve']) for s in seeds)
        xs = [_mean([s['eval_curve'][j][key] for s in seeds]) * scale for j in range(n)]
        ys = [_mean([s['eval_curve'][j]['return'] for s in seeds]) for j in range(n)]
        ax.plot(xs, ys, color=color, lw=2, label=f'{label} (mean of {len(seeds)})')
    rate = figures.end_to_end(seeds)
    axes[2].bar(i,
                rate['mean'] or 0.0,
                yerr=rate['sd'],
                capsize=4,
                color=color,
                hatch='//' if rate['counts_first_iteration'] else None)
  axes[0].set_xlabel('wall-clock seconds (start-up included)')
  axes[1].set_xlabel('env steps (millions)')
  for ax in axes[:2]:
    ax.set_ylabel('eval episode return')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[2].set_xticks(range(len(runs)), list(runs), rotation=30, ha='right', fontsize=8)
  axes[2].set_ylabel('env steps / s (end to end; ± sd over seeds;\nhatched: first iteration counted, pre-29df545)',
                     fontsize=8)
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
  parser.add_argument('--telemetry',
                      action='append',
                      default=[],
                      help='telemetry JSONL(.gz) of the bench (one per GPU): plots SM activity over time beside '
                      'the first result, as <result>_sm.png')
  parser.add_argument('--trace',
                      action='append',
                      default=[],
                      help='a merged trace.json of a run: plots its stage timeline as <trace>_timeline.png')
  parser.add_argument('--window_s', type=float, default=3.0, help='seconds of timeline to plot')
  args = parser.parse_args(argv)
  try:
    results = {path: load(path) for path in args.results}
    extras = {path: run_extras(path) for path in args.results}
    md = table(results, extras)
    outputs = []
    if not args.no_plots:
      outputs += [plot(path, runs) for path, runs in results.items()]
      if args.telemetry:
        outputs.append(plot_sm_activity(args.results[0], args.telemetry))
      outputs += [plot_timeline(t, args.window_s) for t in args.trace]
  except ResultError as e:
    print(f'report: {e}', file=sys.stderr)
    return 2
  print(md)
  if args.md:
    with open(args.md, 'w') as f:
      f.write(md + '\n')
  for out in outputs:
    print(f'wrote {out}', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
