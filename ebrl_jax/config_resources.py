"""`ResourceConfig`: where the process schedules' workers run — MPS and SM quotas, GPU memory, CPU cores,
telemetry, the planner and live quota changes. Part of `ebrl_jax.config` (re-exported there)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from ebrl_jax.config_checks import check_choice as _check_choice
from ebrl_jax.config_checks import check_positive as _check_positive
from ebrl_jax.config_checks import check_range as _check_range

QUOTA_ROLES = ('trainer', 'rollout', 'generation', 'evaluator')
# Under MPS the evaluator process (--evaluator=process) runs at this SM quota unless --sm_quotas gives it one: it is
# off the critical path, so a small cap slows only the evaluations, never the trainer or the rollouts beside it.
EVALUATOR_QUOTA = 10


def _role_values(flag: str, text: str, convert, example: str) -> Dict[str, object]:
  """Parses 'role=value,role=value' (roles from QUOTA_ROLES) with `convert`; errors name the flag."""
  out: Dict[str, object] = {}
  for item in filter(None, (p.strip() for p in text.split(','))):
    role, _, value = item.partition('=')
    if role not in QUOTA_ROLES:
      raise ValueError(f'--{flag}: role {role!r} is not valid; allowed roles: {", ".join(QUOTA_ROLES)}.')
    if role in out:
      raise ValueError(f'--{flag}={text}: role {role!r} is given twice; give each role once.')
    try:
      out[role] = convert(value)
    except ValueError:
      raise ValueError(f'--{flag}: {item!r} must read {example}.') from None
  return out


def check_quota_sum(resources: 'ResourceConfig', processes: Dict[str, int]) -> None:
  """Refuses --sm_quotas that give the processes running at once (`processes`: role -> how many run at once)
  more than 100 % of the GPU's SMs together. Roles without a quota are not counted."""
  quotas = resources.quotas
  given = [(role, n) for role, n in processes.items() if role in quotas and n]
  total = sum(quotas[role] * n for role, n in given)
  if total > 100:
    parts = ' + '.join(f'{n} x {role}={quotas[role]}' if n > 1 else f'{role}={quotas[role]}' for role, n in given)
    raise ValueError(f'--sm_quotas={resources.sm_quotas} gives the processes that run at once {parts} = {total} % '
                     'of the SMs, more than 100 %; lower the quotas (every rollout worker gets the rollout quota) or '
                     'run fewer --num_groups.')


