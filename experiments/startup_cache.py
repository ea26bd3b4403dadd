"""Start-up (process start -> first counted training, the runs' `compile_s`) on a cold and then a warm cache, with
the trace cache (ebrl_jax/runtime/trace_cache.py) and without it (--notrace_cache), side by side in one invocation.

  python -m experiments.startup_cache --flagfile_run=experiments/w1_ant.flags --repeats=3 \
      --out=experiments/results/startup_cache_cpu.json -- --platform=cpu --num_envs=64 --batch_size=64 ...

Each mode starts from an empty compilation cache of its own (run 1: cold), then runs the same command
`--repeats - 1` more times (warm). Arguments after `--` go to every run. Each run is its own
`python -m ebrl_jax.main` process, so every figure includes imports and process start as a user's run does.
With --profile, the first mode then runs once more, warm, under cProfile (not counted in its median: the profiler
slows Python-heavy code), and the JSON keeps the functions with the most cumulative and own time: where a warm
start-up still goes.
"""
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

_FLAGFILE = flags.DEFINE_string('flagfile_run', None, 'The workload (a flagfile of ebrl_jax.main).', required=True)
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs per mode: the first on a cold cache, the rest warm.')
_MODES = flags.DEFINE_list('modes', ['trace_cache', 'notrace_cache'], 'trace_cache and/or notrace_cache.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the JSON.', required=True)
_PROFILE = flags.DEFINE_boolean('profile', False, 'One more warm run of the first mode under cProfile.')
_TOP = flags.DEFINE_integer('profile_top', 40, 'How many functions the profile keeps per ordering.')
_TIMESTEPS = flags.DEFINE_integer('run_timesteps', 3000, 'Each run\'s --num_timesteps (start-up is the point).')


def _run(flagfile, mode, cache, run_dir, extra, profile_out=None):
  prefix = ['-m', 'cProfile', '-o', profile_out] if profile_out else []
  cmd = [
      sys.executable, *prefix, '-m', 'ebrl_jax.main', f'--flagfile={flagfile}', f'--num_timesteps={_TIMESTEPS.value}',
      '--num_evals=2', f'--run_dir={run_dir}', f'--compilation_cache_dir={cache}', f'--{mode}', '--noprogress_bar',
      *extra
  ]
  t0 = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wall = time.time() - t0
  if proc.returncode != 0:
    raise RuntimeError(f'{" ".join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}')
  summary = json.load(open(os.path.join(run_dir, 'summary.json')))
  return {
      'compile_s': summary['compile_s'],
      'breakdown': summary.get('compile_breakdown'),
      'process_wall_s': wall,
      'final_eval_return': summary.get('final_eval_return'),
      'loadavg_1m': os.getloadavg()[0],
  }


def _top(profile_out, key):
  """The `_TOP` functions by `key` ('cumulative' or 'tottime'): [file:line(function), calls, own s, cumulative s]."""
  stats = pstats.Stats(profile_out, stream=io.StringIO()).sort_stats(key)
  rows = []
  for func in stats.fcn_list[:_TOP.value]:
    _, calls, own, cumulative, _ = stats.stats[func]
    rows.append([pstats.func_std_string(func), calls, round(own, 3), round(cumulative, 3)])
  return rows


def _profile(result, mode, cache, tmp, extra):
  """One more warm run of `mode` under cProfile; its breakdown and top functions go into `result['profile']`."""
  out = os.path.join(tmp, 'startup.prof')
  run = _run(_FLAGFILE.value, mode, cache, os.path.join(tmp, mode, 'profiled'), extra, profile_out=out)
  result['profile'] = {'mode': mode, 'run': run, 'cumulative': _top(out, 'cumulative'), 'own': _top(out, 'tottime')}
  _write(result)


def _write(result):
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=1)


def main(argv):
  extra = argv[1:]
  result = {'command': ' '.join(sys.argv), 'flagfile': _FLAGFILE.value, 'extra': extra, 'modes': {}}
  with tempfile.TemporaryDirectory() as tmp:
    for mode in _MODES.value:
      cache = os.path.join(tmp, mode, 'xla')
      runs = []
      for i in range(_REPEATS.value):
        runs.append(_run(_FLAGFILE.value, mode, cache, os.path.join(tmp, mode, f'run{i}'), extra))
        warm = [r['compile_s'] for r in runs[1:]]
        result['modes'][mode] = {
            'runs': runs,
            'cold_s': runs[0]['compile_s'],
            'warm_median_s': statistics.median(warm) if warm else None,
        }
        _write(result)  # after every run: a call cut by its time limit keeps what it measured
      print(mode, [round(r['compile_s'], 2) for r in runs], flush=True)
      if _PROFILE.value and mode == _MODES.value[0]:
        _profile(result, mode, cache, tmp, extra)
  on, off = (result['modes'].get(m, {}).get('warm_median_s') for m in ('trace_cache', 'notrace_cache'))
  if on and off:
    result['warm_speedup'] = off / on
  returns = {m: [r['final_eval_return'] for r in v['runs']] for m, v in result['modes'].items()}
  result['same_final_returns'] = len({x for rs in returns.values() for x in rs}) == 1
  _write(result)
  print(json.dumps({k: v for k, v in result.items() if k != 'modes'}, indent=1))


if __name__ == '__main__':
  app.run(main)
