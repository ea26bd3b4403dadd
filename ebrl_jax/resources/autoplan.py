"""`--plan`: the process schedules' env groups and SM quotas chosen from stage profiles at the start of a run.

  1. The profile store of this machine (GPU model, CPU count) and workload is read from `--profile_dir`.
  2. Where it lacks a quota of `--calibration_quotas` (a quota every stage has samples at), the stages are
     calibrated there (`calibrate.profile_stages`): one short-lived process per missing quota, 100 % first, each
     started with that CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under the run's MPS daemon, at every group size the
     planner may choose, one after another (each times its stages with the GPU to itself; compile excluded, the
     compilation cache makes later quotas cheap). `--schedule=auto` skips the quotas below 100 % when the 100 %
     profile already shows that no quota can make a process schedule win (`schedule_choice.quotas_cannot_win`).
     The store is saved: the next run on this machine and workload starts from it and calibrates what it lacks.
  3. `planner.plan` picks the number of groups and the quotas (or none: every process may use every SM) with the
     least predicted iteration time; quotas given with `--sm_quotas` stay pinned. Without MPS only the group count
     is chosen: there are no quotas to share, and the prediction adds up the processes' GPU work.
  4. The run goes on with the chosen `--num_groups` (and `--sm_quotas`); the decision, its reason and the
     predicted env steps/s go to the log and to the summary, where the measured figure sits beside it. Quotas
     stay fixed unless `--replan` is on: controller/replan.py then re-plans them from measured stage times.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from absl import logging
import pynvml

from ebrl_jax import config as config_lib
from ebrl_jax import config_generation
from ebrl_jax import sim
from ebrl_jax.resources import auto_trial
from ebrl_jax.resources import calibrate
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import cpus
from ebrl_jax.resources import generation_choice
from ebrl_jax.resources import planner
from ebrl_jax.resources import profile_keys
from ebrl_jax.resources import profiles
from ebrl_jax.resources import schedule_choice
from ebrl_jax.resources import telemetry
from ebrl_jax.runtime import errors
from ebrl_jax.transport import cuda_ipc

_GROUP_CHOICES = (1, 2, 4, 8)
_QUOTA_GRID = tuple(range(10, 101, 10))
_STAGES = ('sim', 'generation', 'train')


def _nvml_gpu() -> Tuple[str, str]:
  """(name, driver version) of the visible GPU from NVML; ('none', 'none') on a machine without NVML or GPU."""
  try:
    pynvml.nvmlInit()
    handle = telemetry.nvml_handle(pynvml, telemetry.visible_gpu())
    found = (pynvml.nvmlDeviceGetName(handle), pynvml.nvmlSystemGetDriverVersion())
  except Exception:  # pylint: disable=broad-except  (no NVML, no GPU: a CPU machine)
    return 'none', 'none'
  return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in found)


def machine_key(gpu_name: Optional[str] = None) -> str:
  """This machine as the profile store knows it: the visible GPU's name (NVML, unless given) and the CPU count."""
  return profiles.machine_id(gpu_name or _nvml_gpu()[0], os.cpu_count() or 1)


def load_store(cfg: config_lib.Config, path: Optional[str] = None) -> profiles.ProfileStore:
  """This machine's store for `cfg`'s workload at `path` (None: under --profile_dir), told its GPU driver."""
  name, driver = _nvml_gpu()  # one NVML query for the key and the driver
  machine, workload = machine_key(name), profile_keys.workload_key(cfg)
  return profiles.ProfileStore.load(path or store_path(cfg, machine, workload), machine, workload, driver)


def store_path(cfg: config_lib.Config, machine: str, workload: str) -> str:
  folder = cfg.resources.profile_dir or os.path.join(os.path.expanduser('~'), '.cache', 'ebrl_jax', 'profiles')
  digest = hashlib.sha1(f'{machine}|{workload}'.encode()).hexdigest()[:16]
  return os.path.join(folder, f'{digest}.json')


