r"""How a run stops on SIGTERM: starts `python -m ebrl_jax.main` with the given flags (--run_dir among them), sends
SIGTERM a set time after its first line of training metrics (in --run_dir's metrics.jsonl, for every schedule),
and records how long the process took to exit, its exit code and what its summary says (stopped, env steps, env
steps/s, start-up). For the GPU, where signals are held until an MJX chunk
ends (`errors.deferred_stops`):

  python -m experiments.stop_check --after_s=20 --out=experiments/results/stop_check_h200.json -- \
      --flagfile=experiments/w1_ant.flags --num_timesteps=50000000 --run_dir=/tmp/stop_check

With `--resume_train_s=S` the same command then runs again with `--resume --max_train_s=S`, and the record says
whether it continued at the stop's checkpoint (the trainer's restore checks every array against the fingerprint
its save recorded) and how it ended.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

TRAINING_METRIC = '"train/'  # a metrics.jsonl line of the driver's after a chunk of training, in every schedule


def _metrics_size(run_dir) -> int:
  try:
    return os.path.getsize(os.path.join(run_dir, 'metrics.jsonl'))
  except OSError:
    return 0


def _trained(run_dir, skip: int) -> bool:
  """Whether the run's metrics.jsonl (written by the driver, in the trainer's process for every schedule; the
  process schedules print no metrics to stdout) holds a line of training metrics past its first `skip` bytes (an
  earlier session's)."""
  try:
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
      f.seek(skip)
      return TRAINING_METRIC in f.read()
  except OSError:
    return False


def run(flags: list, after_s: float, timeout_s: float) -> dict:
  """Runs main with `flags`; SIGTERM `after_s` seconds after its first chunk of training was logged (its
  metrics.jsonl in --run_dir)."""
  run_dir = next(f.split('=', 1)[1] for f in flags if f.startswith('--run_dir='))
  skip, started = _metrics_size(run_dir), time.time()
  proc = subprocess.Popen([sys.executable, '-u', '-m', 'ebrl_jax.main', *flags],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  first_training, sent = None, None
  try:
    while proc.poll() is None:
      now = time.time()
      if first_training is None and _trained(run_dir, skip):
        first_training = now
      if first_training is not None and sent is None and now - first_training >= after_s:
        proc.send_signal(signal.SIGTERM)
        sent = now
      if now - started > timeout_s:
        proc.kill()
        break
      time.sleep(0.1)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  ended = time.time()
  reader.join(timeout=10)
  return {
      'flags': flags,
      'returncode': proc.returncode,
      'first_training_s': None if first_training is None else round(first_training - started, 3),
      'sigterm_s': None if sent is None else round(sent - started, 3),
      'exit_after_sigterm_s': None if sent is None else round(ended - sent, 3),
      'stop_lines': [l.strip() for l in lines if 'STOPPED' in l or 'stopping at iteration' in l],
      'output_tail': ''.join(lines[-15:]),
  }


def _summary(run_dir):
  """What the run's summary.json says of how it ended (None without one)."""
  path = os.path.join(run_dir, 'summary.json') if run_dir else None
  if not path or not os.path.exists(path):
    return None
  with open(path) as f:
    s = json.load(f)
  out = {
      k: s.get(k) for k in ('stopped', 'env_steps', 'iterations', 'env_steps_per_s', 'compile_s', 'wall_s', 'device',
                           'backend', 'compile_breakdown', 'final_eval_return')
  }
  out['last_checkpoint'] = s.get('extra', {}).get('last_checkpoint')
  out['resumed_from'] = s.get('extra', {}).get('resumed_from')
  return out


def _resume(flags: list, timeout_s: float) -> dict:
  """Runs main with `flags` (a --resume) to its end."""
  started = time.time()
  try:
    proc = subprocess.run([sys.executable, '-u', '-m', 'ebrl_jax.main', *flags],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=timeout_s)
    code, out = proc.returncode, proc.stdout
  except subprocess.TimeoutExpired as e:
    code, out = None, e.stdout if isinstance(e.stdout, str) else (e.stdout or b'').decode(errors='replace')
  lines = out.splitlines()
  return {
      'flags': flags,
      'returncode': code,
      'wall_s': round(time.time() - started, 3),
      'resume_lines': [l.strip() for l in lines if 'esum' in l and ('checkpoint' in l or 'Resum' in l)][:6],
      'output_tail': '\n'.join(lines[-15:]),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--after_s', type=float, default=20.0, help='seconds after the first training line')
  parser.add_argument('--timeout_s', type=float, default=600.0)
  parser.add_argument('--out', required=True)
  parser.add_argument('--resume_train_s',
                      type=float,
                      default=0.0,
                      help='then resume with --max_train_s of this (0: no resume)')
  parser.add_argument('flags', nargs='+', help='flags for ebrl_jax.main (after --)')
  args = parser.parse_args(argv)
  if not any(f.startswith('--run_dir=') for f in args.flags):
    parser.error('pass --run_dir=DIR among the flags: the check reads its metrics.jsonl and summary.json')
  result = run(args.flags, args.after_s, args.timeout_s)
  run_dir = next((f.split('=', 1)[1] for f in args.flags if f.startswith('--run_dir=')), None)
  result['summary'] = _summary(run_dir)
  if args.resume_train_s > 0:
    flags = args.flags + ['--resume', f'--max_train_s={args.resume_train_s:g}']
    resumed = _resume(flags, args.timeout_s)
    resumed['summary'] = _summary(run_dir)
    stopped_at = (result['summary'] or {}).get('last_checkpoint')
    resumed['continued_at_the_stop'] = stopped_at is not None and ((resumed['summary'] or {}).get('resumed_from') or
                                                                   {}).get('step') == stopped_at
    result['resume'] = resumed
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: v for k, v in result.items() if k != 'output_tail'}, indent=1))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
