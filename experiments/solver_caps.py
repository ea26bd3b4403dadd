r"""What the constraint-solver caps (--solver_iterations, --ls_iterations) change for a task: work and fidelity.

    python -m experiments.solver_caps --out=$OUT/solver_caps_h200.json                 (GPU machine: MJX on the GPU)
    JAX_PLATFORMS=cpu python -m experiments.solver_caps --mjx_envs=64 --out=/tmp/s.json (CPU)

push_cube keeps MuJoCo's defaults (Newton, 100 iterations, 50 linesearch iterations; Brax caps ant and humanoid at
1 / 4). In MJX 3.17 the solver is a `lax.while_loop` that runs until every env of the batch has converged (or
reached the cap), and the linesearch a `lax.scan` of `ls_iterations` steps whose per-step `lax.cond` becomes a
select under vmap, so every env computes all of them. Sections:

  native    native MuJoCo, `--native_envs` envs from the task's resets (seed 0) under the same uniform random
            actions: solver iterations of each env step's last physics step (mean over envs, and the batch maximum that a vmapped while loop runs), and per cap
            setting the share of physics steps that reach the cap and how far the envs' cube and arm end up from
            the uncapped run's (max and median over envs of |qpos - qpos_default| after `--steps` env steps).
  mjx       MJX (the backend `jax.devices()` gives: CPU here, the GPU on the device; `--impls`: its JAX and/or Warp
            implementation) through the project's env (`make_mjx_env(..., solver=caps)`): env steps/s of a jitted `--scan`-step scan of the batch step for
            `--mjx_envs` envs, per cap setting, with its compile seconds and how far its envs' qpos end from the
            first setting's after the scan (same reset, same actions).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import mujoco
import numpy as np

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import registry


def _parse_caps(text: str):
  """'0:0,4:8' -> ((0, 0), (4, 8)); 0 keeps the task's own."""
  return tuple(tuple(int(v) for v in item.split(':')) for item in text.split(','))


def _pool(task_name: str, n: int, caps):
  return cpu_env.CpuEnvPool(task_name, n, 1000, num_threads=1, seed=0, auto_reset=False, solver=caps)


def _native_run(task_name, caps, actions):
  """qpos after the action sequence [T, B, A] from the pool's resets (seed 0: the same for every cap), and the
  solver iterations of every env step's last physics step [T, B]."""
  with _pool(task_name, actions.shape[1], caps) as pool:
    pool.reset()
    iters = np.zeros(actions.shape[:2], np.int64)
    for t, row in enumerate(actions):
      pool.step(row.astype(np.float32))
      iters[t] = [d.solver_niter[0] for d in pool._datas]  # pylint: disable=protected-access
    return np.stack([d.qpos.copy() for d in pool._datas]), iters  # pylint: disable=protected-access


def _one_step_deviation(task_name, caps, actions) -> dict:
  """From the states of env 0 along the uncapped run: one physics step with the capped and with the uncapped
  model from the same state and control; |qvel difference| (max over dofs), median and max over the states."""
  with _pool(task_name, 1, (0, 0)) as base, _pool(task_name, 1, caps) as capped:
    base.reset()
    d = base._datas[0]  # pylint: disable=protected-access
    probe = mujoco.MjData(base.model)
    devs = []
    for row in actions[:, :1]:
      base.step(row.astype(np.float32))  # sets the control (scaled as the task does) and steps
      mujoco.mj_copyData(probe, base.model, d)
      mujoco.mj_step(capped.model, probe)
      mujoco.mj_step(base.model, d)
      devs.append(float(np.abs(probe.qvel - d.qvel).max()))
  return {'one_step_qvel_dev_median': float(np.median(devs)), 'one_step_qvel_dev_max': float(np.max(devs))}


