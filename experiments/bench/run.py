r"""Runs one workload under several schedules and seeds on one machine, into one JSON.

  python -m experiments.bench.run --bench_flagfile=experiments/w1_ant.flags --schedules=fused,sync,async,brax \
      --seeds=0,1,2 --extra=--num_groups=2 --only=sync:--use_mps --only=async:--use_mps \
      --out=experiments/results/w1_bench.json [--gpus=0,1]
  python -m experiments.bench.run --quick --out=/tmp/quick.json      # 2-core CPU, a few minutes (CI runs it)

Each (schedule, seed) runs as `python -m ebrl_jax.main` in its own process with `--run_dir=<out>_runs/<label>
/seed<k>`; its summary.json is collected. `brax` is Brax's own PPO trainer on the same flagfile
(`experiments/bench/brax_ppo.py`). A schedule entry `label=schedule` runs a schedule under another name, so one
invocation can compare variants of one schedule (`--schedules=async,async_q=async --only=async_q:--sm_quotas=...`);
`--only=label:--flag` passes a flag to that label's runs alone.

Runs go one after another. With `--gpus=0,1,...` they run concurrently, one per GPU (each run sees only its GPU,
named by UUID so an MPS daemon a run starts serves that GPU alone); on identical GPUs this only shortens the
benchmark, and the JSON records which GPU each run had. A GPU named several times (`--gpus=0,0,0`) runs that
many at once on it: a learning screen whose runs share the GPU (set XLA_PYTHON_CLIENT_MEM_FRACTION so they fit;
their throughputs are not each schedule's own). Where NVML sees a GPU, device-wide SM activity and
occupancy (GPM) of each run's GPU are sampled every 100 ms during the run (`ebrl_jax.resources.telemetry`).
Per label the JSON holds every seed's figures and their mean; ratios are against the first label.
`python -m experiments.bench.report <json> ...` turns results into a table and plots.
"""
from __future__ import annotations

import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

from absl import app
from absl import flags

from ebrl_jax.resources import telemetry
from experiments.bench import figures as run_figures

_FLAGFILE = flags.DEFINE_string('bench_flagfile', None, 'The workload flagfile (passed on as --flagfile).')
_SCHEDULES = flags.DEFINE_list(
    'schedules', ['fused', 'sync', 'async'], 'Schedules to run, in order: fused, sync, async, overlap, auto, brax, or '
    'label=schedule.')
_ONLY = flags.DEFINE_multi_string('only', [], 'label:--flag, a flag for one label\'s runs, e.g. async:--use_mps.')
_GPUS = flags.DEFINE_list('gpus', [], 'GPU indices to run on concurrently, one run per GPU (default: in sequence).')
_SEEDS = flags.DEFINE_list('seeds', ['0'], 'Seeds, run in sequence for every schedule.')
_EXTRA = flags.DEFINE_multi_string('extra', [], 'Extra flags for every run, e.g. --extra=--num_groups=2.')
_OUT = flags.DEFINE_string('out', 'experiments/results/bench.json', 'Where to write the JSON result.')
_TIMEOUT = flags.DEFINE_integer('timeout_s', 3600, 'Per-run time limit (the run is stopped with SIGTERM).')
_LABEL_TIMEOUT = flags.DEFINE_multi_string(
    'label_timeout_s', [], 'label:seconds, a time limit for one label\'s runs instead of --timeout_s '
    '(e.g. auto:400: its calibration comes first).')
_LABEL_ENV = flags.DEFINE_multi_string(
    'label_env', [], 'label:NAME=VALUE, an environment variable for one label\'s runs (every process of the run '
    'inherits it), e.g. det:XLA_FLAGS=--xla_gpu_deterministic_ops=true: a cost measured side by side in one '
    'invocation.')
_STAGE_PROFILE = flags.DEFINE_bool(
    'stage_profile', False, 'Before the runs, time each stage alone (experiments/bench/stage_profile.py) and report '
    'every label\'s overlap efficiency: env steps/s over the perfect-overlap ceiling.')
_PROFILE_FROM = flags.DEFINE_string(
    'stage_profile_from', None, 'Instead of --stage_profile: take the stage profile of this earlier result of the same '
    'flagfile (its stage sizes follow --num_envs and --num_groups, which must match; run length need not). With '
    '--merge: give the merged result this profile (a result, or a bare stage_profile.py --profile_out file).')
_MERGE = flags.DEFINE_list(
    'merge', [], 'Instead of running: merge these result files of one workload (same '
    'flagfile and flags; seeds or labels run in separate invocations) into --out.')
_TELEMETRY = flags.DEFINE_list(
    'telemetry', [], 'With --merge: telemetry logs (telemetry_gpu<N>.jsonl[.gz]) of the '
    'merged runs, for the SM activity over each run\'s steady window where a kept run '
    'lacks it.')
