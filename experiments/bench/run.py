r"""Runs one workload under several schedules and seeds, one after another on one machine, into one JSON.

  python -m experiments.bench.run --bench_flagfile=experiments/w1_ant.flags --schedules=fused,sync,async \
      --seeds=0,1,2 --extra=--num_groups=2 --out=experiments/results/w1_bench.json
  python -m experiments.bench.run --quick --out=/tmp/quick.json      # 2-core CPU, a few minutes (CI runs it)

Each (schedule, seed) runs as `python -m ebrl_jax.main` in its own process with `--run_dir=<out>_runs/<schedule>
/seed<k>`; its summary.json is collected. Where NVML sees a GPU, device-wide SM activity and occupancy (GPM) are
sampled every 100 ms during each run (`ebrl_jax.resources.telemetry`). Per schedule the JSON holds every seed's figures and their mean; ratios
are against the first schedule. `python -m experiments.bench.report <json> ...` turns results into a table
and plots.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from typing import Dict, List

from absl import app
from absl import flags

from ebrl_jax.resources import telemetry

_FLAGFILE = flags.DEFINE_string('bench_flagfile', None, 'The workload flagfile (passed on as --flagfile).')
_SCHEDULES = flags.DEFINE_list('schedules', ['fused', 'sync', 'async'], 'Schedules to run, in order.')
_SEEDS = flags.DEFINE_list('seeds', ['0'], 'Seeds, run in sequence for every schedule.')
_EXTRA = flags.DEFINE_multi_string('extra', [], 'Extra flags for every run, e.g. --extra=--num_groups=2.')
_OUT = flags.DEFINE_string('out', 'experiments/results/bench.json', 'Where to write the JSON result.')
_TIMEOUT = flags.DEFINE_integer('timeout_s', 3600, 'Per-run time limit (the run is stopped with SIGTERM).')
_QUICK = flags.DEFINE_bool('quick', False, 'Tiny CPU workload (native MuJoCo pendulum) that exercises the harness.')

QUICK_FLAGFILE = 'experiments/quickstart.flags'
QUICK_EXTRA = ['--num_envs=16', '--batch_size=16', '--num_minibatches=4', '--num_timesteps=6400', '--num_evals=2',
               '--num_eval_envs=4', '--episode_length=200', '--num_groups=2', '--compilation_cache_dir=']
# Figures every run reports (BENCHMARKS.md): end-to-end throughput, compile time, time to target, returns.
FIGURES = ('env_steps', 'env_steps_per_s', 'compile_s', 'wall_s', 'train_wall_s', 'final_eval_return',
           'best_eval_return', 'env_steps_to_target', 'wall_s_to_target', 'train_s_to_target')


def _gpm_window(tel: telemetry.Telemetry, start: float, end: float) -> dict:
  """Mean device-wide SM activity and occupancy between two Unix times (None, with the reason, without a GPU)."""
  window = [r for r in tel.records if start <= r['t'] <= end and 'sm_activity_pct' in r]
  if not window:
    return {'sm_activity_pct': None, 'sm_occupancy_pct': None, 'reason': tel.gpu_reason or 'no samples'}
  return {'sm_activity_pct': sum(r['sm_activity_pct'] for r in window) / len(window),
          'sm_occupancy_pct': sum(r['sm_occupancy_pct'] for r in window) / len(window), 'samples': len(window)}


def _machine() -> dict:
  info = {'platform': platform.platform(), 'python': platform.python_version(), 'cpu_count': os.cpu_count(),
          'gpu': None}
  try:
    out = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version', '--format=csv,noheader'],
                         capture_output=True, text=True, timeout=20)
    info['gpu'] = out.stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def _commit() -> str:
  out = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True)
  return out.stdout.strip() if out.returncode == 0 else os.environ.get('EBRL_COMMIT', 'unknown')


def _run_one(flagfile: str, schedule: str, seed: str, extra: List[str], run_dir: str,
             tel: telemetry.Telemetry) -> dict:
  cmd = [sys.executable, '-m', 'ebrl_jax.main', f'--flagfile={flagfile}', f'--schedule={schedule}',
         f'--seed={seed}', f'--run_dir={run_dir}', '--noprogress_bar', *extra]
  start = time.time()
  popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    stdout, stderr = popen.communicate(timeout=_TIMEOUT.value)
  except subprocess.TimeoutExpired:
    popen.send_signal(signal.SIGTERM)  # the controller stops its workers and unlinks shared memory
    try:
      stdout, stderr = popen.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      popen.kill()
      stdout, stderr = popen.communicate()
    stderr += f'\n[bench] stopped after --timeout_s={_TIMEOUT.value}'
  end = time.time()
  result = {'command': ' '.join(cmd[1:]), 'returncode': popen.returncode, 'start_unix': start, 'end_unix': end,
            'process_wall_s': end - start, 'gpm': _gpm_window(tel, start, end)}
  summary_path = os.path.join(run_dir, 'summary.json')
  if popen.returncode or not os.path.exists(summary_path):
    result['error_tail'] = (stdout + stderr)[-4000:]
    return result
  with open(summary_path) as f:
    result['summary'] = json.load(f)
  return result


def _mean(values):
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def aggregate(runs: Dict[str, List[dict]]) -> Dict[str, dict]:
  """Per schedule: each figure's mean over the seeds that finished (None where no seed has it)."""
  out = {}
  for schedule, seeds in runs.items():
    done = [r['summary'] for r in seeds if 'summary' in r]
    figures = {k: _mean([s.get(k) for s in done]) for k in FIGURES}
    figures['sm_activity_pct'] = _mean([r['gpm'].get('sm_activity_pct') for r in seeds])
    figures['seeds_finished'] = len(done)
    figures['seeds_reaching_target'] = sum(s.get('env_steps_to_target') is not None for s in done)
    out[schedule] = figures
  return out


