"""What `--schedule=auto`'s calibration costs: `controller.auto.resolve` (the profiles read or calibrated, then the
choice) on a fresh profile store, timed, with the per-quota and per-phase seconds the calibration records.

  python -m experiments.calibration_cost --flagfile=experiments/quickstart.flags \
      --calibration_out=experiments/results/calibration_cost_cpu.json --calibration_label=after

Each cache mode starts from an empty profile store: `cold` also from an empty compilation cache (a fresh machine),
`warm` from the cache the cold pass left (what the second and later quotas of one calibration find, and a machine
whose profiles were deleted). The result goes under `labels[label]` of the output JSON (other labels are kept), so
the code before a change can be measured into the same file from an export of its commit (run this file from
there). With --use_mps on a GPU the quotas of --calibration_quotas are calibrated under the run's MPS daemon.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

from absl import flags

from ebrl_jax import main as ebrl_main
from ebrl_jax.controller import auto
from experiments.bench import run as bench_run

_OUT = flags.DEFINE_string('calibration_out', '', 'JSON file the result is merged into (under labels[label]).')
_LABEL = flags.DEFINE_string('calibration_label', 'after', 'Name of this measurement in the output JSON.')
_CACHES = flags.DEFINE_list('calibration_caches', ['cold', 'warm'], 'Cache modes to measure, in order: cold, warm.')


def _loadavg():
  try:
    return list(os.getloadavg())
  except OSError:
    return None


def measure(cfg, root: str, cache: str) -> dict:
  """One `auto.resolve` on an empty profile store under `root` (cache: 'cold' empties the compilation cache)."""
  if cache not in ('cold', 'warm'):
    raise ValueError(f'--calibration_caches: {cache!r} is not cold or warm.')
  cache_dir = os.path.join(root, 'xla')
  if cache == 'cold' and os.path.exists(cache_dir):
    raise ValueError(f'{cache_dir} exists: a cold pass needs an empty cache (give cold first).')
  run_dir = os.path.join(root, f'run_{cache}')
  cfg = dataclasses.replace(cfg,
                            schedule=dataclasses.replace(cfg.schedule, run_dir=run_dir,
                                                         compilation_cache_dir=cache_dir),
                            resources=dataclasses.replace(cfg.resources,
                                                          profile_dir=os.path.join(root, f'profiles_{cache}')))
  os.makedirs(run_dir, exist_ok=True)
  before = _loadavg()
  t0 = time.monotonic()
  chosen, record = auto.resolve(cfg)
  wall = time.monotonic() - t0
  warmups = {}  # quota -> stage or 'sim/E', 'generation/E' -> the first (compiling) call's seconds
  for q in record.get('calibration_quotas') or []:
    with open(os.path.join(run_dir, f'calibration_q{q}.json')) as f:
      profile = json.load(f)
    if 'warmup_s' in profile.get('train', {}):
      warmups[str(q)] = {'train': profile['train']['warmup_s']}
      for e, entry in profile['groups'].items():
        warmups[str(q)].update({f'{name}/{e}': entry[name]['warmup_s'] for name in ('sim', 'generation')})
  return {
      'cache': cache,
      'resolve_s': wall,
      'calibrated_s': record.get('calibrated_s'),
      'quotas': record.get('calibration_quotas'),
      'process_s': record.get('calibration_process_s'),
      'phase_s': record.get('calibration_phase_s'),
      'warmup_s': warmups or None,
      'skipped': record.get('calibration_skipped'),
      'schedule': chosen.schedule.name,
      'loadavg_before': before,
      'loadavg_after': _loadavg()
  }


def main(argv) -> None:
  del argv  # the flags are parsed; the command is recorded whole
  cfg = ebrl_main.config_from_flags()
  result = {
      'commit': bench_run.commit(),
      'command': ' '.join(['python', '-m', 'experiments.calibration_cost', *sys.argv[1:]]),
      'machine': bench_run.machine(),
      'runs': []
  }
  with tempfile.TemporaryDirectory(prefix='calibration_cost_') as root:
    for cache in _CACHES.value:
      result['runs'].append(measure(cfg, root, cache))
      print(json.dumps(result['runs'][-1]), flush=True)
  if _OUT.value:
    data = {'labels': {}}
    if os.path.exists(_OUT.value):
      with open(_OUT.value) as f:
        data = json.load(f)
    data['labels'][_LABEL.value] = result
    with open(_OUT.value, 'w') as f:
      json.dump(data, f, indent=1)


if __name__ == '__main__':
  main(ebrl_main.parse_flags(sys.argv))