_CACHE = flags.DEFINE_enum(
    'compile_cache', 'per_label', ['per_label', 'shared', 'off'],
    'Compilation caches (XLA, traces, Warp kernels) of the runs: per_label, a fresh one per label under the run '
    'folder, so every label\'s first seed starts cold and no label warms another\'s (the order of labels does not '
    'decide start-up); shared, the runs\' own --compilation_cache_dir (warm from earlier runs on the machine); off, '
    'none. A --compilation_cache_dir in --extra or --only wins.')
_ORDER = flags.DEFINE_enum(
    'order', 'labels', ['labels', 'rounds'],
    'The order of the runs: labels, every seed of a label before the next label; rounds, every label once per seed '
    '(seed 0 of each label, then seed 1 of each...), so a machine whose speed drifts over the invocation (a shared '
    'CPU host) slows every label alike within a round instead of the labels run last.')
_QUICK = flags.DEFINE_bool('quick', False, 'Tiny CPU workload (native MuJoCo pendulum) that exercises the harness.')

SCHEDULES = ('fused', 'sync', 'async', 'overlap', 'auto', 'brax')
QUICK_FLAGFILE = 'experiments/quickstart.flags'
QUICK_EXTRA = [
    '--num_envs=16', '--batch_size=16', '--num_minibatches=4', '--num_timesteps=6400', '--num_evals=2',
    '--num_eval_envs=4', '--episode_length=200', '--num_groups=2', '--compilation_cache_dir='
]
# Figures every run reports (BENCHMARKS.md): end-to-end throughput, compile time, time to target, returns.
FIGURES = ('env_steps', 'env_steps_per_s', 'compile_s', 'wall_s', 'train_wall_s', 'final_eval_return',
           'best_eval_return', 'env_steps_to_target', 'wall_s_to_target', 'train_s_to_target')


class Job(NamedTuple):
  label: str
  schedule: str
  seed: str
  flags: Tuple[str, ...]  # the label's own flags (--only), after the shared --extra ones


def job_order(labels, seeds: List[str], order: str) -> List[Job]:
  """The runs of `labels` ([(label, schedule, flags)]) x `seeds`, in the order `--order` names."""
  if order == 'labels':
    return [Job(label, sched, seed, f) for label, sched, f in labels for seed in seeds]
  if order == 'rounds':
    return [Job(label, sched, seed, f) for seed in seeds for label, sched, f in labels]
  raise ValueError(f'--order={order!r} must be labels or rounds.')


def parse_schedules(entries: List[str], only: List[str]) -> List[Tuple[str, str, Tuple[str, ...]]]:
  """[(label, schedule, flags)] from `--schedules` and `--only`; errors name the bad entry."""
  out, labels = [], set()
  for entry in entries:
    label, _, schedule = entry.partition('=')
    schedule = schedule or label
    if schedule not in SCHEDULES:
      raise ValueError(f'--schedules entry {entry!r}: schedule {schedule!r} is not one of {", ".join(SCHEDULES)}.')
    if not label or label in labels:
      raise ValueError(f'--schedules entry {entry!r}: label {label!r} is empty or used twice.')
    labels.add(label)
    out.append((label, schedule, []))
  for item in only:
    label, sep, flag = item.partition(':')
    if not sep or not flag.startswith('--'):
      raise ValueError(f'--only={item!r} must be label:--flag.')
    if label not in labels:
      raise ValueError(f'--only={item!r}: no schedule labelled {label!r} in --schedules.')
    next(e for e in out if e[0] == label)[2].append(flag)
  return [(label, schedule, tuple(f)) for label, schedule, f in out]


def parse_label_timeouts(entries: List[str], labels, default: int) -> Dict[str, int]:
  """{label: seconds} from `--label_timeout_s` entries (label:seconds), every label given one (`default` where
  none is named); errors name the bad entry."""
  known = [label for label, _, _ in labels]
  out = {label: default for label in known}
  for entry in entries:
    label, sep, value = entry.partition(':')
    if not sep or label not in known:
      raise ValueError(f'--label_timeout_s={entry!r} must be label:seconds with a label of --schedules '
                       f'({", ".join(known)}).')
    try:
      seconds = int(value)
    except ValueError:
      seconds = 0
    if seconds <= 0:
      raise ValueError(f'--label_timeout_s={entry!r}: seconds must be a positive integer.')
    out[label] = seconds
  return out


def parse_label_env(entries: List[str], labels) -> Dict[str, Dict[str, str]]:
  """{label: {NAME: VALUE}} from `--label_env` entries (label:NAME=VALUE); errors name the bad entry."""
  known = [label for label, _, _ in labels]
  out: Dict[str, Dict[str, str]] = {label: {} for label in known}
  for entry in entries:
    label, sep, assignment = entry.partition(':')
    name, eq, value = assignment.partition('=')
    if not sep or label not in known or not eq or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', name):
      raise ValueError(f'--label_env={entry!r} must be label:NAME=VALUE with a label of --schedules '
                       f'({", ".join(known)}) and a variable name.')
    out[label][name] = value
  return out


