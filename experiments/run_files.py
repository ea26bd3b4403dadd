"""Which files a short run of each schedule writes, and the summary's top-level and `extra` keys: a check that a
refactor changes no output a user or a script reads (`python -m experiments.run_files --out FILE`).

Each schedule runs the quickstart flagfile for 4 iterations on the CPU (2 env groups for sync/async, shared
memory). TensorBoard event files and per-process files are named by pattern (their names carry a host, pid or
time); everything else by its path under the run directory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_PATTERNS = ((re.compile(r'^tb/events\.out\.tfevents\..*'),
              'tb/events.out.tfevents.*'), (re.compile(r'^generation_stats_\d+_\d+\.json$'), 'generation_stats_*.json'),
             (re.compile(r'^checkpoints/\d+/.*'), 'checkpoints/<step>/...'), (re.compile(r'^checkpoints/\d+$'),
                                                                              'checkpoints/<step>'))


def _name(rel: str) -> str:
  for pattern, name in _PATTERNS:
    if pattern.match(rel):
      return name
  return rel


def files_of(run_dir: str):
  out = set()
  for root, dirs, files in os.walk(run_dir):
    for name in files + [d for d in dirs if d.isdigit()]:
      out.add(_name(os.path.relpath(os.path.join(root, name), run_dir)))
  return sorted(out)


def run_one(schedule: str, root: str) -> dict:
  run_dir = os.path.join(root, schedule)
  cmd = [
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', f'--schedule={schedule}',
      f'--run_dir={run_dir}', '--num_timesteps=10240', '--num_evals=2', '--target_return=100000',
      '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0.5'
  ]
  if schedule != 'fused':
    cmd += ['--num_groups=2']
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  entry = {'returncode': proc.returncode, 'files': files_of(run_dir)}
  path = os.path.join(run_dir, 'summary.json')
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
    entry['summary_keys'] = sorted(summary)
    entry['extra_keys'] = sorted(summary['extra'])
  else:
    entry['tail'] = proc.stdout[-2000:] + proc.stderr[-2000:]
  return entry


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--out', required=True)
  parser.add_argument('--schedules', default='fused,sync,async')
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    result = {s: run_one(s, root) for s in args.schedules.split(',')}
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
