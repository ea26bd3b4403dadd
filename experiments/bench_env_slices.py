r"""The async schedule with a separate generation worker on native MuJoCo, with `--env_slices` 1 vs 2 vs 4.

    python experiments/bench_env_slices.py [--slices 1,2,4] [--repeats 2] [--num_timesteps 102400]
    python experiments/bench_env_slices.py --slices 0,1 --pin_modes pin --name colocate_vs_separate

`--slices 0` is the co-located topology (no generation worker: each rollout worker runs the policy itself), so
`--slices 0,1` measures co-location against a separate generation worker on the same workload.

Each run is `python -m ebrl_jax.main --schedule=async --nocolocate_generation --env_slices=S` on Ant (2 groups of
32 envs, MLP 4x32 / 5x256, PPO with 4 unrolls of 5 steps per env and iteration), in its own process, once with
the default CPU pinning and once with `--nopin_cpus` (`--pin_modes`). A short warm-up run of every setting fills
a compilation cache that the measured runs share (the trainer compiles `train_step` on its first iteration, inside
the timed part), and measured runs are interleaved (every setting once, then again) so drift in the machine's
load hits all settings alike. Per run it keeps:
  * env_steps_per_s: the run's (trainer's) figure, env steps over the wall time of collection + training;
  * rollout_env_steps_per_s: what the rollout workers collect while collecting, num_groups x (env steps of one
    group's segment) / (mean `rollout/collect` span), i.e. without their waits for the staleness bound;
  * the generation worker's histogram of slices per batch, batches per bucket and padding;
  * mean stage times of the timeline (gen/act: a rollout slice's wait for its actions, round trip included;
    gen/act_batch: the generation worker's act on one padded batch).
Writes experiments/results/env_slices_<N>cpu.json (N: CPUs available to this process; `--name` changes the stem).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_GROUPS, SEGMENT_ENV_STEPS = 2, 32 * 4 * 5  # per group and iteration: 32 envs x 4 unrolls x 5 steps
WORKLOAD = [
    '--platform=cpu', '--task=ant', '--backend=mujoco_cpu', '--num_envs=64', '--num_groups=2', '--episode_length=1000',
    '--num_eval_envs=4', '--policy=mlp', '--algo=ppo', '--unroll_length=5', '--batch_size=64', '--num_minibatches=4',
    '--num_updates_per_batch=4', '--schedule=async', '--max_staleness=1', '--nocolocate_generation', '--num_evals=0',
    '--checkpoint_every=0', '--noprogress_bar'
]


def run_one(slices: int, pin: bool, num_timesteps: int, run_dir: str, cache_dir: str, timeout_s: int,
            extra_flags=()) -> dict:
  workload = WORKLOAD if slices else [f for f in WORKLOAD if f != '--nocolocate_generation']
  cmd = [
      sys.executable, '-m', 'ebrl_jax.main', *workload, *extra_flags, f'--env_slices={max(slices, 1)}',
      f'--num_timesteps={num_timesteps}', f'--run_dir={run_dir}', '--pin_cpus' if pin else '--nopin_cpus',
      f'--trace_dir={run_dir}/trace', f'--compilation_cache_dir={cache_dir}'
  ]
  start = time.monotonic()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
  if proc.returncode != 0:
    raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}')
  with open(os.path.join(run_dir, 'summary.json')) as f:
    summary = json.load(f)
  extra = summary['extra']
  stages = {k: {'mean_ms': v['mean_ms'], 'count': v['count']} for k, v in extra['stage_ms'].items()}
  row = {
      'env_slices': slices,
      'pin_cpus': pin,
      'env_steps': summary['env_steps'],
      'env_steps_per_s': summary['env_steps_per_s'],
      'train_wall_s': summary['train_wall_s'],
      'rollout_env_steps_per_s': NUM_GROUPS * SEGMENT_ENV_STEPS / (stages['rollout/collect']['mean_ms'] / 1e3),
      'wall_s': summary['wall_s'],
      'process_s': time.monotonic() - start,
      'max_staleness_seen': extra['max_staleness_seen'],
      'segments_consumed': extra['segments_consumed'],
      'segments_dropped_stale': extra['segments_dropped_stale'],
      'generation': extra.get('generation', {
          'requests_per_batch': {},
          'batches': 0,
          'rows': 0,
          'padded_rows': 0
      }),
      'cpu_pct': {
          k: v for k, v in extra.get('telemetry', {}).items() if k.startswith('cpu_pct/')
      },
      'stage_ms': stages
  }
  gen = row['generation']
  requests = sum(int(k) * v for k, v in gen['requests_per_batch'].items())
  row['mean_slices_per_batch'] = requests / max(1, gen['batches'])
  row['mean_batch_rows'] = gen['rows'] / max(1, gen['batches'])
  row['padding_pct'] = 100.0 * gen['padded_rows'] / max(1, gen['rows'] + gen['padded_rows'])
  return row


def _mean(rows, key):
  return sum(r[key] for r in rows) / len(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--slices', default='1,2,4')
  parser.add_argument('--pin_modes', default='pin,nopin', help="'pin' (the default placement) and/or 'nopin'")
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--num_timesteps', type=int, default=102_400)
  parser.add_argument('--warmup_timesteps', type=int, default=12_800, help='per setting, before measuring; 0: none')
  parser.add_argument('--timeout_s', type=int, default=900)
  parser.add_argument('--extra',
                      action='append',
                      default=[],
                      help='a flag for every run, e.g. '
                      '--extra=--num_updates_per_batch=1 (must keep 2 groups x 4 unrolls x 5 steps of 32 envs)')
  parser.add_argument('--name', default='env_slices', help='the result is <out_dir>/<name>_<N>cpu.json')
  parser.add_argument('--out_dir', default=os.path.join(ROOT, 'experiments', 'results'))
  args = parser.parse_args()
  ncpu = len(os.sched_getaffinity(0))
  settings = [(int(s), mode == 'pin') for mode in args.pin_modes.split(',') for s in args.slices.split(',')]
  result = {
      'command': ' '.join(['python', 'experiments/bench_env_slices.py'] + sys.argv[1:]),
      'workload': WORKLOAD + args.extra + [f'--num_timesteps={args.num_timesteps}'],
      'cpu_count': ncpu,
      'processor': platform.processor() or platform.machine(),
      'python': platform.python_version(),
      'commit': subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
      'loadavg_before': os.getloadavg(),
      'runs': [],
      'summary': {}
  }
  with tempfile.TemporaryDirectory(prefix='env_slices_') as tmp:
    cache_dir = os.path.join(tmp, 'xla')
    if args.warmup_timesteps:
      for slices, pin in settings:
        run_one(slices, pin, args.warmup_timesteps, os.path.join(tmp, f'warmup_s{slices}_{pin}'), cache_dir,
                args.timeout_s, args.extra)
    for repeat in range(args.repeats):
      for slices, pin in settings:
        run_dir = os.path.join(tmp, f'r{repeat}_s{slices}_{"pin" if pin else "nopin"}')
        row = run_one(slices, pin, args.num_timesteps, run_dir, cache_dir, args.timeout_s, args.extra)
        row['repeat'] = repeat
        result['runs'].append(row)
        print(
            f'slices={slices} pin={pin!s:5} repeat={repeat}: {row["env_steps_per_s"]:7.0f} env steps/s '
            f'(rollout {row["rollout_env_steps_per_s"]:7.0f}), {row["mean_slices_per_batch"]:.2f} slices/batch, '
            f'padding {row["padding_pct"]:.1f}%, slices per batch {row["generation"]["requests_per_batch"]}',
            flush=True)
  for slices, pin in settings:
    rows = [r for r in result['runs'] if (r['env_slices'], r['pin_cpus']) == (slices, pin)]
    name = f'{"colocated" if slices == 0 else f"slices={slices}"},{"pin" if pin else "nopin"}'
    hist = {}
    for r in rows:
      for k, v in r['generation']['requests_per_batch'].items():
        hist[k] = hist.get(k, 0) + v
    stage_means = {
        k: sum(r['stage_ms'][k]['mean_ms'] for r in rows if k in r['stage_ms']) / len(rows)
        for k in ('rollout/collect', 'rollout/wait_params', 'sim/step', 'gen/act', 'gen/act_batch', 'train/train_step',
                  'train/wait_segments')
    }
    result['summary'][name] = {
        'env_steps_per_s_mean': _mean(rows, 'env_steps_per_s'),
        'env_steps_per_s_runs': [r['env_steps_per_s'] for r in rows],
        'rollout_env_steps_per_s_mean': _mean(rows, 'rollout_env_steps_per_s'),
        'stage_mean_ms': stage_means,
        'mean_slices_per_batch': _mean(rows, 'mean_slices_per_batch'),
        'mean_batch_rows': _mean(rows, 'mean_batch_rows'),
        'padding_pct': _mean(rows, 'padding_pct'),
        'slices_per_batch_histogram': hist,
        'buckets': rows[0]['generation'].get('buckets')
    }
    row = result['summary'][name]
    print(f'{name:18s} {row["env_steps_per_s_mean"]:7.0f} env steps/s (runs: '
          f'{", ".join(f"{v:.0f}" for v in row["env_steps_per_s_runs"])}), rollout '
          f'{row["rollout_env_steps_per_s_mean"]:7.0f}; slices per batch {hist}; stage ms '
          f'{ {k: round(v, 2) for k, v in stage_means.items()} }')
  result['loadavg_after'] = os.getloadavg()
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f'{args.name}_{ncpu}cpu.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2)
  print('wrote', path)


if __name__ == '__main__':
  main()
