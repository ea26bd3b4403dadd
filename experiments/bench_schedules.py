r"""Runs one flagfile under several schedules, one after another on the same machine, and writes one JSON.

  python experiments/bench_schedules.py --bench_flagfile=experiments/w1_ant.flags --schedules=fused,sync,async \
      --extra=--num_groups=2 --out=experiments/results/w1_schedules.json

Each schedule runs as `python -m ebrl_jax.main` in its own process (so compile caches and GPU memory start
alike), with `--run_dir=<out dir>/<schedule>`; its summary.json is collected with the wall time of the whole
process. Ratios are against the first schedule listed.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

_FLAGFILE = flags.DEFINE_string('bench_flagfile', None, 'The workload flagfile (passed on as --flagfile).')
_SCHEDULES = flags.DEFINE_list('schedules', ['fused', 'sync', 'async'], 'Schedules to run, in order.')
_EXTRA = flags.DEFINE_multi_string('extra', [], 'Extra flags for every run, e.g. --extra=--num_groups=2.')
_OUT = flags.DEFINE_string('out', 'experiments/results/schedules.json', 'Where to write the JSON result.')
_TIMEOUT = flags.DEFINE_integer('timeout_s', 3600, 'Per-schedule time limit.')

_FIGURES = ('env_steps', 'wall_s', 'compile_s', 'train_wall_s', 'env_steps_per_s', 'final_eval_return',
            'best_eval_return', 'env_steps_to_target', 'wall_s_to_target', 'train_s_to_target')


def _commit() -> str:
  out = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True)
  return out.stdout.strip() if out.returncode == 0 else os.environ.get('EBRL_COMMIT', 'unknown')


def _run(schedule: str, run_root: str) -> dict:
  run_dir = os.path.join(run_root, schedule)
  cmd = [sys.executable, '-m', 'ebrl_jax.main', f'--flagfile={_FLAGFILE.value}', f'--schedule={schedule}',
         f'--run_dir={run_dir}', '--noprogress_bar', *_EXTRA.value]
  t0, start_unix = time.monotonic(), time.time()
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
  proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
  # Unix times let a device-wide sampler's log (e.g. NVML GPM SM activity) be split per schedule.
  result = {'command': ' '.join(cmd[1:]), 'returncode': proc.returncode, 'process_wall_s': time.monotonic() - t0,
            'start_unix': start_unix, 'end_unix': time.time()}
  summary_path = os.path.join(run_dir, 'summary.json')
  if proc.returncode or not os.path.exists(summary_path):
    result['error_tail'] = (proc.stdout + proc.stderr)[-4000:]
    return result
  with open(summary_path) as f:
    result['summary'] = json.load(f)
  return result


def main(argv):
  del argv
  if not _FLAGFILE.value:
    raise app.UsageError('--bench_flagfile is required.')
  run_root = os.path.splitext(_OUT.value)[0] + '_runs'
  result = {'commit': _commit(), 'flagfile': _FLAGFILE.value, 'extra_flags': _EXTRA.value,
            'machine': {'platform': platform.platform(), 'python': platform.python_version(),
                        'cpu_count': os.cpu_count()}, 'runs': {}}
  for schedule in _SCHEDULES.value:
    print(f'== {schedule}', flush=True)
    result['runs'][schedule] = run = _run(schedule, run_root)
    summary = run.get('summary', {})
    print(json.dumps({k: summary.get(k) for k in _FIGURES}), flush=True)
    if 'error_tail' in run:
      print(run['error_tail'][-2000:], flush=True)
  base = result['runs'][_SCHEDULES.value[0]].get('summary')
  if base:
    result['ratios_vs_' + _SCHEDULES.value[0]] = {
        s: {'env_steps_per_s': r['summary']['env_steps_per_s'] / base['env_steps_per_s']}
        for s, r in result['runs'].items() if 'summary' in r and base['env_steps_per_s']}
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'wrote {_OUT.value}', flush=True)


if __name__ == '__main__':
  app.run(main)
