"""Validation helpers shared by the config dataclasses: each error is a `ValueError` naming the field as its flag
and what is allowed."""
from __future__ import annotations


def check_choice(field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f'--{field}={value!r} is not valid; allowed values: {", ".join(map(str, allowed))}.')


def check_positive(field: str, value, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok:
    bound = '>= 0' if allow_zero else '> 0'
    raise ValueError(f'--{field}={value!r} must be {bound}.')


def check_range(field: str, value: float, lo: float, hi: float) -> None:
  if not lo <= value <= hi:
    raise ValueError(f'--{field}={value!r} must lie in [{lo}, {hi}].')


def check_schedule_options(schedule, resources) -> None:
  """`--schedule=auto` and `--deterministic` (of a `ScheduleConfig`) against what they cannot be combined with."""
  if schedule.name == 'auto':
    live = [f'--{name}' for name in ('quota_schedule', 'replan', 'slack_quotas') if getattr(resources, name)]
    if live:
      raise ValueError(f'--schedule=auto cannot be combined with {" / ".join(live)}: they change a process '
                       'schedule\'s quotas during the run, and auto may choose fused; choose the schedule yourself '
                       'to use them.')
  if schedule.deterministic:
    _check_deterministic(schedule, resources)


def _check_deterministic(schedule, resources) -> None:
  """`--deterministic` against what would let timing decide the run anyway."""
  if schedule.name not in ('sync', 'async'):
    raise ValueError(f'--deterministic fixes what the process schedules leave to timing; it needs --schedule=sync '
                     f'or async (got --schedule={schedule.name}: fused and overlap are repeatable as they are).')
  if not schedule.colocate_generation:
    raise ValueError('--deterministic needs --colocate_generation: a separate generation worker batches whichever '
                     'requests are ready, so its batches (and their keys) depend on timing.')
  live = [f'--{name}' for name in ('quota_schedule', 'replan', 'slack_quotas') if getattr(resources, name)]
  if live:
    raise ValueError(f'--deterministic cannot be combined with {" / ".join(live)}: a live quota change replaces a '
                     'rollout worker, whose replacement starts new episodes at a moment set by timing.')