def group_choices(cfg: config_lib.Config, sim_cores: Optional[int] = None) -> Tuple[int, ...]:
  """Group counts that split the envs evenly into whole GRPO groups and whole env slices; for native MuJoCo with
  a fixed --num_threads per group and pinned cores, also no more groups than the sim cores (`sim_cores`: this
  process's cores less one per GPU feeder) give each its threads, since the calibration times a group on its own
  threads and oversubscribed cores would make that prediction wrong."""
  n = cfg.sim.num_envs
  if sim_cores is None and cfg.sim.backend == 'mujoco_cpu' and cfg.sim.num_threads and cfg.resources.pin_cpus:
    feeders = 1 + (0 if cfg.schedule.colocate_generation else 1)
    sim_cores = max(1, len(cpus.available_cores()) - feeders)
  out = []
  for g in _GROUP_CHOICES:
    e = n // g
    if g * e == n and e % cfg.sim.group_size == 0 and e % cfg.schedule.env_slices == 0:
      if sim_cores is None or g == 1 or g * cfg.sim.num_threads <= sim_cores:
        out.append(g)
  return tuple(out)


def calibrated_quotas(store) -> Set[float]:
  """The SM quotas every calibrated stage ('sim', 'generation', 'train') has samples at."""
  sets = [{q for _, q, _ in store[name].samples} if name in store else set() for name in _STAGES]
  return set.intersection(*sets)


