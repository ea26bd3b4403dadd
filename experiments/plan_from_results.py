r"""What the planner predicts for W2 from measurements kept in experiments/results/ (no GPU needed).

  python experiments/plan_from_results.py [--out experiments/results/w2_plan_prediction.json]

Profile samples: each stage alone at 100 % (`w2_stage_profile.json`), plus one point at a reduced quota from
the equal-quota `async` run (`w2_async_eq_quotas_trace.json`: median collection of a 1024-env group iteration at
33 %, split between sim and generation in their isolated ratio; median train_step at 34 %). The quota points
were measured beside other processes, so they include contention the model does not separate out: the output is
a prediction to test on the GPU (`--num_groups` and `--sm_quotas` it names), not a result.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from ebrl_jax.resources import calibrate
from ebrl_jax.resources import planner
from ebrl_jax.resources import profiles

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def _median_span_ms(trace_path: str, process: str, stage: str) -> float:
  with open(trace_path) as f:
    events = json.load(f)['traceEvents']
  names = {e['pid']: e['args']['name'] for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  durations = [
      e['dur'] / 1e3 for e in events if e.get('ph') == 'X' and e['name'] == stage and names.get(e['pid']) == process
  ]
  if not durations:
    raise ValueError(f'{trace_path}: no {stage!r} spans of process {process!r}')
  return statistics.median(durations)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'w2_plan_prediction.json'))
  args = parser.parse_args()
  with open(os.path.join(RESULTS, 'w2_stage_profile.json')) as f:
    prof = json.load(f)
  store = profiles.ProfileStore('h200 (kept results)', 'W2')
  calibrate.add_to_store(store, prof)  # the isolated samples, at the profile's quota (100 %)
  trace = os.path.join(RESULTS, 'w2_async_eq_quotas_trace.json')
  group_envs = 1024
  steps_per_iteration = prof['steps_per_iteration'] // 2048  # env steps each env takes per iteration
  collect_s = _median_span_ms(trace, 'rollout/0', 'rollout/collect') / 1e3
  train_s = _median_span_ms(trace, 'trainer', 'train/train_step') / 1e3
  g = prof['groups'][str(group_envs)]
  t_sim, t_gen = g['sim']['per_env_step_s'], g['generation']['per_env_step_s']
  step = collect_s / steps_per_iteration
  store.profile('sim').add_sample(group_envs, 33, step * t_sim / (t_sim + t_gen))
  store.profile('generation').add_sample(group_envs, 33, step * t_gen / (t_sim + t_gen))
  store.profile('train').add_sample(prof['steps_per_iteration'], 34, train_s)
  space = planner.PlanSpace(num_envs=2048,
                            steps_per_iteration=steps_per_iteration,
                            num_groups=(1, 2, 4),
                            quotas=tuple(range(10, 101, 5)))
  out = {
      'inputs': {
          'stage_profile': 'w2_stage_profile.json',
          'quota_points': os.path.basename(trace),
          'collect_s_at_33pct': collect_s,
          'train_s_at_34pct': train_s
      },
      'profiles': {
          name: store[name].describe() for name in store
      },
      'plans': {}
  }
  for schedule in ('async', 'sync'):
    best = planner.plan(store, space, schedule)
    out['plans'][schedule] = {
        'num_groups': best.num_groups,
        'quotas': best.quotas,
        'predicted_env_steps_per_s': best.env_steps_per_s,
        'reason': best.reason
    }
    print(f'{schedule}: {best.reason}')
  with open(args.out, 'w') as f:
    json.dump(out, f, indent=2)
  print('wrote', args.out)


if __name__ == '__main__':
  main()
