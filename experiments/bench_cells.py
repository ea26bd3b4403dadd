"""1 cell vs N cells through the entry point (`--launcher=local`), the same envs per cell.

  python -m experiments.bench_cells --out experiments/results/cells_cpu.json [--cells 1,2] [--num_timesteps N]
  # a workload on a multi-GPU host (one cell per GPU), e.g. W1 / W2 / W5 as async cells:
  python -m experiments.bench_cells --out experiments/results/cells_w1_gpu.json --flagfile experiments/w1_ant.flags \
      --cells 1,2 --num_timesteps 2000000 --extra=--schedule=async,--evaluator=trainer,--num_evals=2
  # W1 as MJX fused cells (1 cell: the one-cell chunk program; N: each cell's collection program + the rank step):
  python -m experiments.bench_cells --out experiments/results/cells_w1_fused.json --flagfile experiments/w1_ant.flags \
      --cells 1,2 --num_timesteps 2000000 --extra=--schedule=fused,--num_evals=2

Without --flagfile each run is the quickstart's pendulum PPO at a small size (fused, CPU). The result keeps each
run's global env steps, its end-to-end env steps/s (rank 0's summary: start-up and evaluation excluded), its wall
time, rank 0's trainer seconds in its train steps (the all-reduce inside), for N > 1 cells rank 0's mean train step
and one all-reduce of the gradients' size timed alone beside it (`summary.extra.cells`: `train_step_s`,
`allreduce_s`, `allreduce_bytes`; NCCL on GPUs, gloo on CPU), and whether the ranks' parameter chains agree. On a
CPU machine the cells share its cores, so this measures the cells' overhead, not a speed-up.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

FLAGS = ('--platform=cpu', '--task=inverted_pendulum', '--backend=mujoco_cpu', '--num_envs=32', '--num_eval_envs=4',
         '--num_threads=1', '--batch_size=32', '--num_minibatches=4', '--unroll_length=5', '--num_updates_per_batch=2',
         '--episode_length=1000', '--num_evals=2', '--compilation_cache_dir=', '--noprogress_bar',
         '--telemetry_period_s=0', '--checkpoint_every=0', '--first_checkpoint_iteration=0')


def run(cells: int, num_timesteps: int, run_dir: str, flags=FLAGS) -> dict:
  cmd = [sys.executable, '-m', 'ebrl_jax.main', *flags, f'--run_dir={run_dir}', f'--num_timesteps={num_timesteps}']
  if cells > 1:
    cmd += ['--launcher=local', f'--num_processes={cells}']
  t0 = time.time()
  env = dict(os.environ, **({'JAX_PLATFORMS': 'cpu'} if flags is FLAGS else {}))
  out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  with open(os.path.join(run_dir, 'summary.json')) as f:
    s = json.load(f)
  cells_extra = s['extra'].get('cells', {})
  chains = [cells_extra.get('params_chain')]
  for r in range(1, cells):
    with open(os.path.join(run_dir, f'rank{r}', 'summary.json')) as f:
      chains.append(json.load(f)['extra']['cells']['params_chain'])
  return {
      'cells': cells,
      'envs_per_cell': _num_envs(run_dir),
      'schedule': s['schedule'],
      'device': s['device'],
      'env_steps': s['env_steps'],
      'env_steps_per_s': round(s['env_steps_per_s'], 1),
      'train_wall_s': round(s['train_wall_s'], 2),
      'compile_s': round(s['compile_s'], 2),
      'trainer_train_s': _train_s(s),
      'train_step_s': cells_extra.get('train_step_s'),  # rank 0's mean train step, its all-reduce inside
      'allreduce_s': cells_extra.get('allreduce_s'),  # one all-reduce of the gradients' size, timed alone
      'allreduce_bytes': cells_extra.get('allreduce_bytes'),
      'allreduce_fraction': cells_extra.get('allreduce_fraction'),
      'command_wall_s': round(time.time() - t0, 2),
      'ranks_hold_the_same_parameters': len(set(chains)) == 1
  }


def _num_envs(run_dir: str) -> int:
  with open(os.path.join(run_dir, 'config.json')) as f:
    return json.load(f)['sim']['num_envs']


def _train_s(summary: dict):
  """Rank 0's trainer worker's seconds in its train steps, the all-reduce inside and the first step's compile
  with them (process schedules only: None under fused)."""
  train_s = summary['extra'].get('train_s')
  return round(train_s, 3) if train_s is not None else None


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  p.add_argument('--cells', default='1,2')
  p.add_argument('--num_timesteps', type=int, default=64_000)
  p.add_argument('--flagfile', default='', help='a workload flagfile instead of the small CPU pendulum')
  p.add_argument('--extra', default='', help='comma-separated flags after the flagfile (e.g. --schedule=async)')
  a = p.parse_args()
  flags = FLAGS
  if a.flagfile:
    flags = (f'--flagfile={a.flagfile}', '--noprogress_bar', '--telemetry_period_s=0', '--checkpoint_every=0',
             '--first_checkpoint_iteration=0', *[f for f in a.extra.split(',') if f])
  runs = []
  for n in (int(c) for c in a.cells.split(',')):
    with tempfile.TemporaryDirectory() as d:
      # the same env steps per cell: N cells train on N times the global batch in the same iterations
      runs.append(run(n, a.num_timesteps * n, os.path.join(d, 'run'), flags))
      print(runs[-1], flush=True)
  result = {
      'what': ('fused cells through --launcher=local, gloo all-reduce, 32 native-MuJoCo pendulum envs per cell, '
               'the same iterations: global env steps/s of N cells vs 1') if not a.flagfile else
              (f'{a.flagfile} {a.extra} through --launcher=local, one cell per GPU, the same envs per cell: global '
               'env steps/s of N cells vs 1'),
      'flags':
          list(flags),
      'machine': (f'{os.cpu_count()} cores ({platform.processor() or "?"}), device {runs[0]["device"]}' if a.flagfile
                  else f'CPU only ({os.cpu_count()} cores, shared with other work; {platform.processor() or "?"}): '
                  'the cells share these cores, so this is the cost of the cells, not the speed-up of GPUs'),
      'runs':
          runs,
      'ratio_vs_1_cell': {
          str(r['cells']): round(r['env_steps_per_s'] / runs[0]['env_steps_per_s'], 3) for r in runs
      }
  }
  if not a.flagfile:
    result['multi_gpu'] = 'not measured here: run this with --flagfile on a multi-GPU host (see the docstring)'
  with open(a.out, 'w') as f:
    json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
