r"""How far the evaluation curves of a harness invocation's labels agree, version by version: whether `overlap`
replays `sync` on the GPU, and how far two runs of one schedule part on it (GPU non-determinism).

  python -m experiments.bench.curve_agreement experiments/results/w6_overlap2_1gpu.json [--out=agreement.json]

For each seed and each pair of labels, over the policy versions both evaluated: whether every return is equal
bit for bit, the first version where they differ, and the largest absolute difference. Curves are keyed by
policy version (every schedule's summary keeps `eval_curve` entries with `version` and `return`), so a run cut
earlier than the other is compared on what it evaluated.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Dict, List, Optional

from experiments.bench import figures


def curves(result: dict) -> Dict[str, Dict[int, Dict[int, float]]]:
  """label -> seed -> {version: return}, from a harness result (`experiments.bench.run`'s JSON). A run's seed is
  its command's --seed (a merged result holds a label's seeds in the order of its files, not of `seeds`); runs
  whose command does not say are taken in the order of `seeds`."""
  seeds = result.get('seeds') or [0]
  out = {}
  for label, runs in result['runs'].items():
    for i, run in enumerate(runs):
      named = figures.run_seed(run)
      if named is None:
        seed = seeds[i] if i < len(seeds) else i
      else:
        seed = int(named) if named.lstrip('-').isdigit() else named
      curve = (run.get('summary') or {}).get('eval_curve') or []
      out.setdefault(label, {})[seed] = {int(c['version']): float(c['return']) for c in curve}
  return out


def compare(a: Dict[int, float], b: Dict[int, float]) -> Optional[dict]:
  """Agreement of two curves over their common versions; None when they share none."""
  common = sorted(set(a) & set(b))
  if not common:
    return None
  differ = [v for v in common if a[v] != b[v]]
  return {
      'versions': common,
      'identical': not differ,
      'first_difference_version': differ[0] if differ else None,
      'max_abs_difference': max(abs(a[v] - b[v]) for v in common),
      'returns': [[v, a[v], b[v]] for v in common],
  }


def agreement(result: dict, labels: Optional[List[str]] = None) -> List[dict]:
  """Every pair of `labels` (default: all of the result's), per seed both ran."""
  by_label = curves(result)
  labels = labels or list(by_label)
  missing = [l for l in labels if l not in by_label]
  if missing:
    raise ValueError(f'labels {missing} are not in the result (it has {sorted(by_label)}).')
  rows = []
  for first, second in itertools.combinations(labels, 2):
    for seed in sorted(set(by_label[first]) & set(by_label[second])):
      row = compare(by_label[first][seed], by_label[second][seed])
      if row is not None:
        rows.append({'labels': [first, second], 'seed': seed, **row})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('result', help='a harness result JSON')
  parser.add_argument('--labels', help='comma-separated labels to compare (default: all)')
  parser.add_argument('--out', help='also write the rows to this JSON file')
  args = parser.parse_args(argv)
  with open(args.result) as f:
    result = json.load(f)
  try:
    rows = agreement(result, args.labels.split(',') if args.labels else None)
  except ValueError as err:
    print(f'curve_agreement: {err}', file=sys.stderr)
    return 2
  for row in rows:
    print(f"{row['labels'][0]} vs {row['labels'][1]} (seed {row['seed']}): {len(row['versions'])} versions, "
          f"{'identical' if row['identical'] else 'differ from version %d' % row['first_difference_version']}, "
          f"max |diff| {row['max_abs_difference']:.6g}")
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'result': args.result, 'rows': rows}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
