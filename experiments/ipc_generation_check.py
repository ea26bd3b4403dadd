"""GPU check of the generation process for MJX groups (issue 14, item 1). On the H200:

  PYTHONPATH=. python3 experiments/ipc_generation_check.py --out /tmp/ipc_generation_check.json

(a) The hand-off contract between two processes (experiments/handoff_round_trip.py): 2000 round trips of one W1
    env group ([1024, 27] observations, [1024, 1, 8] actions) through the CUDA IPC path and the host path, every
    reply checked against its own trip's observations; p50/p99 latency of each.
(b) A short W1-like run (MJX Ant, experiments/w1_ant.flags, `async`, 2 groups, 16 iterations, no evaluations)
    with co-located generation, then a separate generation worker over the host path, then over CUDA IPC; each
    run's env steps/s, wall-clock, segment counts and generation statistics from its summary.json. The three runs
    share one compilation cache directory. Each run has a time limit (`--run_timeout_s`); a run that fails or
    times out is recorded with its return code and the tail of its log, and the check goes on.
Writes one JSON to --out. Budget: --budget_s (340 s) for everything; a run that would pass it is cut or skipped.

The first H200 result (experiments/results/ipc_generation_check_h200.json) ran the three layouts without MPS, so the
rollout, generation and trainer processes time-sliced the GPU, which may cost most where a step has the most GPU
synchronisation points (a likely cause, not yet measured: the IPC path has a copy and a stream synchronisation on
each side per step). Next: the same with `--extra_flags=--use_mps`, as the W1 benchmarks run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # two JAX processes share the GPU in (a)

# pylint: disable=wrong-import-position  (after the XLA environment, which the spawned server inherits)
from ebrl_jax.transport import cuda_ipc
from experiments import handoff_round_trip
# pylint: enable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {
    'colocated': ['--colocate_generation'],
    'separate_host': ['--nocolocate_generation', '--generation_transport=host'],
    'separate_cuda_ipc': ['--nocolocate_generation', '--generation_transport=cuda_ipc'],
}
# 16 iterations of W1's 65,536 segments of 5 steps.
NUM_TIMESTEPS = 16 * 65_536 * 5


def contract(n: int) -> dict:
  out = {'round_trips': n}
  reason = cuda_ipc.unavailable_reason()
  for kind in ('cuda_ipc', 'host'):
    if kind == 'cuda_ipc' and reason is not None:
      out[kind] = {'skipped': reason}
      continue
    t0 = time.monotonic()
    try:
      out[kind] = handoff_round_trip.round_trips(kind, n=n, warmup=200)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the runs still go)
      out[kind] = {'error': f'{type(e).__name__}: {e}'}
    out[kind]['wall_s'] = time.monotonic() - t0
    print(kind, out[kind], flush=True)
  if 'p50_us' in out.get('cuda_ipc', {}) and 'p50_us' in out['host']:
    out['host_over_ipc_p50'] = out['host']['p50_us'] / out['cuda_ipc']['p50_us']
  return out


def run_layout(name: str, work: str, cache: str, timeout_s: float, flagfile: str, extra=()) -> dict:
  run_dir = os.path.join(work, name)
  cmd = [
      sys.executable, '-m', 'ebrl_jax.main', f'--flagfile={flagfile}', '--schedule=async', '--num_groups=2',
      f'--num_timesteps={NUM_TIMESTEPS}', '--num_evals=0', '--evaluator=trainer', f'--run_dir={run_dir}',
      f'--compilation_cache_dir={cache}', '--noprogress_bar', *LAYOUTS[name], *extra
  ]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env.pop('XLA_PYTHON_CLIENT_PREALLOCATE', None)  # the run's memory plan sets each process's share
  t0 = time.monotonic()
  log_path = os.path.join(work, f'{name}.log')
  with open(log_path, 'w') as log:
    try:
      rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
      rc = 'timeout'
  out = {'flags': LAYOUTS[name] + list(extra), 'rc': rc, 'wall_s': time.monotonic() - t0}
  path = os.path.join(run_dir, 'summary.json')
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
    extra = summary.get('extra', {})
    out.update(env_steps=summary.get('env_steps'),
               env_steps_per_s=summary.get('env_steps_per_s'),
               run_wall_s=summary.get('wall_s'),
               compile_s=summary.get('compile_s'),
               segments_consumed=extra.get('segments_consumed'),
               segments_duplicated=extra.get('segments_duplicated'),
               rollout=extra.get('rollout'),
               generation=extra.get('generation'),
               generation_layout=extra.get('generation_layout'))
  if rc != 0:
    with open(log_path) as f:
      out['log_tail'] = f.read()[-3000:]
  print(name, {k: v for k, v in out.items() if k != 'log_tail'}, flush=True)
  return out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', required=True)
  parser.add_argument('--round_trips', type=int, default=2000)
  parser.add_argument('--run_timeout_s', type=float, default=100.0)
  parser.add_argument('--layouts', default=','.join(LAYOUTS))
  parser.add_argument('--budget_s', type=float, default=340.0, help='the whole check, round trips and runs')
  parser.add_argument('--flagfile', default='experiments/w1_ant.flags')
  parser.add_argument('--extra_flags', default='', help='more run flags, space-separated (a CPU dry run: smaller)')
  args = parser.parse_args()
  t0 = time.monotonic()
  result = {
      'date': time.strftime('%Y-%m-%d %H:%M:%S'),
      'command': ' '.join(sys.argv),
      'commit': os.environ.get('EBRL_COMMIT'),
      'extra_flags': args.extra_flags.split(),
      'contract': contract(args.round_trips),
      'runs': {}
  }
  with tempfile.TemporaryDirectory(prefix='ipc_check_') as work:
    cache = os.path.join(work, 'xla_cache')
    for name in filter(None, args.layouts.split(',')):
      left = args.budget_s - (time.monotonic() - t0)  # the whole check stays inside --budget_s
      if left < 30:
        result['runs'][name] = {'skipped': f'{left:.0f} s of --budget_s={args.budget_s:.0f} left'}
        continue
      result['runs'][name] = run_layout(name, work, cache, min(args.run_timeout_s, left), args.flagfile,
                                        args.extra_flags.split())
  runs = result['runs']
  base = (runs.get('colocated') or {}).get('env_steps_per_s')
  if base:
    result['over_colocated'] = {
        name: r['env_steps_per_s'] / base for name, r in runs.items() if r.get('env_steps_per_s')
    }
  result['wall_s'] = time.monotonic() - t0
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  print('wrote', args.out, f'({result["wall_s"]:.0f} s)')


if __name__ == '__main__':
  main()
