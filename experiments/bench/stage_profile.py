r"""Isolated stage profiles of a workload: sim, generation and training each timed alone, compile excluded.

  python -m experiments.bench.stage_profile --flagfile=experiments/w2_transformer.flags --num_groups=2 \
      --profile_out=/tmp/w2_stages.json [--repeats=5]

Times the stages at the fused batch (all envs) and at the process schedules' group size (num_envs / num_groups)
with `ebrl_jax.resources.calibrate` (native MuJoCo: each size with the threads the run gives it, --num_threads per
group) and writes per-env-step times t_sim, t_gen, t_train, the sequential floor
and the perfect-overlap ceiling (BENCHMARKS.md) to --profile_out. The bench harness runs it with
`--stage_profile` and reports every run's overlap efficiency (achieved / ceiling) beside it.
"""
from __future__ import annotations

import json
import os

from absl import app
from absl import flags

from ebrl_jax import main as ebrl_main  # defines the workload flags read from --flagfile
from ebrl_jax.resources import calibrate

_OUT = flags.DEFINE_string('profile_out', None, 'Where to write the JSON profile.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed calls per stage and batch size (after one warm-up call).')


def main(argv):
  del argv
  if not _OUT.value:
    raise app.UsageError('--profile_out is required.')
  if _REPEATS.value < 1:
    raise app.UsageError(f'--repeats={_REPEATS.value} must be >= 1.')
  try:
    cfg = ebrl_main.config_from_flags()
    sizes = sorted({cfg.sim.num_envs, cfg.sim.num_envs // cfg.schedule.num_groups})
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    # What --plan's calibration processes run; native MuJoCo's whole batch with every group's threads.
    calibrate.calibrate_main(cfg, sizes, _REPEATS.value, _OUT.value, all_groups_threads=True)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  with open(_OUT.value) as f:
    profile = json.load(f)
  for e, g in profile['groups'].items():
    print(
        f'E={e}: t_sim {g["sim"]["per_env_step_s"]*1e9:.1f} ns, t_gen {g["generation"]["per_env_step_s"]*1e9:.1f} ns, '
        f't_train {profile["train"]["per_env_step_s"]*1e9:.1f} ns per env step; floor '
        f'{g["sequential_floor_steps_per_s"]:.0f}, ceiling {g["overlap_ceiling_steps_per_s"]:.0f} env steps/s',
        flush=True)


if __name__ == '__main__':
  app.run(main)