def take_summary(summary_path: str, returncode: int, start_unix: float) -> Optional[dict]:
  """The run's summary.json when it counts: a finished run's (exit code 0), or a stopped run's (SIGTERM at the
  harness's time limit, Ctrl-C: exit codes 143 / 130, `stopped` names why) that this process wrote, not one left
  in the run directory by an earlier attempt. None otherwise."""
  if not os.path.exists(summary_path):
    return None
  try:
    with open(summary_path) as f:
      summary = json.load(f)
  except (OSError, json.JSONDecodeError):
    return None
  if returncode == 0:
    return summary
  fresh = summary.get('start_unix') is not None and summary['start_unix'] >= start_unix - 5.0
  if returncode in (130, 143, -signal.SIGTERM, -signal.SIGINT) and fresh and summary.get('stopped') in ('SIGTERM',
                                                                                                        'SIGINT'):
    return summary
  return None


def _gpm_window(tel: Optional[telemetry.Telemetry], start: float, end: float) -> dict:
  """Mean device-wide SM activity and occupancy between two Unix times (None, with the reason, without a GPU)."""
  if tel is None:
    return {'sm_activity_pct': None, 'sm_occupancy_pct': None, 'reason': 'no telemetry for this GPU'}
  sm, samples = run_figures.window_mean(tel.records, start, end)
  if not samples:
    return {'sm_activity_pct': None, 'sm_occupancy_pct': None, 'reason': tel.gpu_reason or 'no samples'}
  occupancy, _ = run_figures.window_mean(tel.records, start, end, 'sm_occupancy_pct')
  return {'sm_activity_pct': sm, 'sm_occupancy_pct': occupancy, 'samples': samples}


def _nvidia_smi(query: str) -> List[str]:
  try:
    out = subprocess.run(['nvidia-smi', f'--query-gpu={query}', '--format=csv,noheader'],
                         capture_output=True,
                         text=True,
                         timeout=20)
  except (OSError, subprocess.SubprocessError):
    return []
  return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine() -> dict:
  """Where the results come from: platform, Python, CPU count, each GPU's name and driver."""
  return {
      'platform': platform.platform(),
      'python': platform.python_version(),
      'cpu_count': os.cpu_count(),
      'gpu': '; '.join(_nvidia_smi('name,driver_version')) or None
  }


def commit() -> str:
  """$EBRL_COMMIT when set (a copied tree on another host may carry a stale .git), else the checkout's commit."""
  if os.environ.get('EBRL_COMMIT'):
    return os.environ['EBRL_COMMIT']
  try:
    out = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    out = None
  return out.stdout.strip() if out is not None and out.returncode == 0 else os.environ.get('EBRL_COMMIT', 'unknown')


