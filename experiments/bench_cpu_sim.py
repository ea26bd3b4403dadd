"""Native-MuJoCo env throughput of CpuEnvPool at 1 and N threads, and the bare mj_step rate for reference.

    python experiments/bench_cpu_sim.py [--tasks ant,inverted_pendulum] [--num_envs 64] [--seconds 3]

Writes experiments/results/cpu_sim_<N>cpu.json (N: CPUs available to this process). Random actions in
[-1, 1] with auto-reset on, as in training; the first steps (warm-up) are not timed. The load average before
and after is recorded: run it on an otherwise idle machine, or the threaded figures mean little.
"""
import argparse
import json
import os
import platform
import time

import mujoco
import numpy as np

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import registry


def bench_pool(task: str, num_envs: int, num_threads: int, seconds: float) -> dict:
  spec = registry.env_spec(task, 1000)
  rng = np.random.default_rng(0)
  actions = rng.uniform(-1, 1, (16, num_envs, spec.action_dim))
  with cpu_env.CpuEnvPool(task, num_envs, 1000, num_threads=num_threads, seed=0) as pool:
    for i in range(10):
      pool.step(actions[i % 16])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
      pool.step(actions[steps % 16])
      steps += 1
    elapsed = time.perf_counter() - start
  env_steps = steps * num_envs / elapsed
  n_frames = registry.load(task).n_frames
  return dict(task=task,
              num_envs=num_envs,
              num_threads=num_threads,
              pool_steps=steps,
              seconds=elapsed,
              env_steps_per_s=env_steps,
              physics_steps_per_s=env_steps * n_frames,
              us_per_pool_step=1e6 * elapsed / steps)


def bench_bare_mj_step(task: str, seconds: float) -> dict:
  """One MjData, ctrl fixed, mj_step(nstep=n_frames) in a loop: the physics cost without any pool overhead."""
  task_def = registry.load(task)
  model = cpu_env.load_model(task_def)
  data = mujoco.MjData(model)
  mujoco.mj_forward(model, data)
  data.ctrl[:] = 0.1
  steps, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    for _ in range(100):
      mujoco.mj_step(model, data, task_def.n_frames)
      if not np.isfinite(data.qpos).all():
        mujoco.mj_resetData(model, data)
    steps += 100
  elapsed = time.perf_counter() - start
  return dict(task=task, env_steps_per_s=steps / elapsed, physics_steps_per_s=steps * task_def.n_frames / elapsed)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tasks', default='ant,inverted_pendulum')
  parser.add_argument('--num_envs', type=int, default=64)
  parser.add_argument('--seconds', type=float, default=3.0)
  parser.add_argument('--out_dir', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results'))
  args = parser.parse_args()
  ncpu = len(os.sched_getaffinity(0))
  thread_counts = sorted({1, ncpu})
  result = dict(loadavg_before=os.getloadavg(),
                cpu_count=ncpu,
                os_cpu_count=os.cpu_count(),
                processor=platform.processor() or platform.machine(),
                mujoco_version=mujoco.__version__,
                python=platform.python_version(),
                num_envs=args.num_envs,
                bare_mj_step=[],
                pool=[],
                speedup={})
  for task in args.tasks.split(','):
    result['bare_mj_step'].append(bench_bare_mj_step(task, args.seconds))
    rates = {}
    for threads in thread_counts:
      row = bench_pool(task, args.num_envs, threads, args.seconds)
      result['pool'].append(row)
      rates[threads] = row['env_steps_per_s']
      print(f"{task:18s} threads={threads} {row['env_steps_per_s']:10.0f} env-steps/s "
            f'{row["physics_steps_per_s"]:10.0f} physics-steps/s ({row["us_per_pool_step"]:.0f} us per pool step)')
    result['speedup'][task] = rates[max(thread_counts)] / rates[1]
    bare = result['bare_mj_step'][-1]
    print(f'{task:18s} bare mj_step, 1 thread: {bare["env_steps_per_s"]:10.0f} env-steps/s; '
          f'speed-up {max(thread_counts)} vs 1 thread: {result["speedup"][task]:.2f}x')
  # NOTE: other processes on the machine skew the threaded figures; compare these with cpu_count.
  result['loadavg_after'] = os.getloadavg()
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f'cpu_sim_{ncpu}cpu.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2)
  print('wrote', path)


if __name__ == '__main__':
  main()