@dataclasses.dataclass(frozen=True)
class ResourceConfig:
  """Placement of the process schedules' workers on the machine."""
  platform: str = ''  # '' lets JAX choose; else 'cpu', 'gpu' or 'cuda'
  # Run the workers under an NVIDIA MPS daemon (started for the run if none serves CUDA_MPS_PIPE_DIRECTORY).
  use_mps: bool = False
  # SM quotas in percent per role under MPS, e.g. 'trainer=30,rollout=35' ('' = no quotas).
  sm_quotas: str = ''
  # GPU memory plan: each worker process gets its estimated footprint times this as its budget.
  memory_headroom: float = 1.5
  # GPU memory fractions per role, fixed by hand instead of planned, e.g. 'trainer=0.4,rollout=0.2' (each
  # rollout worker gets the rollout fraction; '' = planned for every role).
  memory_fractions: str = ''
  # A calibration JSON (experiments/bench/stage_profile.py --profile_out) whose measured peak memory raises the
  # plan's estimates where it is larger ('' = estimates only).
  memory_profile: str = ''
  # Pin native-MuJoCo rollout workers to cores of their own, and each GPU feeder process to one core.
  pin_cpus: bool = True
  # Telemetry (SM activity via NVML GPM, GPU memory and CPU use per process) every this many seconds; 0 = off.
  telemetry_period_s: float = 0.1
  # sync/async: choose the number of env groups and (under MPS) the SM quotas from stage profiles, calibrating
  # the stages first when the profile store holds none for this machine and workload. --sm_quotas pins roles.
  plan: bool = False
  # With --plan or --schedule=auto on an MJX backend: also choose co-located or separate generation (a generation
  # worker acting for every group) from the same profiles and the per-step hand-off (resources/generation_choice.py).
  plan_generation: bool = False
  # Where stage profiles are kept between runs ('' = ~/.cache/ebrl_jax/profiles).
  profile_dir: str = ''
  # SM quotas (percent) the calibration times each stage at, one process per quota (100 only without MPS).
  calibration_quotas: Tuple[int, ...] = (25, 50, 100)
  # Seconds from process start the calibration may take (0: a third of --max_wall_s when that is set, else no
  # budget but each process's own 900 s): a process still running then is stopped, the quotas left skipped; with
  # none calibrated, --schedule=auto runs fused and --plan stops with an error. What was calibrated is kept.
  calibration_budget_s: float = 0.0
  # --schedule=auto: a process schedule the profiles chose first runs this many seconds of training after its
  # start-up, then fused as long, inside the calibration budget; it is kept only if it measured faster than fused
  # by 2 %, else the run goes on as fused (resources/auto_trial.py). The verdict is kept beside the profile store,
  # so the next run of the same layout decides without a trial. 0: no trial.
  auto_trial_s: float = 20.0
  # With --plan: re-plan the ROLLOUT quota during the run from measured stage times (the trainer's quota and the
  # number of groups stay fixed); a change swaps each rollout worker for a warm standby at the new quota.
  replan: bool = False
  # Seconds between re-planning looks; a change must gain more than --replan_hysteresis (fraction of the
  # iteration time), come --replan_min_interval trainer iterations after the last, and pay back
  # --replan_change_cost_s (replaced by the measured gap of a swap once there is one) within 200 iterations.
  replan_period_s: float = 5.0
  replan_hysteresis: float = 0.10
  replan_min_interval: int = 20
  replan_change_cost_s: float = 30.0
  # --replan_groups: trainer iterations of one measured window (the layout's rate, collect and train seconds; one
  # more iteration is skipped after the start and after each change), and the horizon a change must pay back its
  # pause in (the run's remaining time if shorter). --replan_hysteresis is its margin, --replan_group_change_cost_s
  # its pause before one was measured.
  replan_window: int = 5
  replan_horizon_s: float = 60.0
  # The pause a first group change is assumed to cost (the last measured one's replaces it): the largest measured
  # so far, 7.8 s (pauses of 3.5-7.8 s in experiments/results/replan_groups_cpu.json, 5.3 s in relayout_cpu.json),
  # rounded up. Not --replan_change_cost_s (30 s, the quota re-planner's): with it and the 60 s horizon a first
  # group change needed a predicted gain over 2x; with 8 s one over ~15 %.
  replan_group_change_cost_s: float = 8.0
  # Manual rollout quota changes through the same warm-standby swaps, 'iteration:rollout=percent[,...]', e.g.
  # '10:rollout=40' switches every rollout worker to 40 % at trainer iteration 10 (measures a change's cost).
  quota_schedule: str = ''
  # Slack-aware rollout quotas (docs/architecture.md, The overlap schedule): each iteration's measured stage times
  # give the critical path and the slack beside it; a quota that shrinks work with slack and grows the critical
  # path's is tried by the same swaps, kept only if --slack_trial_iterations iterations run faster, else reverted.
  slack_quotas: bool = False
  slack_trial_iterations: int = 5
  slack_step: int = 10  # quota points moved per candidate

  def __post_init__(self):
    if self.platform not in ('', 'cpu', 'gpu', 'cuda'):
      raise ValueError(
          f'--platform={self.platform!r} is not valid; allowed values: cpu, gpu, cuda (unset: JAX chooses).')
    _check_positive('telemetry_period_s', self.telemetry_period_s, allow_zero=True)
    quotas = self.quotas  # parses and checks
    _check_positive('calibration_budget_s', self.calibration_budget_s, allow_zero=True)
    _check_positive('auto_trial_s', self.auto_trial_s, allow_zero=True)
    if not self.calibration_quotas or any(not 1 <= q <= 100 for q in self.calibration_quotas):
      raise ValueError(f'--calibration_quotas={",".join(map(str, self.calibration_quotas))} must be non-empty, '
                       'each in [1, 100] percent.')
    if quotas and not self.use_mps:
      raise ValueError(f'--sm_quotas={self.sm_quotas} needs --use_mps (quotas are an MPS setting).')
    if not self.memory_headroom >= 1.0:
      raise ValueError(f'--memory_headroom={self.memory_headroom} must be >= 1 (a budget is the estimated '
                       'footprint times the headroom; to give less, set --memory_fractions).')
    _ = self.fractions  # parses and checks (the memory plan checks that they fit the GPU)
    if self.replan and not self.plan:
      raise ValueError('--replan re-plans the quotas that --plan chose; it needs --plan.')
    _check_positive('replan_period_s', self.replan_period_s)
    _check_positive('replan_hysteresis', self.replan_hysteresis, allow_zero=True)
    _check_positive('replan_min_interval', self.replan_min_interval, allow_zero=True)
    _check_positive('replan_change_cost_s', self.replan_change_cost_s, allow_zero=True)
    _check_positive('replan_window', self.replan_window)
    _check_positive('replan_horizon_s', self.replan_horizon_s)
    _check_positive('replan_group_change_cost_s', self.replan_group_change_cost_s, allow_zero=True)
    changes = self.quota_changes  # parses and checks
    if changes and not self.use_mps:
      raise ValueError(f'--quota_schedule={self.quota_schedule} needs --use_mps (quotas are an MPS setting).')
    _check_positive('slack_trial_iterations', self.slack_trial_iterations)
    _check_range('slack_step', self.slack_step, 1, 90)
    if self.slack_quotas and not self.use_mps:
      raise ValueError('--slack_quotas changes SM quotas, an MPS setting; it needs --use_mps.')
    if self.slack_quotas and (changes or self.replan):
      raise ValueError('--slack_quotas, --replan and --quota_schedule each change the rollout quota; give one.')
    if changes and self.replan:
      raise ValueError(f'--quota_schedule={self.quota_schedule} and --replan both change the rollout quota '
                       'during the run; use one of them.')

  @property
  def quota_changes(self) -> Tuple[Tuple[int, int], ...]:
    """`--quota_schedule` as ((trainer iteration, rollout percent), ...), in iteration order."""
    out = []
    for item in filter(None, (p.strip() for p in self.quota_schedule.split(','))):
      when, _, change = item.partition(':')
      role, _, value = change.partition('=')
      try:
        iteration, percent = int(when), int(value)
      except ValueError:
        raise ValueError(
            f'--quota_schedule: {item!r} must read iteration:rollout=percent, e.g. 10:rollout=40.') from None
      if role != 'rollout':
        raise ValueError(f'--quota_schedule: {item!r} changes role {role!r}; only the rollout quota changes '
                         'during a run (the trainer holds the training state and is never swapped).')
      if iteration < 1 or not 1 <= percent <= 100:
        raise ValueError(f'--quota_schedule: {item!r}: the iteration must be >= 1 (got {iteration}) and the '
                         f'quota in [1, 100] percent (got {percent}).')
      out.append((iteration, percent))
    if len({i for i, _ in out}) != len(out):
      raise ValueError(f'--quota_schedule={self.quota_schedule} names an iteration twice.')
    return tuple(sorted(out))

  @property
  def quotas(self) -> Dict[str, int]:
    out = _role_values('sm_quotas', self.sm_quotas, int, 'role=percent, e.g. trainer=30')
    for role, percent in out.items():
      if not 1 <= percent <= 100:
        raise ValueError(f'--sm_quotas: {role}={percent} must lie in [1, 100] percent.')
    return out

  def quota_of(self, role: str) -> Optional[int]:
    """The SM quota (percent) a process of `role` ('trainer', 'rollout/1', 'evaluator', ...) runs at under MPS:
    --sm_quotas's, else EVALUATOR_QUOTA for the evaluator, else None (no cap)."""
    kind = role.split('/')[0]
    return self.quotas.get(kind, EVALUATOR_QUOTA if kind == 'evaluator' else None)

  @property
  def fractions(self) -> Dict[str, float]:
    """--memory_fractions by role: the GPU memory share of each process of that role."""
    out = _role_values('memory_fractions', self.memory_fractions, float, 'role=fraction, e.g. trainer=0.4')
    for role, fraction in out.items():
      if not 0.0 < fraction <= 1.0:
        raise ValueError(f'--memory_fractions: {role}={fraction} must lie in (0, 1] (a share of the GPU memory).')
    return out