def source_tree() -> str:
  """Git's tree hash of the files the run used: the checkout as it is (tracked and untracked, .gitignore applied),
  hashed through a throw-away index. A tree copied to another host without its latest commits keeps a stale
  HEAD (`commit`), but this hash equals `git rev-parse <commit>^{tree}` of the commit it was copied from
  (`git log --format='%h %T' | grep <tree>` finds it). 'unknown' outside a git checkout. The run folders
  (`<out>_runs/`, checkpoints and caches) are git-ignored, so they are not hashed."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, 'index'))
    try:
      add = subprocess.run(['git', 'add', '-A'], capture_output=True, env=env, timeout=60)
      out = subprocess.run(['git', 'write-tree'], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
      return 'unknown'
  return out.stdout.strip() if add.returncode == 0 and out.returncode == 0 else 'unknown'


def cache_flags(mode: str, run_root: str, label: str) -> List[str]:
  """The --compilation_cache_dir a label's runs get under `--compile_cache=mode` (placed before --extra and
  --only, so that theirs wins)."""
  if mode == 'per_label':
    return [f'--compilation_cache_dir={os.path.join(os.path.abspath(run_root), "cache", label)}']
  return ['--compilation_cache_dir='] if mode == 'off' else []


def _command(flagfile: str, job: Job, extra: List[str], run_dir: str, cache: List[str] = ()) -> List[str]:
  if job.schedule == 'brax':
    head = [sys.executable, '-m', 'experiments.bench.brax_ppo', f'--flagfile={flagfile}', '--schedule=fused']
  else:
    head = [sys.executable, '-m', 'ebrl_jax.main', f'--flagfile={flagfile}', f'--schedule={job.schedule}']
  return head + [f'--seed={job.seed}', f'--run_dir={run_dir}', '--noprogress_bar', *cache, *extra, *job.flags]


_LIVE: set = set()  # the runs in flight, stopped with SIGTERM when the harness itself is told to stop
_STOPPING = threading.Event()


def _stop_runs(signum, frame) -> None:
  del frame
  print(f'[bench] signal {signum}: stopping the runs in flight; the JSON keeps the finished ones', flush=True)
  _STOPPING.set()
  for popen in list(_LIVE):
    try:
      popen.send_signal(signal.SIGTERM)  # each controller stops its workers and its MPS daemon
    except OSError:
      pass


def _run_one(cmd: List[str], run_dir: str, env: dict, tel: Optional[telemetry.Telemetry], timeout_s: int) -> dict:
  start = time.time()
  popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  _LIVE.add(popen)
  timed_out = False
  try:
    stdout, stderr = popen.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    timed_out = True
    popen.send_signal(signal.SIGTERM)  # the controller stops its workers and unlinks shared memory
    try:
      stdout, stderr = popen.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      popen.kill()
      stdout, stderr = popen.communicate()
    stderr += f'\n[bench] stopped after its time limit of {timeout_s} s'
  finally:
    _LIVE.discard(popen)
  end = time.time()
  result = {
      'command': ' '.join(cmd[1:]),
      'returncode': popen.returncode,
      'start_unix': start,
      'end_unix': end,
      'process_wall_s': end - start,
      'gpm': _gpm_window(tel, start, end)
  }
  # The whole output (the controller's and every worker's, which inherit its streams) beside the run: the JSON
  # keeps a failed run's tail only, and where a stalled run waited is usually further up.
  try:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, 'output.log'), 'w') as f:
      f.write(stdout + stderr)
    result['log'] = os.path.join(run_dir, 'output.log')
  except OSError as e:
    print(f'[bench] could not keep the output of {run_dir}: {e}', file=sys.stderr, flush=True)
  summary = take_summary(os.path.join(run_dir, 'summary.json'), popen.returncode, start)
  if summary is None:
    result['error_tail'] = (stdout + stderr)[-4000:]
    return result
  result['summary'] = summary
  if popen.returncode:  # stopped by its time limit (or a signal) with its summary and partial curve written
    result['stopped'] = {'reason': summary.get('stopped'), 'time_limit_s': timeout_s if timed_out else None}
  window = run_figures.steady_window(result)
  if window is not None and tel is not None:
    result['gpm_steady'] = steady_gpm(tel.records, window)
  return result


def steady_gpm(records: List[dict], window) -> dict:
  """The device's mean SM activity over a run's steady window (`figures.steady_window`)."""
  start, end, how = window
  sm, n = run_figures.window_mean(records, start, end)
  return {'sm_activity_pct': sm, 'samples': n, 'window_s': round(end - start, 1), 'window': how}


def backfill_steady_gpm(runs: Dict[str, List[dict]], telemetry_paths: List[str]) -> int:
  """Gives finished runs kept without `gpm_steady` theirs from telemetry logs (the bench's telemetry_gpu<N>
  JSONL, gzipped or not): the log of the run's GPU with the most samples in its steady window. Returns how many
  runs got one; a log that cannot be read is an error naming it."""
  logs = []
  for path in telemetry_paths:
    try:
      records = run_figures.read_jsonl(path)
    except (OSError, ValueError) as e:
      raise ValueError(f'--telemetry: cannot read {path} as JSON lines: {e}') from None
    gpu = re.search(r'gpu(\d+)', os.path.basename(path))
    logs.append((gpu.group(1) if gpu else None, records))
  filled = 0
  for run in (r for seeds in runs.values() for r in seeds):
    window = run_figures.steady_window(run)
    if 'gpm_steady' in run or window is None:
      continue
    best = max((steady_gpm(records, window) for gpu, records in logs if gpu in (None, str(run.get('gpu')))),
               key=lambda g: g['samples'],
               default=None)
    if best is not None and best['samples']:
      run['gpm_steady'] = best
      filled += 1
  return filled


def _mean(values):
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def aggregate(runs: Dict[str, List[dict]]) -> Dict[str, dict]:
  """Per schedule: each figure's mean over the seeds that finished (None where no seed has it); the end-to-end
  and steady rates also with their sample standard deviation over seeds."""
  out = {}
  for schedule, seeds in runs.items():
    # A run stopped before its first counted iteration has a summary but no rate (figures.has_rate): it is kept
    # out of every mean (seeds_finished counts the others).
    counted = [r for r in seeds if 'summary' in r and run_figures.has_rate(r['summary'])]
    done = [r['summary'] for r in counted]
    figures = {k: _mean([s.get(k) for s in done]) for k in FIGURES}
    # End to end over the seeds of one definition (runs kept from before start-up was excluded are not averaged
    # with later ones, see figures.end_to_end), with its spread; the steady pace the same way over every seed.
    e2e = run_figures.end_to_end(done)
    figures['env_steps_per_s'] = e2e['mean']
    figures['env_steps_per_s_sd'] = e2e['sd']
    figures['env_steps_per_s_seeds'] = e2e['seeds']
    figures['env_steps_per_s_counts_first_iteration'] = e2e['counts_first_iteration']
    figures['sm_activity_pct'] = _mean([r['gpm'].get('sm_activity_pct') for r in counted])
    # The same over the steady window (second to last evaluation), where start-up does not dilute it.
    figures['steady_sm_activity_pct'] = _mean([(r.get('gpm_steady') or {}).get('sm_activity_pct') for r in counted])
    pace = run_figures.steady(done)
    figures['steady_env_steps_per_s'] = pace['mean']
    figures['steady_env_steps_per_s_sd'] = pace['sd']
    # Rollout throughput (env steps/s while collecting; the process schedules report it) and the cost of an SM
    # quota change (the swaps of --quota_schedule / --replan), where the runs have them.
    figures['rollout_env_steps_per_s'] = _mean([run_figures.rollout_env_steps_per_s(s) for s in done])
    swaps = [w for s in done for w in run_figures.quota_swaps(s)]
    figures['quota_changes'] = len(swaps)
    figures['quota_change_gap_s'] = _mean([w.get('gap_s') for w in swaps])
    figures['quota_change_env_steps_lost'] = _mean([w.get('env_steps_lost') for w in swaps])
    figures['seeds_finished'] = len(done)
    figures['seeds_stopped'] = sum('stopped' in r for r in seeds if 'summary' in r)  # with a rate: in seeds_finished
    figures['seeds_reaching_target'] = sum(s.get('env_steps_to_target') is not None for s in done)
    out[schedule] = figures
  return out


def _times_to_target(seeds: List[dict]) -> Dict[Optional[str], float]:
  """{seed: wall_s_to_target} of a label's runs with a rate that reached the target."""
  return {
      run_seed(r): r['summary']['wall_s_to_target']
      for r in seeds
      if 'summary' in r and run_figures.has_rate(r['summary']) and r['summary'].get('wall_s_to_target') is not None
  }


