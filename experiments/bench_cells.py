"""1 cell vs N cells of the fused schedule through the entry point (`--launcher=local`), same envs per cell.

  python -m experiments.bench_cells --out experiments/results/cells_cpu.json [--cells 1,2] [--num_timesteps N]

Each run is the quickstart's pendulum PPO at a small size; the result keeps each run's global env steps, its
end-to-end env steps/s (rank 0's summary: start-up and evaluation excluded), its wall time and whether the ranks'
parameter chains agree. On a CPU machine the cells share its cores, so this measures the cells' overhead, not a
speed-up; the multi-GPU figures need a multi-GPU machine.
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


def run(cells: int, num_timesteps: int, run_dir: str) -> dict:
  cmd = [sys.executable, '-m', 'ebrl_jax.main', *FLAGS, f'--run_dir={run_dir}', f'--num_timesteps={num_timesteps}']
  if cells > 1:
    cmd += ['--launcher=local', f'--num_processes={cells}']
  t0 = time.time()
  out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  with open(os.path.join(run_dir, 'summary.json')) as f:
    s = json.load(f)
  chains = [s['extra'].get('cells', {}).get('params_chain')]
  for r in range(1, cells):
    with open(os.path.join(run_dir, f'rank{r}', 'summary.json')) as f:
      chains.append(json.load(f)['extra']['cells']['params_chain'])
  return {
      'cells': cells,
      'envs_per_cell': 32,
      'env_steps': s['env_steps'],
      'env_steps_per_s': round(s['env_steps_per_s'], 1),
      'train_wall_s': round(s['train_wall_s'], 2),
      'compile_s': round(s['compile_s'], 2),
      'command_wall_s': round(time.time() - t0, 2),
      'ranks_hold_the_same_parameters': len(set(chains)) == 1
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  p.add_argument('--cells', default='1,2')
  p.add_argument('--num_timesteps', type=int, default=64_000)
  a = p.parse_args()
  runs = []
  for n in (int(c) for c in a.cells.split(',')):
    with tempfile.TemporaryDirectory() as d:
      # the same env steps per cell: N cells train on N times the global batch in the same iterations
      runs.append(run(n, a.num_timesteps * n, os.path.join(d, 'run')))
      print(runs[-1], flush=True)
  result = {
      'what': ('fused cells through --launcher=local, gloo all-reduce, 32 native-MuJoCo pendulum envs per cell, '
               'the same iterations: global env steps/s of N cells vs 1'),
      'machine': f'CPU only ({os.cpu_count()} cores, shared with other work; {platform.processor() or "?"}): the '
                 'cells share these cores, so this is the cost of the cells, not the speed-up of GPUs',
      'multi_gpu': 'blocked: no multi-GPU machine was lent (W1/W2/W5 on 2, 4, 8 GPUs not measured)',
      'runs': runs,
      'ratio_vs_1_cell': {
          str(r['cells']): round(r['env_steps_per_s'] / runs[0]['env_steps_per_s'], 3) for r in runs
      }
  }
  with open(a.out, 'w') as f:
    json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