def plan_space(cfg: config_lib.Config,
               mps_active: bool,
               num_groups: Optional[Tuple[int, ...]] = None,
               quotas: Optional[Tuple[int, ...]] = None) -> planner.PlanSpace:
  """The choices `--plan` searches for this config (and `--replan` re-searches, with the groups pinned); with
  `num_groups` and `quotas`, those instead of the config's group choices and the quota grid (`--replan_groups`'
  candidates at 100 %: controller/group_replan.py)."""
  choices = group_choices(cfg) if num_groups is None else num_groups
  if quotas is None:
    quotas = _QUOTA_GRID if mps_active else (100,)
  return planner.PlanSpace(num_envs=cfg.sim.num_envs,
                           steps_per_iteration=cfg.env_steps_per_iteration // cfg.sim.num_envs,
                           num_groups=choices,
                           group_sizes=tuple(sorted({cfg.sim.num_envs // g for g in choices})),
                           quotas=quotas,
                           colocate_generation=cfg.schedule.colocate_generation,
                           quota_limit=mps_active,
                           rollout_on_gpu=not cfg.rollout_on_host,
                           sim_on_gpu=cfg.sim.backend != 'mujoco_cpu')


def _profiles(cfg: config_lib.Config,
              mps_active: bool,
              worker_env,
              cannot_win: Optional[Callable] = None,
              deadline: Optional[float] = None):
  """(profile store, its path, the calibration's record): this machine and workload's stage profiles, calibrated
  first at the quotas they lack, 100 % first, one process per quota, the store saved after each. `cannot_win(store)`
  (--schedule=auto) is asked once the store holds the 100 % profile: a reason (str) skips the lower quotas.
  `deadline` (`calibration_procs.deadline`): a process still running then is killed and the quotas left are skipped, as
  are those whose turn comes too late for a process as long as the last one. The record, as the plan's record
  keeps it: calibrated_s (None: nothing calibrated), calibration_quotas (those calibrated), calibration_process_s
  and calibration_phase_s per quota, and calibration_skipped (what was skipped and why, or None)."""
  store = load_store(cfg)
  sizes = sorted({cfg.sim.num_envs // g for g in group_choices(cfg)})
  quotas = sorted(set(cfg.resources.calibration_quotas) if mps_active else {100}, reverse=True)
  missing = [q for q in quotas if q not in calibrated_quotas(store)]
  runs, skipped = [], []

  def calibrate_at(todo):
    logging.info(
        '--plan: no stage profiles at quotas %s for this machine and workload in %s; calibrating them, '
        'group sizes %s.', todo, store.path, sizes)
    for i, q in enumerate(todo):
      timeout = calibration_procs.TIMEOUT_S
      if deadline is not None:
        left = deadline - time.time()
        why = calibration_procs.no_room(cfg, q, left, runs[-1]['process_s'] if runs else 0.0)
        if why:
          return skip(todo[i:], why)
        timeout = min(timeout, left)
      try:
        profile = calibration_procs.calibrate_quotas(cfg,
                                                     sizes, [q],
                                                     worker_env,
                                                     cfg.schedule.run_dir,
                                                     timeout_s=timeout)[0]
      except calibration_procs.CalibrationTimeout as e:
        if timeout >= calibration_procs.TIMEOUT_S:
          raise
        return skip(
            todo[i:], f'the calibration at {q} % was stopped at the calibration budget, '
            f'{calibration_procs.budget_flags(cfg)}, after {e.timeout_s:.0f} s')
      except calibration_procs.CalibrationFailed as e:  # what was calibrated is kept; the next run tries again
        return skip(todo[i:], str(e))
      calibrate.add_to_store(store, profile)
      runs.append(profile)
      store.save()  # each quota kept at once: a later budget stop or failure loses none

  def skip(todo, reason):
    skipped.append({'quotas': list(todo), 'reason': reason})
    logging.warning('calibration at quotas %s skipped: %s', list(todo), reason)
    return True

  lower = [q for q in missing if q != 100]
  if cannot_win is not None and 100 in quotas and lower:
    stopped = calibrate_at([100]) if 100 in missing else None
    reason = 'the 100 % calibration did not finish' if stopped else cannot_win(store)
    if reason:
      skip(lower, reason)
    missing = [] if reason else lower
  if missing:
    calibrate_at(missing)
  return store, store.path, {
      'calibrated_s': sum(p['process_s'] for p in runs) if runs else None,
      'calibration_quotas': [p['quota'] for p in runs],
      'calibration_process_s': {
          str(p['quota']): p['process_s'] for p in runs
      },
      'calibration_phase_s': {
          str(p['quota']): p.get('phase_s', {}) for p in runs
      },
      'calibration_skipped': ({
          'quotas': [q for s in skipped for q in s['quotas']],
          'reason': '; '.join(s['reason'] for s in skipped)
      } if skipped else None),
      'calibration_budget_s': None if deadline is None else calibration_procs.budget_s(cfg),
  }


def _apply(cfg: config_lib.Config, chosen: planner.Plan, mps_active: bool, schedule: str) -> config_lib.Config:
  """`cfg` with the plan's groups (and quotas, under MPS) and the schedule that runs it."""
  schedule_cfg = dataclasses.replace(cfg.schedule, name=schedule, num_groups=chosen.num_groups)
  resources_cfg = cfg.resources
  if mps_active:  # GPU roles only; a shared plan sets none: every process may use every SM
    quotas = {} if chosen.shared else dict(chosen.quotas)
    quotas.update({r: q for r, q in cfg.resources.quotas.items() if r == 'evaluator'})  # not planned: kept as given
    quota_text = ','.join(f'{role}={q}' for role, q in sorted(quotas.items()))
    resources_cfg = dataclasses.replace(cfg.resources, sm_quotas=quota_text)
  return dataclasses.replace(cfg, schedule=schedule_cfg, resources=resources_cfg)


# The record's fields a plan gives (`_record`), which after_trial_fused moves under record['trial']['plan'].
PLAN_FIELDS = ('num_groups', 'envs_per_group', 'quotas', 'shared', 'predicted_env_steps_per_s', 'predicted_iteration_s',
               'predicted_rollout_s', 'predicted_train_s', 'reason')


def _record(chosen: planner.Plan, mps_active: bool, store, path: str, calibration: dict) -> dict:
  plan = (chosen.num_groups, chosen.envs_per_group, chosen.quotas if mps_active and not chosen.shared else None,
          chosen.shared, chosen.env_steps_per_s, chosen.iteration_s, chosen.rollout_s, chosen.train_s, chosen.reason)
  fits = {name: store[name].fit_note for name in sorted(store)}
  return {**dict(zip(PLAN_FIELDS, plan)), 'mps': mps_active, **calibration, 'profile_store': path, 'fits': fits}


def _pinned(cfg: config_lib.Config, space: planner.PlanSpace, mps_active: bool) -> Dict[str, int]:
  return {role: q for role, q in cfg.resources.quotas.items() if role in space.roles} if mps_active else {}


def choose_generation(cfg: config_lib.Config, store, mps_active: bool, schedule: str):
  """`--plan_generation` on an MJX backend: (cfg with the chosen --colocate_generation, the record of the choice);
  otherwise (cfg, None). The hand-off is the transport the separate layout would use (config_generation.py)."""
  if not cfg.resources.plan_generation or cfg.sim.backend == 'mujoco_cpu':
    return cfg, None
  transport = config_generation.resolve_transport(cfg.schedule.generation_transport, cfg.sim.backend,
                                                  cfg.resources.platform, cuda_ipc.host_reason)
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  per_act = generation_choice.step_handoff_s(transport, cfg.group_envs, spec.obs_dim, spec.action_dim,
                                             cfg.policy.action_chunk)
  handoff = per_act / (cfg.policy.action_chunk * cfg.sim.action_repeat)  # the model's step: one env step, of K x R
  space = plan_space(cfg, mps_active)
  choice = generation_choice.choose(store, space, schedule, handoff, _pinned(cfg, space, mps_active))
  logging.info('--plan_generation chose %s', choice.reason)
  record = {
      'colocated': choice.colocate,
      'transport': '' if choice.colocate else transport,
      'predicted': choice.predicted,
      'act_handoff_s': per_act,
      'step_handoff_s': handoff,
      'reason': choice.reason
  }
  try:
    chosen = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, colocate_generation=choice.colocate))
  except ValueError as e:  # another flag needs co-located generation (e.g. --deterministic)
    record.update(colocated=True, transport='', reason=f'co-located: {e} (the model preferred: {choice.reason})')
    chosen = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, colocate_generation=True))
  return chosen, record


def plan_run(cfg: config_lib.Config,
             mps_active: bool,
             worker_env,
             deadline: Optional[float] = None) -> Tuple[config_lib.Config, dict]:
  """The config the run goes on with, and the record of the decision (for the log and the summary).

  `worker_env(quota)` gives the environment of a calibration process at that quota (MPS pipe, memory share);
  `deadline` the calibration's (`calibration_procs.deadline`). With no quota calibrated by then there is nothing to plan
  from: an error naming the budget.
  """
  store, path, calibration = _profiles(cfg, mps_active, worker_env, deadline=deadline)
  if not calibrated_quotas(store):
    raise errors.RunError(f'--plan: no stage profile could be calibrated '
                          f'({calibration["calibration_skipped"]["reason"]}); where the budget stopped it, raise '
                          '--calibration_budget_s (or --max_wall_s) or run once without a budget to fill the '
                          f'profile store {path}; where a process failed, mend what its log names.')
  schedule = 'async' if cfg.schedule.name == 'async' else 'sync'  # overlap plans as sync (its semantics)
  cfg, generation = choose_generation(cfg, store, mps_active, schedule)
  space = plan_space(cfg, mps_active)
  chosen = planner.plan(store, space, schedule, _pinned(cfg, space, mps_active))
  fused_like = planner.evaluate(store, space, 1, {r: 100 for r in space.roles}, 'sync') if not mps_active else None
  logging.info('--plan chose %s', chosen.reason)
  if not mps_active:
    logging.warning('--plan without MPS: only the number of groups is chosen; the processes time-slice the GPU, '
                    'and the prediction adds up their GPU work.')
  record = _record(chosen, mps_active, store, path, calibration)
  if fused_like is not None:
    record['predicted_sequential_env_steps_per_s'] = fused_like.env_steps_per_s
  if generation is not None:
    record['generation'] = generation
  return _apply(cfg, chosen, mps_active, cfg.schedule.name), record


# The host's copy bandwidth through the shared-memory parameter store, publish to a reader's copy, measured on the
# H200 host (experiments/results/transport_h200_host.json: 2.2-2.4 GB/s for 4 MB and 400 MB): `--schedule=auto`'s
# estimate of a process schedule's hand-off per iteration.
HOST_COPY_BYTES_PER_S = 2.3e9


def handoff_s(segment_bytes_per_iteration: int, param_bytes: int) -> float:
  """Seconds per iteration the process schedules spend handing data over: every segment through shared memory,
  the new parameters published and read back (each a copy at the host's bandwidth)."""
  return (segment_bytes_per_iteration + 2 * param_bytes) / HOST_COPY_BYTES_PER_S


def plan_auto(cfg: config_lib.Config,
              mps_active: bool,
              worker_env,
              handoff: float,
              deadline: Optional[float] = None) -> Tuple[config_lib.Config, dict]:
  """`--schedule=auto`: the config with the chosen schedule (fused, or sync/async with the planned groups and
  quotas) and the record of the choice (`schedule_choice`'s predictions and reason, plus the plan's figures).
  `deadline`: the calibration's (`calibration_procs.deadline`); with no quota calibrated by then, fused (the sequential
  baseline needs no profile), the reason recorded."""
  store, path, calibration = _profiles(cfg, mps_active, worker_env,
                                       functools.partial(_cannot_win, cfg, mps_active, handoff), deadline)
  if calibrated_quotas(store):
    cfg, generation = choose_generation(cfg, store, mps_active, 'async')
    space = plan_space(cfg, mps_active)
    choice = schedule_choice.choose(store, space, handoff, _pinned(cfg, space, mps_active))
    if choice.plan is None and mps_active and cfg.resources.auto_trial_s:  # the model's bounds straddle fused
      probe = schedule_choice.uncertain(store, space, handoff)
      if probe is not None:
        choice = probe._replace(predicted=choice.predicted, reason=f'{probe.reason} ({choice.reason})')
  else:  # nothing to predict from: the sequential baseline needs no profile
    generation = None
    choice = schedule_choice.Choice(
        'fused', None, {}, f'fused: no stage profile to choose from ({calibration["calibration_skipped"]["reason"]}); '
        'the profiles calibrated so far are kept for the next run')
  logging.info('--schedule=auto chose %s', choice.reason)
  if choice.plan is None:
    chosen_cfg, dropped = as_fused(cfg)
    record = {'profile_store': path, **calibration, 'mps': mps_active, 'dropped': dropped}
  else:
    chosen_cfg = _apply(cfg, choice.plan, mps_active, choice.schedule)
    record = _record(choice.plan, mps_active, store, path, calibration)
  record.update(schedule=choice.schedule, predicted=choice.predicted, choice_reason=choice.reason, handoff_s=handoff)
  if generation is not None:
    record['generation'] = generation
  if choice.plan is None or not cfg.resources.auto_trial_s:
    return chosen_cfg, record
  layout, trials = auto_trial.key(chosen_cfg), auto_trial.path_for(path)
  kept = auto_trial.load(trials).get(layout)
  if kept is None:  # controller/auto.py runs the trial
    record['trial'] = {'layout': layout, 'path': trials, 'pending': True}
    return chosen_cfg, record
  keep, why = auto_trial.verdict(kept)
  record['trial'] = {**kept, 'path': trials, 'pending': False, 'kept': keep, 'verdict': why}
  logging.info('--schedule=auto: a trial kept in %s: %s', trials, why)
  return (chosen_cfg, record) if keep else after_trial_fused(cfg, record, why)


def after_trial_fused(cfg: config_lib.Config, record: dict, why: str) -> Tuple[config_lib.Config, dict]:
  """`--schedule=auto` goes on as fused after a trial of its process schedule (auto_trial.verdict): `cfg` (auto's
  own) as fused, and the record with the plan's figures moved under record['trial']['plan']."""
  chosen_cfg, dropped = as_fused(cfg)
  plan = {k: record.pop(k) for k in PLAN_FIELDS if k in record}
  trial = dict(record.pop('trial', {}), plan=plan, kept=False, verdict=why)
  return chosen_cfg, dict(record, schedule='fused', choice_reason=why, dropped=dropped, trial=trial)


def as_fused(cfg: config_lib.Config) -> Tuple[config_lib.Config, List[str]]:
  """`--schedule=auto` chose fused: the config as fused, without `--plan` (it plans the process schedules' groups
  and quotas; fused refuses it), and the flags dropped, which the choice's record keeps and the log says. The
  other process-only flags (`--slack_quotas`, `--replan`, `--quota_schedule`) are refused with auto up front."""
  dropped = ['--plan'] if cfg.resources.plan else []
  if dropped:
    logging.info('--schedule=auto chose fused: %s applies only to a process schedule; dropped.', dropped[0])
  resources = dataclasses.replace(cfg.resources, plan=False)
  schedule = dataclasses.replace(cfg.schedule, name='fused', env_slices=1)
  return dataclasses.replace(cfg, schedule=schedule, resources=resources), dropped


def _cannot_win(cfg: config_lib.Config, mps_active: bool, handoff: float, store) -> Optional[str]:
  """Why no SM quota can make a process schedule beat fused (`schedule_choice.quotas_cannot_win`) in any layout
  `--schedule=auto` may pick (with --plan_generation on MJX, co-located and separate generation), else None."""
  spaces = [plan_space(cfg, mps_active)]
  if cfg.resources.plan_generation and cfg.sim.backend != 'mujoco_cpu':
    try:
      other = dataclasses.replace(cfg.schedule, colocate_generation=not cfg.schedule.colocate_generation)
      spaces.append(plan_space(dataclasses.replace(cfg, schedule=other), mps_active))
    except ValueError:  # another flag needs co-located generation (choose_generation falls back the same way)
      pass
  reasons = [schedule_choice.quotas_cannot_win(store, space, handoff) for space in spaces]
  return None if any(r is None for r in reasons) else '; '.join(reasons)