def ratios(figures: Dict[str, dict], base: str, runs: Dict[str, List[dict]]) -> Dict[str, dict]:
  """Throughput ratio (higher is better) and time-to-target ratio (base / schedule: higher is faster). The latter
  pairs seeds: the mean over the seeds both labels reached the target with (`wall_s_to_target_seeds`), not two
  means over different seeds; absent where they reached it with no seed in common."""
  b = figures[base]
  base_times = _times_to_target(runs.get(base, []))
  out = {}
  for schedule, f in figures.items():
    entry = {}
    if f['env_steps_per_s'] and b['env_steps_per_s']:
      entry['env_steps_per_s'] = f['env_steps_per_s'] / b['env_steps_per_s']
    times = _times_to_target(runs.get(schedule, []))
    both = sorted(set(times) & set(base_times), key=str)
    if both:
      entry['wall_s_to_target_speedup'] = _mean([base_times[s] for s in both]) / _mean([times[s] for s in both])
      entry['wall_s_to_target_seeds'] = both
    out[schedule] = entry
  return out


def stage_bounds(profile: dict) -> dict:
  """The workload's perfect-overlap ceiling 1 / max(t_sim, t_gen, t_train) and sequential floor
  1 / (t_sim + t_gen + t_train), per env step, from its stages timed alone at full GPU.

  Generation and training come from the whole env batch (all envs in one call; the largest size profiled). So
  does simulation on the GPU (MJX): G groups of num_envs / G envs stepping at once share one device and do the
  work of one call on all envs. Native MuJoCo is different: its groups step at once on disjoint cores, so where
  the profile timed one group alone with its own threads and G such groups fit in the whole batch's threads,
  the sim term is that group's time per env step over G, when that is faster than one call on all envs with
  every thread (W3: 4 groups x 128 envs on 3 threads each against 512 envs on 12 threads).
  """
  size = max(int(e) for e in profile['groups'])
  whole = profile['groups'][str(size)]
  t_sim, sim_groups = whole['sim']['per_env_step_s'], 1
  if profile.get('backend') == 'mujoco_cpu':
    for e, entry in profile['groups'].items():
      groups, threads = size // int(e), entry.get('sim_threads')
      fits = threads and whole.get('sim_threads') and groups * threads <= whole['sim_threads']
      if groups > 1 and fits and entry['sim']['per_env_step_s'] / groups < t_sim:
        t_sim, sim_groups = entry['sim']['per_env_step_s'] / groups, groups
  per_step = [t_sim, whole['generation']['per_env_step_s'], profile['train']['per_env_step_s']]
  return {
      'envs_per_call': size,
      'sim_groups': sim_groups,
      'sim_per_env_step_s': t_sim,
      'ceiling_steps_per_s': 1.0 / max(per_step),
      'sequential_floor_steps_per_s': 1.0 / sum(per_step)
  }


def overlap_efficiency(figures: Dict[str, dict], labels, profile: dict) -> Dict[str, dict]:
  """Per label: achieved env steps/s over the workload's perfect-overlap ceiling and over its sequential floor
  (`stage_bounds`; the same bounds serve every schedule, and the profile's per-group entries show what a group
  costs when it runs alone)."""
  bounds = stage_bounds(profile)
  out = {}
  for label, _, _ in labels:
    achieved = figures[label]['env_steps_per_s']
    out[label] = dict(bounds,
                      overlap_efficiency=achieved / bounds['ceiling_steps_per_s'] if achieved else None,
                      vs_sequential_floor=achieved / bounds['sequential_floor_steps_per_s'] if achieved else None)
  return out


