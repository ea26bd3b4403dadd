"""Figures derived from a run's summary, shared by the harness (run.py) and the report (no plotting here)."""
import gzip
import json
import re


def read_jsonl(path: str) -> list:
  """The records of a JSON-lines file, gzipped (.gz) or not; OSError or ValueError where it cannot be read."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt') as f:
    return [json.loads(line) for line in f if line.strip()]


def has_rate(summary: dict) -> bool:
  """Whether a run counted any training (`train_wall_s` > 0). A run stopped before its first counted iteration has
  a summary but no rate (its env_steps_per_s is 0), whatever its exit code: by its time limit or a signal, or by
  --max_wall_s with exit 0 (`auto` whose calibration took the budget). Such a run stays out of every mean."""
  wall = summary.get('train_wall_s')
  return bool(summary.get('env_steps_per_s')) if wall is None else wall > 0  # (results kept before train_wall_s)


def run_seed(run: dict):
  """The seed a kept harness run was started with (its command's --seed), None where the command does not say."""
  found = re.search(r'--seed=(\S+)', run.get('command', ''))
  return found.group(1) if found else None


def _reached(point: dict) -> float:
  """When training reached an evaluated version (run clock): `reached_s` where the run recorded it, else when its
  evaluation finished (runs before it was recorded; the same moment for an evaluation in line)."""
  return point.get('reached_s', point['wall_s'])


def steady_env_steps_per_s(summary: dict):
  """Env steps per wall-clock second from the moment training reached the second evaluated version to the moment
  it reached the last (`_reached`): the pace once start-up is over, with the evaluations that training waits for
  (in line: `fused`, `--evaluator=trainer`) inside it and those of an evaluator process beside it. Until the curve
  recorded `reached_s`, the window ran between the evaluations' ends, which an evaluator lagging at the second
  one shortened (W2 async on an H100: 153 k env steps/s "steady" beside 88 k end to end). Start-up (worker
  compiles, the first evaluation) is inside a process schedule's end-to-end figure, which dominates short runs.
  None with fewer than three evaluations."""
  curve = summary.get('eval_curve') or []
  if len(curve) < 3:
    return None
  a, b = curve[1], curve[-1]
  span = _reached(b) - _reached(a)
  return (b['env_steps'] - a['env_steps']) / span if span > 0 else None


def rollout_env_steps_per_s(summary: dict):
  """Env steps per second while collecting, as a process schedule reports it (`extra.rollout`); None else."""
  return ((summary.get('extra') or {}).get('rollout') or {}).get('env_steps_per_s')


def quota_swaps(summary: dict) -> list:
  """The run's finished SM-quota swaps (`extra.replan.swaps`, failed ones left out)."""
  swaps = ((summary.get('extra') or {}).get('replan') or {}).get('swaps', [])
  return [w for w in swaps if not w.get('failed')]


def counts_first_iteration(summary: dict) -> bool:
  """True for a process-schedule run kept before 29df545 (no `extra.startup_s`): its end-to-end rate counts the
  session's first iteration (worker start-up and compiles) as throughput. Since then that iteration is start-up,
  as BENCHMARKS defines the figure; the two are not to be averaged together."""
  extra = summary.get('extra') or {}
  return 'segments_consumed' in extra and 'startup_s' not in extra


def _spread(values: list):
  """(mean, sample standard deviation or None below two values, count); (None, None, 0) when empty."""
  values = [v for v in values if isinstance(v, (int, float))]
  if not values:
    return None, None, 0
  mean = sum(values) / len(values)
  sd = (sum((v - mean)**2 for v in values) / (len(values) - 1))**0.5 if len(values) > 1 else None
  return mean, sd, len(values)


def end_to_end(summaries: list) -> dict:
  """The end-to-end env steps/s over seeds of one definition: the runs measured with start-up excluded where
  any are (older runs left out, `seeds` says how many count), else the older runs' figure, flagged
  `counts_first_iteration`. Mean, sample standard deviation (None for one seed) and seed count."""
  current = [s for s in summaries if not counts_first_iteration(s)]
  chosen = current or summaries
  mean, sd, n = _spread([s.get('env_steps_per_s') for s in chosen])
  return {'mean': mean, 'sd': sd, 'seeds': n, 'counts_first_iteration': bool(chosen) and not current}


def steady_window(run: dict):
  """(start, end, how) in Unix seconds: the window of `steady_env_steps_per_s` (second to last evaluated version) of a
  finished harness run, for the device's SM activity over the same stretch. `how` is 'exact' where the
  evaluations carry their Unix time (`unix`, since this commit), else 'end-anchored': the run's clock is taken to
  have started `wall_s` before its process ended, which places the window late by the process's exit time
  (stopping workers, about a second). None without three evaluations."""
  summary = run.get('summary') or {}
  curve = summary.get('eval_curve') or []
  if len(curve) < 3:
    return None
  a, b = curve[1], curve[-1]
  if 'unix' in a and 'unix' in b:  # a point's `unix` is its `wall_s` on the Unix clock
    return a['unix'] - a['wall_s'] + _reached(a), b['unix'] - b['wall_s'] + _reached(b), 'exact'
  if 'end_unix' not in run or 'wall_s' not in summary:
    return None
  t0 = run['end_unix'] - summary['wall_s']
  return t0 + _reached(a), t0 + _reached(b), 'end-anchored'


def window_mean(records: list, start: float, end: float, key: str = 'sm_activity_pct'):
  """(mean of `key` over the telemetry samples whose interval lies in [start, end], their count); (None, 0) if
  none. A GPM sample at time t is the mean over the interval since the sample before it, so a sample counts when
  that one was taken at or after `start` (the first sample after `start` covers time before it) and t <= end."""
  samples = sorted((r['t'], r[key]) for r in records if 't' in r and r.get(key) is not None)
  values = [v for (before, _), (t, v) in zip(samples, samples[1:]) if before >= start and t <= end]
  return (sum(values) / len(values) if values else None), len(values)


def steady(summaries: list) -> dict:
  """`steady_env_steps_per_s` over seeds (comparable across both definitions): mean, sample sd, count."""
  mean, sd, n = _spread([steady_env_steps_per_s(s) for s in summaries])
  return {'mean': mean, 'sd': sd, 'seeds': n}
