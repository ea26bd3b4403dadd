r"""How a run stops on SIGTERM: starts `python -m ebrl_jax.main` with the given flags, sends SIGTERM a set time
after its first training metrics line, and records how long the process took to exit, its exit code and what its
summary says (stopped, env steps, env steps/s, start-up). For the GPU, where signals are held until an MJX chunk
ends (`errors.deferred_stops`):

  python -m experiments.stop_check --after_s=20 --out=experiments/results/stop_check_h200.json -- \
      --flagfile=experiments/w1_ant.flags --num_timesteps=50000000 --run_dir=/tmp/stop_check
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

TRAINING_LINE = 'rollout/env_steps_per_s'  # the driver's line after each chunk of training


def run(flags: list, after_s: float, timeout_s: float) -> dict:
  """Runs main with `flags`; SIGTERM `after_s` seconds after the first chunk of training was logged."""
  started = time.time()
  proc = subprocess.Popen([sys.executable, '-u', '-m', 'ebrl_jax.main', *flags],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
  lines, first_training, sent = [], None, None
  try:
    for line in proc.stdout:
      lines.append(line)
      now = time.time()
      if first_training is None and TRAINING_LINE in line:
        first_training = now
      if first_training is not None and sent is None and now - first_training >= after_s:
        proc.send_signal(signal.SIGTERM)
        sent = now
      if now - started > timeout_s:
        proc.kill()
        break
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  ended = time.time()
  return {
      'flags': flags,
      'returncode': proc.returncode,
      'first_training_s': None if first_training is None else round(first_training - started, 3),
      'sigterm_s': None if sent is None else round(sent - started, 3),
      'exit_after_sigterm_s': None if sent is None else round(ended - sent, 3),
      'stop_lines': [l.strip() for l in lines if 'STOPPED' in l or 'stopping at iteration' in l],
      'output_tail': ''.join(lines[-15:]),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--after_s', type=float, default=20.0, help='seconds after the first training line')
  parser.add_argument('--timeout_s', type=float, default=600.0)
  parser.add_argument('--out', required=True)
  parser.add_argument('flags', nargs='+', help='flags for ebrl_jax.main (after --)')
  args = parser.parse_args(argv)
  result = run(args.flags, args.after_s, args.timeout_s)
  run_dir = next((f.split('=', 1)[1] for f in args.flags if f.startswith('--run_dir=')), None)
  summary_path = os.path.join(run_dir, 'summary.json') if run_dir else None
  if summary_path and os.path.exists(summary_path):
    with open(summary_path) as f:
      s = json.load(f)
    result['summary'] = {
        k: s.get(k) for k in ('stopped', 'env_steps', 'iterations', 'env_steps_per_s', 'compile_s', 'wall_s', 'device',
                             'backend', 'compile_breakdown')
    }
    result['summary']['last_checkpoint'] = s.get('extra', {}).get('last_checkpoint')
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: v for k, v in result.items() if k != 'output_tail'}, indent=1))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