def ratios(figures: Dict[str, dict], base: str) -> Dict[str, dict]:
  """Throughput ratio (higher is better) and time-to-target ratio (base / schedule: higher is faster)."""
  b = figures[base]
  out = {}
  for schedule, f in figures.items():
    entry = {}
    if f['env_steps_per_s'] and b['env_steps_per_s']:
      entry['env_steps_per_s'] = f['env_steps_per_s'] / b['env_steps_per_s']
    if f['wall_s_to_target'] and b['wall_s_to_target']:
      entry['wall_s_to_target_speedup'] = b['wall_s_to_target'] / f['wall_s_to_target']
    out[schedule] = entry
  return out


def main(argv):
  del argv
  flagfile, extra = _FLAGFILE.value, list(_EXTRA.value)
  if _QUICK.value:
    flagfile, extra = flagfile or QUICK_FLAGFILE, QUICK_EXTRA + extra
  if not flagfile:
    raise app.UsageError('--bench_flagfile is required (or --quick).')
  if not os.path.exists(flagfile):
    raise app.UsageError(f'--bench_flagfile={flagfile} does not exist.')
  run_root = os.path.splitext(_OUT.value)[0] + '_runs'
  result = {'commit': _commit(), 'flagfile': flagfile, 'extra_flags': extra, 'quick': _QUICK.value,
            'seeds': _SEEDS.value, 'machine': _machine(), 'runs': {}}
  os.makedirs(run_root, exist_ok=True)
  # Device-wide figures only (no pids): each run's own telemetry covers its processes.
  tel = telemetry.Telemetry(run_root, dict, period=0.1).start()
  try:
    for schedule in _SCHEDULES.value:
      result['runs'][schedule] = []
      for seed in _SEEDS.value:
        print(f'== {schedule} seed {seed}', flush=True)
        run = _run_one(flagfile, schedule, seed, extra, os.path.join(run_root, schedule, f'seed{seed}'), tel)
        result['runs'][schedule].append(run)
        summary = run.get('summary', {})
        print(json.dumps({k: summary.get(k) for k in FIGURES}), flush=True)
        if 'error_tail' in run:
          print(run['error_tail'][-2000:], flush=True)
  finally:
    tel.stop()
  result['figures'] = aggregate(result['runs'])
  result['ratios_vs_' + _SCHEDULES.value[0]] = ratios(result['figures'], _SCHEDULES.value[0])
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2, allow_nan=False)
  print(f'wrote {_OUT.value}', flush=True)
  failed = [f'{s}/seed{i}' for s, rs in result['runs'].items() for i, r in zip(_SEEDS.value, rs) if 'error_tail' in r]
  if failed:
    print(f'failed runs: {", ".join(failed)}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
