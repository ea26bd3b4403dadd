"""SIGKILL a tiny run's controller at random moments, start-up included, and check that it leaves nothing behind
(issue 17, defect 2): no process of the run alive a few seconds later (workers and the resource tracker, found in
/proc by a marker in their environment), and no shared-memory segment `/dev/shm/ebrl_<controller pid>_*` once the
next run's sweep (`ShmRegistry.sweep`, which `sync`/`async` call at start) has run.

  python -m experiments.faults_kill_controller --trials 50 --out experiments/results/faults_kill_controller.json

Each trial starts `python -m ebrl_jax.main` (inverted_pendulum, 32 envs, `async`, 2 groups, shared memory, CPU),
kills its controller a random delay after the launch, the workers' start or the first trained iteration, and
records: how far the run had got (workers started, iterations
trained), how long its processes took to go, any left, the segments the resource tracker had not removed by the
time they were gone, and the bytes the sweep freed. tests/runtime/test_liveness.py runs a few trials.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ebrl_jax.transport import shm  # pylint: disable=wrong-import-position

MARKER = 'EBRL_FAULT_TRIAL'
FLAGS = [
    '--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
    '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--schedule=async', '--num_groups=2',
    '--transport=shm', '--num_timesteps=10000000', '--num_evals=2000', '--telemetry_period_s=0'
]


def marked_processes(marker: str) -> List[int]:
  """Live (not zombie) processes whose environment holds `MARKER=marker`: every process the trial's run started."""
  needle = f'{MARKER}={marker}'.encode()
  found = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        if needle not in f.read().split(b'\0'):
          continue
      if shm.pid_alive(int(pid)):
        found.append(int(pid))
    except OSError:  # gone meanwhile, or not ours
      continue
  return found


def segments_of(pid: int) -> List[str]:
  return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f'{shm.PREFIX}_{pid}_'))


def _iterations(run_dir: str) -> int:
  try:
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
      return sum('train/ppo/total_loss' in line for line in f)
  except OSError:
    return 0


ANCHORS = ('launch', 'workers', 'training')  # what a kill's delay counts from


def _reached(anchor: str, run_dir: str) -> bool:
  if anchor == 'workers':
    return os.path.exists(os.path.join(run_dir, 'workers.json'))
  return anchor == 'launch' or _iterations(run_dir) > 0


def trial(run_dir: str,
          kill_after_s: float,
          anchor: str = 'launch',
          settle_s: float = 5.0,
          anchor_timeout_s: float = 300.0) -> Dict:
  """One run, its controller SIGKILLed `kill_after_s` after `anchor` (the launch, the workers' start, the first
  trained iteration; if the anchor is not reached within `anchor_timeout_s`, the kill comes then). Leftover
  processes are killed (and reported)."""
  marker = uuid.uuid4().hex
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, 'console.txt'), 'w') as log:
    proc = subprocess.Popen([sys.executable, '-m', 'ebrl_jax.main', f'--run_dir={run_dir}', *FLAGS],
                            cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS='cpu', **{MARKER: marker}),
                            stdout=log,
                            stderr=subprocess.STDOUT)
  deadline = time.monotonic() + anchor_timeout_s
  while not _reached(anchor, run_dir) and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.01)
  try:
    proc.wait(timeout=kill_after_s)
  except subprocess.TimeoutExpired:
    pass
  ended_early = proc.poll() is not None
  workers_started = os.path.exists(os.path.join(run_dir, 'workers.json'))
  iterations = _iterations(run_dir)
  os.kill(proc.pid, signal.SIGKILL)
  killed_t = time.monotonic()
  proc.wait()
  left = marked_processes(marker)
  while left and time.monotonic() - killed_t < settle_s:
    time.sleep(0.05)
    left = marked_processes(marker)
  gone_s = time.monotonic() - killed_t
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  time.sleep(0.2)  # the resource tracker unlinks once its last client has gone
  left_by_tracker = segments_of(proc.pid)
  swept = shm.ShmRegistry.sweep()
  ours = [n for n in swept.names if n.startswith(f'{shm.PREFIX}_{proc.pid}_')]
  return {
      'kill_after_s': round(kill_after_s, 2),
      'anchor': anchor,
      'ended_before_the_kill': ended_early,
      'workers_started': workers_started,
      'iterations_trained': iterations,
      'controller_pid': proc.pid,
      'processes_left': left,
      'processes_gone_s': round(gone_s, 3),
      'segments_left_by_the_tracker': left_by_tracker,
      'segments_swept': ours,
      'segments_after_the_sweep': segments_of(proc.pid),
  }


def survived(record: Dict) -> bool:
  """Nothing of the run left: no process, and no segment once swept."""
  return not record['processes_left'] and not record['segments_after_the_sweep']


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--trials', type=int, default=20)
  parser.add_argument('--max_delay_s',
                      type=float,
                      default=8.0,
                      help='kills land uniformly in [0, this] s after '
                      'an anchor drawn from the launch, the workers\' start and the first trained iteration')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  rng = random.Random(args.seed)
  records = []
  with tempfile.TemporaryDirectory(prefix='ebrl_faults_') as root:
    for i in range(args.trials):
      record = trial(os.path.join(root, f'trial{i}'), rng.uniform(0.0, args.max_delay_s), rng.choice(ANCHORS))
      records.append(record)
      print(json.dumps(record), flush=True)
  table = {
      'trials': len(records),
      'survived': sum(survived(r) for r in records),
      'killed_after_workers_started': sum(r['workers_started'] for r in records),
      'killed_while_training': sum(r['iterations_trained'] > 0 for r in records),
      'processes_left': sum(len(r['processes_left']) for r in records),
      'max_processes_gone_s': max(r['processes_gone_s'] for r in records),
      'segments_left_by_the_tracker': sum(len(r['segments_left_by_the_tracker']) for r in records),
      'segments_after_the_sweep': sum(len(r['segments_after_the_sweep']) for r in records),
      'records': records,
  }
  print(json.dumps({k: v for k, v in table.items() if k != 'records'}, indent=2))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(table, f, indent=2)


if __name__ == '__main__':
  main()
