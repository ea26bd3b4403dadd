r"""Unusual but valid flag combinations, each a tiny real run of `python -m ebrl_jax.main` on this machine's CPU:
every schedule on both CPU-capable backends, with the MLP, transformer and token policies, pixels, GRPO,
randomisation, a separate generation worker, env slices, odd group counts, `--deterministic`, `auto`.

  python -m experiments.combos --out=experiments/results/combos_cpu.json     # every combination (~25 min, 2 cores)
  python -m experiments.combos --only=pend_cpu_sync_2envs,hopper_cpu_auto    # some
  python -m experiments.combos --check                                       # only parse each into a Config
  python -m experiments.combos --extra=--num_timesteps=8000                  # flags added to every combination

A combination passes when its run exits 0 with a summary that counts at least --num_timesteps env steps and leaves
no process (found by a marker in its environment, as the fault suite finds them) and no shared-memory
segment behind. The table (`--out`) lists each one's exit, seconds, env steps,
final return, leftovers and last log line; the exit code is 1 when any failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List

from absl import flags

from ebrl_jax import main as ebrl_main
from experiments import faults_kill_controller as kill_controller
from experiments.bench import run as bench_run

STEPS = 2000
BASE = [
    '--platform=cpu', '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--num_eval_envs=4',
    '--episode_length=40', '--num_envs=16', '--unroll_length=5', '--batch_size=16', '--num_minibatches=2',
    '--num_updates_per_batch=1', f'--num_timesteps={STEPS}', '--num_evals=2', '--telemetry_period_s=0'
]
TRANSFORMER = ['--policy=transformer', '--d_model=32', '--num_layers=1', '--num_heads=2']
TOKEN = ['--policy=token', '--d_model=32', '--num_layers=1', '--num_heads=2', '--num_bins=16']
PIXELS = ['--obs=pixels', '--image_size=16']
COMBOS: Dict[str, List[str]] = {
    'hopper_cpu_sync_3groups': [
        '--task=hopper', '--backend=mujoco_cpu', '--schedule=sync', '--num_groups=3', '--num_envs=24',
        '--batch_size=24', '--num_minibatches=1'
    ],
    'reacher_mjx_async_transformer_chunk2':
        ['--task=reacher', '--backend=mjx', '--schedule=async', '--action_chunk=2', '--unroll_length=6'] + TRANSFORMER,
    'push_cpu_pixels_fused_stack2': ['--task=push_cube', '--backend=mujoco_cpu', '--schedule=fused', '--frame_stack=2']
                                    + PIXELS,
    'push_cpu_pixels_async_token_patches':
        ['--task=push_cube', '--backend=mujoco_cpu', '--schedule=async', '--vision_encoder=patches', '--patch_size=4'] +
        PIXELS + TOKEN,
    'walker_mjx_overlap_grpo': [
        '--task=walker2d', '--backend=mjx', '--schedule=overlap', '--algo=grpo', '--group_size=4'
    ],
    'humanoid_cpu_async_generation_slices': [
        '--task=humanoid', '--backend=mujoco_cpu', '--schedule=async', '--nocolocate_generation', '--env_slices=2'
    ],
    'ant_mjx_sync_generation': ['--task=ant', '--backend=mjx', '--schedule=sync', '--nocolocate_generation'],
    'cheetah_cpu_overlap_transformer': ['--task=halfcheetah', '--backend=mujoco_cpu', '--schedule=overlap'] +
                                       TRANSFORMER,
    'pend_cpu_async_grpo_deterministic': [
        '--task=inverted_pendulum', '--backend=mujoco_cpu', '--schedule=async', '--algo=grpo', '--group_size=4',
        '--deterministic'
    ],
    'push_mjx_sync_randomized': [
        '--task=push_cube', '--backend=mjx', '--schedule=sync', '--ls_iterations=8',
        '--randomize=friction=0.8:1.2,mass=0.9:1.1,gain=0.9:1.1'
    ],
    'hopper_cpu_auto': ['--task=hopper', '--backend=mujoco_cpu', '--schedule=auto'],
    'walker_cpu_fused_repeat2': ['--task=walker2d', '--backend=mujoco_cpu', '--schedule=fused', '--action_repeat=2'],
    'pend_cpu_sync_2envs': [
        '--task=inverted_pendulum', '--backend=mujoco_cpu', '--schedule=sync', '--num_envs=2', '--num_groups=2',
        '--batch_size=2', '--num_minibatches=1'
    ],
    'reacher_cpu_async_trainer_evaluates': [
        '--task=reacher', '--backend=mujoco_cpu', '--schedule=async', '--evaluator=trainer', '--target_return=1e9'
    ],
    'push_cpu_pixels_overlap_depth_randomized': [
        '--task=push_cube', '--backend=mujoco_cpu', '--schedule=overlap', '--pixel_depth',
        '--randomize=camera=-0.02:0.02,color=0.8:1.2'
    ] + PIXELS,
    'hopper_mjx_async_4groups_staleness3': [
        '--task=hopper', '--backend=mjx', '--schedule=async', '--num_groups=4', '--max_staleness=3', '--num_envs=32'
    ],
    'push_cpu_pixels_sync_proprio_2groups': [  # the camera beside the arm's own state only (added after the 17)
        '--task=push_cube', '--backend=mujoco_cpu', '--schedule=sync', '--num_groups=2', '--pixel_state=proprio'
    ] + PIXELS,
    'cheetah_mjx_fused_bf16_transformer':
        ['--task=halfcheetah', '--backend=mjx', '--schedule=fused', '--compute_dtype=bfloat16'] + TRANSFORMER,
}


def check(names: List[str], extra: List[str]) -> Dict[str, str]:
  """Each combination parsed into a Config as `ebrl_jax.main` parses its command line: '' or the error."""
  errors = {}
  for name in names:
    flags.FLAGS.unparse_flags()
    try:
      flags.FLAGS(['combos', *BASE, *COMBOS[name], *extra, '--run_dir=/nonexistent/combos'])
      ebrl_main.config_from_flags()
      errors[name] = ''
    except (ValueError, flags.Error) as e:
      errors[name] = str(e)
  return errors


def _num_timesteps(extra: List[str]) -> int:
  given = [int(f.split('=', 1)[1]) for f in extra if f.startswith('--num_timesteps=')]
  return given[-1] if given else STEPS


def run_one(name: str, extra: List[str], root: str, timeout_s: float) -> dict:
  run_dir = os.path.join(root, name)
  shm_before = set(os.listdir('/dev/shm'))
  start = time.monotonic()
  # Every process the run starts (workers, their children) inherits this marker, as the fault suite's runs do.
  marker = uuid.uuid4().hex
  proc = subprocess.Popen([sys.executable, '-m', 'ebrl_jax.main', *BASE, *COMBOS[name], *extra, f'--run_dir={run_dir}'],
                          env=dict(os.environ, **{kill_controller.MARKER: marker}),
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE,
                          text=True)
  try:
    _, err = proc.communicate(timeout=timeout_s)
    code = proc.returncode
  except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
    code = 'timeout'
  lines = (err or '').strip().splitlines()
  seconds = time.monotonic() - start
  time.sleep(1.0)  # workers that outlive the controller would show here
  procs = kill_controller.marked_processes(marker)
  for pid in procs:  # the next combination starts clean
    os.kill(pid, signal.SIGKILL)
  shm = sorted(set(os.listdir('/dev/shm')) - shm_before)
  summary = {}
  if os.path.exists(os.path.join(run_dir, 'summary.json')):
    with open(os.path.join(run_dir, 'summary.json')) as f:
      summary = json.load(f)
  steps = summary.get('env_steps') or 0
  return {
      'flags': COMBOS[name] + extra,
      'exit': code,
      'seconds': round(seconds, 1),
      'env_steps': steps,
      'final_eval_return': summary.get('final_eval_return'),
      'processes_left': procs,
      'shm_left': shm,
      'last_line': lines[-1][:300] if lines else '',
      'passed': code == 0 and steps >= _num_timesteps(extra) and not procs and not shm
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--only', default='', help='comma-separated combination names (default: all)')
  parser.add_argument('--check', action='store_true', help='only parse each combination into a Config')
  parser.add_argument('--out', default='', help='the table, JSON')
  parser.add_argument('--timeout_s', type=float, default=400.0, help='per run')
  parser.add_argument('--extra', action='append', default=[], help='a flag added to every combination (repeatable)')
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(',') if n] or list(COMBOS)
  unknown = [n for n in names if n not in COMBOS]
  if unknown:
    parser.error(f'--only: unknown combinations {", ".join(unknown)}; known: {", ".join(COMBOS)}')
  if args.check:
    errors = check(names, args.extra)
    for name, error in errors.items():
      print(f'{name}: {error or "ok"}')
    return 1 if any(errors.values()) else 0
  provenance = {'commit': bench_run.commit(), 'tree': bench_run.source_tree(), 'machine': bench_run.machine()}
  root = tempfile.mkdtemp(prefix='ebrl_combos_')
  table = {}
  try:
    for name in names:
      table[name] = run_one(name, args.extra, root, args.timeout_s)
      print(name, json.dumps({k: v for k, v in table[name].items() if k != 'flags'}), flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({**provenance, 'base_flags': BASE, 'extra_flags': args.extra, 'combos': table}, f, indent=1)
  failed = [n for n, r in table.items() if not r['passed']]
  print(f'{len(table) - len(failed)} of {len(table)} passed' + (f'; failed: {", ".join(failed)}' if failed else ''))
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