def native_section(args, task_name: str) -> dict:
  task = registry.load(task_name)
  rng = np.random.default_rng(0)
  actions = rng.uniform(-1, 1, (args.steps, args.native_envs, task.action_dim))
  base_q, base_iters = _native_run(task_name, (0, 0), actions)
  out = {'envs': args.native_envs, 'env_steps': args.steps, 'task_options': dict(registry.solver_caps(task))}
  out['default'] = {
      'iterations_mean': float(base_iters.mean()),
      'iterations_batch_max_mean': float(base_iters.max(axis=1).mean()),
      'iterations_batch_max_p99': float(np.percentile(base_iters.max(axis=1), 99)),
      'iterations_max': int(base_iters.max())
  }
  # The chaos reference: the uncapped run again with every action moved by 1e-9, how far trajectories part anyway.
  q, _ = _native_run(task_name, (0, 0), actions + 1e-9)
  out['default']['qpos_dev_of_1e-9_actions_median'] = float(np.median(np.abs(q - base_q).max(axis=1)))
  for caps in args.caps:
    if caps == (0, 0):
      continue
    q, iters = _native_run(task_name, caps, actions)
    cap = dict(registry.solver_caps(task, caps)).get('iterations', 100)
    dq = np.abs(q - base_q).max(axis=1)
    out[f'{caps[0]}:{caps[1]}'] = {
        'share_at_cap': float((iters >= cap).mean()),
        'qpos_dev_max': float(dq.max()),
        'qpos_dev_median': float(np.median(dq)),
        **_one_step_deviation(task_name, caps, actions)
    }
  return out


def mjx_section(args, task_name: str, episode_length: int, impl: str) -> dict:
  out = {'device': jax.devices()[0].device_kind, 'impl': impl, 'envs': args.mjx_envs, 'scan': args.scan}
  first_q = None  # the first setting's qpos after the scan, which the others are compared with
  for caps in args.caps:
    env = mjx_env.make_mjx_env(task_name, episode_length, 1, True, impl=impl, solver=caps)
    state = jax.jit(env.reset)(jax.random.split(jax.random.PRNGKey(0), args.mjx_envs))
    act = jax.random.uniform(jax.random.PRNGKey(1), (args.scan, args.mjx_envs, env.action_size), minval=-1, maxval=1)

    def run(s, a):
      return jax.lax.scan(lambda s, x: (env.step(s, x), None), s, a)[0]

    start = time.perf_counter()
    compiled = jax.jit(run).lower(state, act).compile()
    compile_s = time.perf_counter() - start
    q = np.asarray(compiled(state, act).pipeline_state.q)
    first_q = q if first_q is None else first_q
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(state, act))
      times.append(time.perf_counter() - start)
    t = statistics.median(times)
    out[f'{caps[0]}:{caps[1]}'] = {
        'env_steps_per_s': args.scan * args.mjx_envs / t,
        'ms_per_env_step': 1e3 * t / args.scan,
        'compile_s': compile_s,
        'qpos_dev_from_first_max':
            float(np.abs(q - first_q).max())  # after the scan, same reset and actions
    }
    print(impl, caps, out[f'{caps[0]}:{caps[1]}'], flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--task', default='push_cube')
  parser.add_argument('--caps', type=_parse_caps, default=_parse_caps('0:0,0:8,4:8,2:4'))
  parser.add_argument('--steps', type=int, default=50, help='env steps of the native fidelity run')
  parser.add_argument('--native_envs', type=int, default=32)
  parser.add_argument('--mjx_envs', type=int, default=1024)
  parser.add_argument('--scan', type=int, default=16)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--sections', default='native,mjx')
  parser.add_argument('--impls', default='jax', help="MJX implementations to time: jax, warp (CUDA GPU), 'jax,warp'")
  args = parser.parse_args()
  task = registry.load(args.task)
  result = {'task': args.task, 'caps': [list(c) for c in args.caps]}

  def save():  # after every section, so a section that fails or is cut keeps the others
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)

  if 'native' in args.sections:
    result['native'] = native_section(args, args.task)
    print('native', json.dumps(result['native']), flush=True)
    save()
  for impl in args.impls.split(',') if 'mjx' in args.sections else ():
    result[f'mjx_{impl}'] = mjx_section(args, args.task, task.default_episode_length, impl)
    save()


if __name__ == '__main__':
  main()