def _stage_profile(flagfile: str, extra: List[str], path: str, env: dict) -> dict:
  cmd = [
      sys.executable, '-m', 'experiments.bench.stage_profile', f'--flagfile={flagfile}', f'--profile_out={path}', *extra
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_TIMEOUT.value)
  if proc.returncode or not os.path.exists(path):
    raise RuntimeError(f'stage profile failed ({" ".join(cmd[1:])}):\n{(proc.stdout + proc.stderr)[-3000:]}')
  print(proc.stdout.strip(), flush=True)
  with open(path) as f:
    return json.load(f)


def _gpu_slots(indices: List[str]) -> List[Optional[Tuple[str, str]]]:
  """[(index, uuid)] of the GPUs to run on, or [None] (one slot, the inherited environment)."""
  if not indices:
    return [None]
  uuids = _nvidia_smi('index,uuid')
  table = dict(line.split(', ', 1) for line in uuids if ', ' in line)
  missing = [i for i in indices if i not in table]
  if missing:
    raise ValueError(f'--gpus={",".join(indices)}: nvidia-smi lists no GPU {", ".join(missing)} '
                     f'(it lists {", ".join(sorted(table)) or "none"}).')
  return [(i, table[i]) for i in indices]


def _flag_value(flag_list: List[str], name: str) -> Optional[str]:
  values = [f.split('=', 1)[1] for f in flag_list if f.startswith(f'--{name}=')]
  return values[-1] if values else None


def profile_from(path: str, flagfile: str, extra: List[str]) -> dict:
  """The stage profile kept in an earlier result of the same workload; errors name the file and the field."""
  try:
    with open(path) as f:
      earlier = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f'--stage_profile_from: cannot read {path}: {e}') from None
  if 'stage_profile' not in earlier:
    raise ValueError(f'--stage_profile_from: {path} has no field "stage_profile".')
  if earlier.get('flagfile') != flagfile:
    raise ValueError(f'--stage_profile_from: {path} has flagfile={earlier.get("flagfile")!r}, this run {flagfile!r}.')
  for name in ('num_envs', 'num_groups', 'batch_size', 'num_minibatches', 'unroll_length'):
    if _flag_value(earlier.get('extra_flags', []), name) != _flag_value(extra, name):
      raise ValueError(f'--stage_profile_from: {path} was run with --{name}='
                       f'{_flag_value(earlier.get("extra_flags", []), name)}, this run with --{name}='
                       f'{_flag_value(extra, name)}: its stage sizes differ.')
  return dict(earlier['stage_profile'], taken_from=os.path.basename(path))


