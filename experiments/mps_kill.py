r"""The run's MPS daemon killed mid-run, on a GPU machine: what the user sees, what is left, what can be resumed.

  python experiments/mps_kill.py --out experiments/results/mps_kill_h200.json [-- MAIN_FLAGS...]

Starts `python -m ebrl_jax.main` with `--use_mps` (default workload: W1's MJX Ant, `async`, 2 groups, a checkpoint
every evaluation), waits until a checkpoint is committed and training goes on, then SIGKILLs the MPS control
daemon and server that this run started (found by their CUDA_MPS_PIPE_DIRECTORY, nothing else is touched).
Records how long the run took to stop, its exit code and error lines, whether any worker process, GPU context
(nvidia-smi) or shared-memory segment was left, and then resumes the run from its checkpoint without MPS for
two more iterations, recording whether that finished. Both runs' output goes beside --out. Needs a GPU,
`nvidia-cuda-mps-control` and root (on the H200: `experiments/results/mps_kill_h200.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ebrl_jax.runtime import storage  # pylint: disable=wrong-import-position

DEFAULT_FLAGS = [
    '--flagfile=experiments/w1_ant.flags', '--schedule=async', '--num_groups=2', '--num_timesteps=200000000',
    '--num_evals=200', '--noprogress_bar'
]


def _mps_pids(pipe_dir: str) -> dict:
  """{pid: command line} of the MPS processes serving `pipe_dir` (read from their environment)."""
  found = {}
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/comm') as f:
        if not f.read().startswith('nvidia-cuda-mps'):
          continue
      with open(f'/proc/{pid}/environ', 'rb') as f:
        env = f.read().split(b'\0')
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        cmd = f.read().replace(b'\0', b' ').decode().strip()
    except OSError:
      continue
    if f'CUDA_MPS_PIPE_DIRECTORY={pipe_dir}'.encode() in env:
      found[int(pid)] = cmd
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'
  except OSError:
    return False


def _gpu_pids() -> list:
  out = subprocess.run(['nvidia-smi', '--query-compute-apps=pid,used_memory', '--format=csv,noheader'],
                       capture_output=True,
                       text=True,
                       timeout=30)
  return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _launch(flags, log_path):
  log = open(log_path, 'w')
  return subprocess.Popen([sys.executable, '-m', 'ebrl_jax.main', *flags],
                          cwd=ROOT,
                          stdout=log,
                          stderr=subprocess.STDOUT,
                          start_new_session=True), log


def _interesting(log_path, limit=20):
  keys = ('MPS', 'FATAL', 'Error', 'error', 'died', 'stopp', 'resume', 'exit code', 'restart')
  with open(log_path, errors='replace') as f:
    lines = [l.rstrip()[:400] for l in f if any(k in l for k in keys) and 'warp' not in l]
  return lines[-limit:]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', required=True)
  parser.add_argument('--run_dir', default=None, help='default: a new temporary directory')
  parser.add_argument('--after_checkpoint_s',
                      type=float,
                      default=3.0,
                      help='seconds of training after the first committed checkpoint before the kill')
  parser.add_argument('--start_timeout_s', type=float, default=240.0)
  parser.add_argument('--stop_timeout_s', type=float, default=120.0)
  parser.add_argument('main_flags', nargs='*', help='flags for ebrl_jax.main (after --)')
  args = parser.parse_args()
  flags = args.main_flags or DEFAULT_FLAGS
  run_dir = args.run_dir or tempfile.mkdtemp(prefix='mps_kill_')
  pipe_dir = os.path.join(os.path.abspath(run_dir), 'mps', 'pipe')
  ckpt_dir = os.path.join(run_dir, 'checkpoints')
  record = {'flags': flags, 'run_dir': run_dir, 'machine': platform.node()}
  shm_before = set(os.listdir('/dev/shm'))

  logs = os.path.splitext(os.path.abspath(args.out))[0]  # the two runs' whole output, beside --out
  os.makedirs(os.path.dirname(logs), exist_ok=True)
  log1 = logs + '_killed_run.log'
  proc, log = _launch([*flags, '--use_mps', f'--run_dir={run_dir}'], log1)
  t0 = time.monotonic()
  try:
    while storage.latest_checkpoint_step(ckpt_dir) is None:
      if proc.poll() is not None or time.monotonic() - t0 > args.start_timeout_s:
        raise RuntimeError(f'no checkpoint within {args.start_timeout_s} s (exit {proc.poll()}); see {log1}')
      time.sleep(0.5)
    record['first_checkpoint_s'] = round(time.monotonic() - t0, 1)
    time.sleep(args.after_checkpoint_s)
    with open(os.path.join(run_dir, 'workers.json')) as f:
      workers = json.load(f)
    record['workers'] = workers['workers']
    record['gpu_processes_before_kill'] = _gpu_pids()
    mps = _mps_pids(pipe_dir)
    record['mps_processes_killed'] = mps
    if not mps:
      raise RuntimeError(f'no MPS process serves {pipe_dir}: did the run start MPS? see {log1}')
    record['checkpoint_step_at_kill'] = storage.latest_checkpoint_step(ckpt_dir)
    t_kill = time.monotonic()
    for pid in mps:
      os.kill(pid, signal.SIGKILL)
    try:
      record['exit_code'] = proc.wait(timeout=args.stop_timeout_s)
      record['stopped_after_kill_s'] = round(time.monotonic() - t_kill, 2)
    except subprocess.TimeoutExpired:
      record['exit_code'] = None
      record['stopped_after_kill_s'] = f'still running after {args.stop_timeout_s} s (killed by the probe)'
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    log.close()
  time.sleep(2.0)
  record['workers_left'] = [p for p in workers['workers'].values() if _alive(p)]
  record['mps_processes_left'] = _mps_pids(pipe_dir)
  record['gpu_processes_after'] = _gpu_pids()
  record['shm_segments_left'] = sorted(
      n for n in set(os.listdir('/dev/shm')) - shm_before if n.startswith(f'ebrl_{workers["controller"]}_'))
  record['messages'] = _interesting(log1)
  step = storage.latest_checkpoint_step(ckpt_dir)
  record['checkpoint_step_after'] = step

  # Resume without MPS, two iterations past the checkpoint.
  from ebrl_jax import main as ebrl_main  # pylint: disable=g-import-not-at-top
  ebrl_main.FLAGS([sys.argv[0], *flags])
  per_iteration = ebrl_main.config_from_flags().env_steps_per_iteration
  target = (step + 2) * per_iteration
  log2 = logs + '_resumed_run.log'
  t1 = time.monotonic()
  proc, log = _launch(
      [*flags, '--nouse_mps', '--resume', f'--run_dir={run_dir}', f'--num_timesteps={target}', '--num_evals=1'], log2)
  try:
    record['resume_exit_code'] = proc.wait(timeout=args.start_timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    record['resume_exit_code'] = None
  log.close()
  record['resume_s'] = round(time.monotonic() - t1, 1)
  try:
    with open(os.path.join(run_dir, 'summary.json')) as f:
      summary = json.load(f)
    record['resume_summary'] = {k: summary.get(k) for k in ('iterations', 'env_steps', 'final_eval_return')}
  except (OSError, ValueError) as e:
    record['resume_summary'] = f'no summary: {e}'
  record['resume_target_env_steps'] = target
  record['resume_messages'] = _interesting(log2, 8)
  record['ok'] = (record['exit_code'] not in (0, None) and not record['workers_left'] and
                  not record['mps_processes_left'] and not record['shm_segments_left'] and
                  record['resume_exit_code'] == 0 and isinstance(record['resume_summary'], dict) and
                  record['resume_summary'].get('env_steps') == target)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(record, f, indent=1)
  print(json.dumps(record, indent=1))


if __name__ == '__main__':
  main()