def with_profile(result: dict, path: str) -> dict:
  """`result` with the stage profile of `path` (an earlier result of the same workload, or a bare profile written
  by experiments.bench.stage_profile --profile_out, whose env batch sizes must be the ones the result's runs
  use) and its overlap figures recomputed from it."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f'--stage_profile_from: cannot read {path}: {e}') from None
  if 'stage_profile' in data:
    profile = profile_from(path, result['flagfile'], result.get('extra_flags', []))
  elif 'groups' in data and 'train' in data:
    sizes, old = sorted(data['groups'], key=int), result.get('stage_profile')
    if old is not None and sorted(old['groups'], key=int) != sizes:
      raise ValueError(f'--stage_profile_from: {path} profiles env batches of {", ".join(sizes)}, the result\'s '
                       f'runs use {", ".join(sorted(old["groups"], key=int))}.')
    profile = dict(data, taken_from=os.path.basename(path))
  else:
    raise ValueError(f'--stage_profile_from: {path} is neither a result (no field "stage_profile") nor a stage '
                     'profile (no fields "groups" and "train").')
  labels = [(label, v['schedule'], tuple(v['flags'])) for label, v in result['labels'].items()]
  return dict(result, stage_profile=profile, overlap=overlap_efficiency(result['figures'], labels, profile))


def _why_failed(run: dict) -> str:
  """The telling line of a failed run's output tail: the harness's own note or an error, else the last line."""
  lines = [line.strip() for line in (run.get('error_tail') or '').splitlines() if line.strip()]
  telling = [line for line in lines if line.startswith(('[bench]', 'FATAL')) or 'Error' in line]
  return (telling or lines or [''])[-1]


run_seed = run_figures.run_seed  # (the merge and the tests read it from here)


def merge(paths: List[str], telemetry: List[str] = ()) -> dict:
  """One result from several of the same workload and flags: seeds, or labels, run in separate invocations.
  A label in several files must have the same schedule and flags in each; figures are recomputed over all their
  seeds, and the first file's stage profile (or the first file that has one) serves every label. A finished run
  of a label and seed that an earlier file holds as failed (a rerun) replaces it, listed under `replaced`; the
  same seed finished twice is refused."""
  results = []
  for path in paths:
    try:
      with open(path) as f:
        results.append(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f'--merge: cannot read {path}: {e}') from None
  first = results[0]
  labels_seen = dict(first.get('labels', {}))
  for path, r in zip(paths[1:], results[1:]):
    for field in ('flagfile', 'extra_flags'):
      if r.get(field) != first.get(field):
        raise ValueError(f'--merge: {path} has {field}={r.get(field)!r}, {paths[0]} has {first.get(field)!r}.')
    for label, value in r.get('labels', {}).items():
      if label in labels_seen and labels_seen[label] != value:
        raise ValueError(f'--merge: {path} has labels.{label}={value!r}, an earlier file has '
                         f'{labels_seen[label]!r}.')
      labels_seen.setdefault(label, value)
  out = dict(
      first,
      runs={},
      seeds=[],
      labels=labels_seen,
      # a file that is itself a merge lists its own parts, so the record goes back to the invocations
      merged_from=[
          part for p, r in zip(paths, results) for part in r.get('merged_from') or [{
              'file': os.path.basename(p),
              'commit': r.get('commit'),
              'seeds': r.get('seeds'),
              'labels': list(r.get('labels', {}))
          }]
      ])
  out['replaced'] = [gone for r in results for gone in r.get('replaced', [])]
  for path, r in zip(paths, results):
    out['seeds'] += [s for s in r.get('seeds', []) if s not in out['seeds']]
    for label, runs in r['runs'].items():
      kept = out['runs'].setdefault(label, [])
      for run in runs:
        seed = run_seed(run)
        earlier = [i for i, k in enumerate(kept) if seed is not None and run_seed(k) == seed]
        if any('summary' in kept[i] for i in earlier):
          if 'summary' in run:
            raise ValueError(f'--merge: {path} has {label} seed {seed} finished, and so does a run merged before it; '
                             'leave one of the two out.')
          continue  # a failed attempt at a seed kept finished already
        if not earlier:
          kept.append(run)
        elif 'summary' in run:  # a rerun takes its failed attempt's place; the record says so
          gone = kept[earlier[0]]
          out['replaced'].append({
              'label': label,
              'seed': seed,
              'by_file': os.path.basename(path),
              'returncode': gone.get('returncode'),
              'why': _why_failed(gone)
          })
          kept[earlier[0]] = run
        # else failed again: the earlier failed attempt stays
    if 'stage_profile' in r and 'stage_profile' not in out:
      out['stage_profile'] = r['stage_profile']
  if telemetry:
    backfill_steady_gpm(out['runs'], list(telemetry))
  labels = [(label, v['schedule'], tuple(v['flags'])) for label, v in labels_seen.items()]
  out['commit'] = ','.join(sorted({r.get('commit', 'unknown') for r in results}))
  out['figures'] = aggregate(out['runs'])
  for key in [k for k in out if k.startswith('ratios_vs_')]:
    del out[key]
  out['ratios_vs_' + labels[0][0]] = ratios(out['figures'], labels[0][0], out['runs'])
  if 'stage_profile' in out:
    out['overlap'] = overlap_efficiency(out['figures'], labels, out['stage_profile'])
  out['unfinished'] = [u for r in results for u in r.get('unfinished', [])]
  return out


def main(argv):
  del argv
  if _MERGE.value:
    try:
      merged = merge(_MERGE.value, _TELEMETRY.value)
      if _PROFILE_FROM.value:  # a newer stage profile of the same workload for the merged result
        merged = with_profile(merged, _PROFILE_FROM.value)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    with open(_OUT.value, 'w') as f:
      json.dump(merged, f, indent=2, allow_nan=False)
    print(f'wrote {_OUT.value} ({", ".join(merged["seeds"])} seeds of {", ".join(merged["runs"])})', flush=True)
    return
  flagfile, extra = _FLAGFILE.value, list(_EXTRA.value)
  if _QUICK.value:
    flagfile, extra = flagfile or QUICK_FLAGFILE, QUICK_EXTRA + extra
  if not flagfile:
    raise app.UsageError('--bench_flagfile is required (or --quick).')
  if not os.path.exists(flagfile):
    raise app.UsageError(f'--bench_flagfile={flagfile} does not exist.')
  try:
    labels = parse_schedules(_SCHEDULES.value, _ONLY.value)
    timeouts = parse_label_timeouts(_LABEL_TIMEOUT.value, labels, _TIMEOUT.value)
    label_env = parse_label_env(_LABEL_ENV.value, labels)
    slots = _gpu_slots(_GPUS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  run_root = os.path.splitext(_OUT.value)[0] + '_runs'
  result = {
      'commit': commit(),
      'tree': source_tree(),
      'compile_cache': _CACHE.value,
      'flagfile': flagfile,
      'extra_flags': extra,
      'quick': _QUICK.value,
      'seeds': _SEEDS.value,
      'order': _ORDER.value,
      'labels': {
          label: {
              'schedule': sched,
              'flags': list(f),
              'time_limit_s': timeouts[label],
              'env': label_env[label]
          } for label, sched, f in labels
      },
      'gpus': [s[0] for s in slots if s is not None],
      'machine': machine(),
      'runs': {}
  }
  os.makedirs(run_root, exist_ok=True)
  if _CACHE.value == 'per_label':  # cold for every label of this invocation, also where an earlier one wrote here
    shutil.rmtree(os.path.join(run_root, 'cache'), ignore_errors=True)
  # Device-wide figures only (no pids), one sampler per GPU: each run's own telemetry covers its processes.
  tels = {}
  for slot in dict.fromkeys(slots):  # one sampler per GPU, also where --gpus names one GPU several times
    device = slot[1] if slot else None
    name = f'telemetry_gpu{slot[0]}' if slot else 'telemetry'
    tels[slot] = telemetry.Telemetry(run_root, dict, period=0.1, device=device, name=name).start()
  if _PROFILE_FROM.value:
    try:
      result['stage_profile'] = profile_from(_PROFILE_FROM.value, flagfile, extra)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  elif _STAGE_PROFILE.value:
    env = dict(os.environ)
    if slots[0] is not None:
      env['CUDA_VISIBLE_DEVICES'] = slots[0][1]
    print('== stage profile', flush=True)
    result['stage_profile'] = _stage_profile(flagfile, extra, os.path.join(run_root, 'stage_profile.json'), env)
  jobs = job_order(labels, _SEEDS.value, _ORDER.value)
  done: Dict[Job, dict] = {}
  todo: 'queue.Queue[Job]' = queue.Queue()
  for job in jobs:
    todo.put(job)
  lock = threading.Lock()

  def serve(slot, write):
    env = dict(os.environ)
    if slot is not None:
      env['CUDA_VISIBLE_DEVICES'] = slot[1]
    while not _STOPPING.is_set():
      try:
        job = todo.get_nowait()
      except queue.Empty:
        return
      run_dir = os.path.join(run_root, job.label, f'seed{job.seed}')
      with lock:
        print(f'== {job.label} seed {job.seed}' + (f' on GPU {slot[0]}' if slot else ''), flush=True)
      command = _command(flagfile, job, extra, run_dir, cache_flags(_CACHE.value, run_root, job.label))
      run = _run_one(command, run_dir, dict(env, **label_env[job.label]), tels[slot], timeouts[job.label])
      if slot is not None:
        run['gpu'] = slot[0]
      summary = run.get('summary', {})
      with lock:
        done[job] = run
        print(f'{job.label} seed {job.seed}: ' + json.dumps({k: summary.get(k) for k in FIGURES}), flush=True)
        if 'error_tail' in run:
          print(run['error_tail'][-2000:], flush=True)
      write()

  def write() -> None:
    """The JSON of the runs finished so far (rewritten after each run, so a stopped harness loses nothing)."""
    with lock:
      finished = [job for job in jobs if job in done]
      result['runs'] = {}
      for job in finished:
        result['runs'].setdefault(job.label, []).append(done[job])
      result['unfinished'] = [f'{job.label}/seed{job.seed}' for job in jobs if job not in done]
      present = [label for label, _, _ in labels if label in result['runs']]
      result['figures'] = aggregate(result['runs'])
      if present:
        result['ratios_vs_' + present[0]] = ratios(result['figures'], present[0], result['runs'])
      if 'stage_profile' in result:
        result['overlap'] = overlap_efficiency(result['figures'], [l for l in labels if l[0] in present],
                                               result['stage_profile'])
      os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
      with open(_OUT.value + '.tmp', 'w') as f:
        json.dump(result, f, indent=2, allow_nan=False)
      os.replace(_OUT.value + '.tmp', _OUT.value)

  threads = [threading.Thread(target=serve, args=(slot, write), daemon=True) for slot in slots]
  previous = signal.signal(signal.SIGTERM, _stop_runs)
  try:
    for t in threads:
      t.start()
    for t in threads:
      while t.is_alive():
        t.join(timeout=0.5)
  except KeyboardInterrupt:
    _stop_runs(signal.SIGINT, None)
    for t in threads:
      t.join()
  finally:
    signal.signal(signal.SIGTERM, previous)
    for tel in tels.values():
      tel.stop()
  write()
  print(f'wrote {_OUT.value}', flush=True)
  failed = [f'{job.label}/seed{job.seed}' for job in jobs if job in done and 'error_tail' in done[job]]
  if result['unfinished']:
    print(f'not run (stopped): {", ".join(result["unfinished"])}', file=sys.stderr)
    sys.exit(1)
  if failed:
    print(f'failed runs: {", ".join(failed)}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
