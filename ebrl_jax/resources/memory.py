"""GPU memory plan for the process schedules: each worker process gets an explicit budget, not an equal share.

Footprint of a role's process in device bytes, from shapes alone (`jax.eval_shape`, `jax.make_jaxpr`: nothing is
computed, and the controller starts no accelerator client):
  trainer     train_state (params and Adam's two moments) + gradients (gradients and updates: twice the network
              params) + batch (the iteration's [T, S] batch twice: as collected and shuffled into minibatches,
              plus four [T, S] float arrays: proximal log-probs, values, advantages, targets)
              + activations (one minibatch's (T + 1) x S / M rows, each with what the forward pass keeps for the
              backward pass and two of its largest intermediates; or, if larger, the proximal forward pass over
              all T x S rows with two of its largest intermediates live at a time)
              + evaluation (the eval envs' observations and act; MJX: their env state, twice: scan carry in, out).
  rollout     params (the current version and the incoming one: 2x) + act (the group's E observations and two
              of the largest intermediates per row) + MJX: env_state (the group's, twice) and segment (its
              [T, U x E] share of the iteration); native MuJoCo keeps envs and segments in host memory; with a
              separate generation worker the rollout worker has nothing on the device.
  generation  params (2x) + act on every group's envs at once (the largest batch it forms).
Per-row sizes come from `generation.stages.evaluate` traced at 8 and at 4 rows, differenced (weight-sized values
drop out): the residuals `jax.vjp` keeps, and the largest single intermediate. MJX env state is traced in a child
process (see `mjx_state_bytes`). A calibration JSON (`--memory_profile`, experiments/bench/stage_profile.py)
raises a footprint to its measured peak where that is larger.

A run that can change the rollout quota live (--quota_schedule, --replan) plans one 'standby/<g>' per group
beside its rollout workers: a quota change starts each group's warm standby while the old worker still runs
(controller/replan.py), so for a while both hold a context and a pool; the standby's budget is the rollout's.

The plan: budget = max(footprint x --memory_headroom, MIN_POOL_BYTES), or --memory_fractions x the device's
memory for a role fixed by hand; fraction = budget / device memory (NVML's total of the GPU the workers see). It
fits when the budgets plus CONTEXT_BYTES per process are at most PLAN_CAP of the device, else `ValueError`
before any worker starts. A worker gets `XLA_PYTHON_CLIENT_MEM_FRACTION` (only that name, never the older
`XLA_CLIENT_MEM_FRACTION` beside it) and, under MPS, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` ('0=<N>M') at its
budget plus its context allowance: that limit caps every device allocation of the client, XLA's pool and the
rest. Without a GPU (or with --platform=cpu) there is no plan: each process gets an equal share of EQUAL_SHARE
(with --memory_fractions for the roles it names).
"""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import pynvml

from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.resources import telemetry
from ebrl_jax.trainer import stages as trainer_stages

MIB = 2**20
# Device memory a process needs outside XLA's pool: the CUDA context, the loaded modules of its compiled programs,
# cuBLAS/cuBLASLt handles and workspaces. Under MPS the pinned limit caps these too, and a few hundred MiB are not
# enough for a trainer's cuBLASLt or a generation worker's modules (experiments/results/README.md).
CONTEXT_BYTES = 3072 * MIB
PLAN_CAP = 0.95  # the plan may take this much of the device, contexts included
MIN_POOL_BYTES = 1024 * MIB  # XLA's pool is never planned smaller (autotuning scratch, small programs)
EQUAL_SHARE = 0.9  # without a plan: this much of the device split equally (JAX would take 75 % per process)
FRACTION_VAR = 'XLA_PYTHON_CLIENT_MEM_FRACTION'
MPS_LIMIT_VAR = 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'


class Footprint(NamedTuple):
  """Estimated device bytes of one role's process by part (see the module doc), and a measured peak if any."""
  parts: Dict[str, int]
  measured: Optional[int] = None

  @property
  def estimate(self) -> int:
    return sum(self.parts.values())

  @property
  def total(self) -> int:
    return max(self.estimate, self.measured or 0)

  @property
  def source(self) -> str:
    return 'measured' if (self.measured or 0) > self.estimate else 'estimate'


class RoleBudget(NamedTuple):
  """One process's plan: footprint and budget in bytes (None without a plan), its memory fraction, and where the
  budget came from ('estimate', 'measured', '--memory_fractions' or 'equal share')."""
  footprint: Optional[int]
  budget: Optional[int]
  fraction: float
  source: str


class MemoryPlan(NamedTuple):
  """Budgets of every worker process (role -> RoleBudget); `device_total` None means no plan (see `note`)."""
  roles: Dict[str, RoleBudget]
  device_total: Optional[int]
  headroom: float
  note: str = ''

  def worker_env(self, role: str, mps_active: bool) -> Dict[str, str]:
    """The variables that bound `role`'s device memory (the MPS limit only under an active MPS daemon)."""
    b = self.roles[role]
    env = {FRACTION_VAR: f'{b.fraction:.4f}'}
    if mps_active and b.budget is not None:
      env[MPS_LIMIT_VAR] = f'0={(b.budget + CONTEXT_BYTES) // MIB}M'  # device 0: the one GPU a worker sees
    return env

  def summary(self) -> dict:
    """JSON-able plan for the run summary's extra (MiB, rounded)."""
    mib = lambda b: None if b is None else round(b / MIB, 1)
    return {
        'device_total_mib': mib(self.device_total),
        'headroom': self.headroom,
        'cap': PLAN_CAP,
        'context_mib': mib(CONTEXT_BYTES),
        'note': self.note,
        'roles': {
            r: {
                'footprint_mib': mib(b.footprint),
                'budget_mib': mib(b.budget),
                'fraction': round(b.fraction, 4),
                'source': b.source
            } for r, b in self.roles.items()
        }
    }

  def log(self) -> None:
    if self.device_total is None:
      logging.info('GPU memory: no plan (%s); fractions of the device: %s.', self.note,
                   ', '.join(f'{role} {b.fraction:.3f} ({b.source})' for role, b in self.roles.items()))
      return
    logging.info('GPU memory plan on %.0f MiB (headroom %.2f, %d MiB context per process):', self.device_total / MIB,
                 self.headroom, CONTEXT_BYTES // MIB)
    for role, b in self.roles.items():
      logging.info('  %-12s footprint %9.1f MiB  budget %9.1f MiB  fraction %.4f  (%s)', role, b.footprint / MIB,
                   b.budget / MIB, b.fraction, b.source)


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
  return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def _transition_bytes(t: int, s: int, obs_dim: int, k: int, action_dim: int, pixel_shape: Tuple[int, ...] = ()) -> int:
  """Bytes of a `types.Transition` of [T, S] segments (its one definition, `types.transition_template`; camera
  pixels included, as uint8, with `pixel_shape`)."""
  return tree_bytes(types.transition_template(t, s, obs_dim, k, action_dim, pixel_shape))


def _value_sizes(jaxpr) -> List[int]:
  """Bytes of every value an equation of `jaxpr` (and of the jaxprs nested in it) produces, in order."""
  out = []
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      aval = v.aval
      if hasattr(aval, 'shape') and hasattr(aval.dtype, 'itemsize'):
        out.append(math.prod(aval.shape) * aval.dtype.itemsize)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, 'jaxpr', sub)  # a ClosedJaxpr holds its Jaxpr
        if hasattr(inner, 'eqns'):
          out.extend(_value_sizes(inner))
  return out


def row_bytes(network, params, obs_dim: int, k: int, action_dim: int, pixel_shape=()) -> Tuple[int, int]:
  """(saved, largest): bytes per observation row that the forward pass (`generation.stages.evaluate`) keeps for
  its backward pass (the residuals `jax.vjp` holds), and of its largest single intermediate value. Each is the
  difference between traces of 8 and of 4 rows, over 4, so weight-sized values drop out. `pixel_shape` [H, W, C]:
  rows are camera observations (`types.PixelObs`)."""

  def loss(network_params, p, obs, raw):
    out = gen_stages.evaluate(network, p.replace(network=network_params), obs, raw, jax.random.PRNGKey(0))
    return sum(jnp.sum(x) for x in out)

  def residuals(p, obs, raw):
    return jax.vjp(lambda n: loss(n, p, obs, raw), p.network)[1]

  def measure(rows: int):
    obs = types.obs_template((rows,), obs_dim, pixel_shape)
    raw = jax.ShapeDtypeStruct((rows, k, action_dim), 'float32')
    return (tree_bytes(jax.eval_shape(residuals, params, obs,
                                      raw)), _value_sizes(jax.make_jaxpr(loss)(params.network, params, obs, raw).jaxpr))

  (saved4, values4), (saved8, values8) = measure(4), measure(8)
  if len(values4) == len(values8):
    largest = max([0] + [b - a for a, b in zip(values4, values8)]) // 4
  else:  # the two traces differ in structure: the 8-row trace's largest value, per row
    largest = max([0] + values8) // 8
  return max(0, saved8 - saved4) // 4, largest


_MJX_STATE_PROBE = '''
import json, sys
import jax
from ebrl_jax.resources import memory
from ebrl_jax.sim import stages
task, length, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {}
for auto_reset in (True, False):
  env = stages.make_mjx_env(task, length, repeat, auto_reset=auto_reset)
  one, two = (memory.tree_bytes(jax.eval_shape(lambda: stages.reset(env, jax.random.PRNGKey(0), n))) for n in (1, 2))
  out[str(auto_reset)] = [two - one, 2 * one - two]
print(json.dumps(out))
'''


@functools.lru_cache(maxsize=None)
def mjx_state_bytes(task: str, episode_length: int, action_repeat: int) -> Dict[bool, Tuple[int, int]]:
  """{auto_reset: (bytes per env, fixed bytes)} of MJX envs' state (`sim.stages.reset`'s output shapes), traced
  in a child process on the CPU platform.

  NOTE: building an MJX env puts its model on the default device. In the controller that would start a GPU
  client, and JAX's client preallocates most of the GPU before any worker has started.
  """
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ,
             JAX_PLATFORMS='cpu',
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get('PYTHONPATH')])))
  try:
    out = subprocess.run(
        [sys.executable, '-c', _MJX_STATE_PROBE, task,
         str(episode_length), str(action_repeat)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
    detail = (getattr(e, 'stderr', '') or '')[-500:]
    raise ValueError(f'the memory plan could not trace the MJX env state of --task={task}: {e} {detail}; set '
                     '--memory_fractions by hand to run without planned budgets.') from None
  return {key == 'True': (int(per_env), int(fixed)) for key, (per_env, fixed) in data.items()}


def footprints(cfg, spec, profile: Optional[dict] = None) -> Dict[str, Footprint]:
  """Footprint of one process of each role of `cfg`'s process schedule ('trainer', 'rollout', 'generation' with a
  separate generation worker, 'evaluator' with --evaluator=process), from shapes; a calibration `profile`'s
  measured peaks raise them."""
  o, a, k, px = spec.obs_dim, spec.action_dim, cfg.policy.action_chunk, spec.pixel_shape
  network = policies.make_network(cfg.policy, o, a, px)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  state = jax.eval_shape(lambda: trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), o, cfg.
                                                                 policy.normalize_observations, px))
  params = tree_bytes(state.params)
  saved_row, largest_row = row_bytes(network, state.params, o, k, a, px)
  obs_row = tree_bytes(types.obs_template((1,), o, px))  # one observation: its state, and its uint8 pixels
  unrolls, t = cfg.segment_shape
  s = unrolls * cfg.sim.num_envs
  train_rows = (t + 1) * s // cfg.algo.num_minibatches
  act = lambda rows: rows * (obs_row + 2 * largest_row)  # observations in, two largest intermediates live
  if cfg.sim.backend != 'mujoco_cpu':  # MJX-Warp's state is estimated from MJX-JAX's (no GPU needed)
    per_env = mjx_state_bytes(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
    stacks = math.prod(px) if px else 0  # --obs=pixels on mjx_warp: each env's uint8 frame stack is in its state
    envs = lambda n, auto_reset: 2 * ((per_env[auto_reset][0] + stacks) * n + per_env[auto_reset][1])  # carry in, out
    evaluation = envs(cfg.sim.num_eval_envs, False) + act(cfg.sim.num_eval_envs)
  else:
    envs, evaluation = None, act(cfg.sim.num_eval_envs)
  trainer = {
      'train_state': tree_bytes(state),
      'gradients': 2 * tree_bytes(state.params.network),
      'batch': 2 * _transition_bytes(t, s, o, k, a, px) + 4 * 4 * t * s,
      'activations': max(train_rows * (saved_row + 2 * largest_row), 2 * largest_row * t * s),
      'evaluation': evaluation
  }
  e = cfg.group_envs
  if not cfg.schedule.colocate_generation and envs is None:
    rollout = {}  # native MuJoCo served by a generation worker: no GPU context
  elif envs is not None:  # MJX: a served group holds its envs and segment buffers, not the policy
    rollout = {
        'params': 2 * params,
        'act': act(e),
        'env_state': envs(e, not cfg.algo.episodic),
        'segment': _transition_bytes(t, unrolls * e, o, k, a, px)
    }
    if not cfg.schedule.colocate_generation:
      rollout = {name: rollout[name] for name in ('env_state', 'segment')}
  else:
    rollout = {'params': 2 * params, 'act': act(e)}
  out = {'trainer': trainer, 'rollout': rollout}
  if not cfg.schedule.colocate_generation:
    out['generation'] = {'params': 2 * params, 'act': act(cfg.sim.num_envs)}
  if cfg.evaluator_process:  # the evaluation moves out of the trainer into a process of its own
    out['evaluator'] = {'params': params, 'evaluation': trainer.pop('evaluation')}
  measured = measured_peaks(profile, cfg, policies.count_params(state.params.network)) if profile else {}
  return {role: Footprint(parts, measured.get(role)) for role, parts in out.items()}


def measured_peaks(profile: dict, cfg, num_params: int) -> Dict[str, int]:
  """Measured peaks (role -> bytes) a calibration JSON (`calibrate.profile_stages`) holds for this run's
  workload; a profile of another workload (backend, policy size, iteration size) gives none, with a warning."""
  same = {'backend': cfg.sim.backend, 'num_params': num_params, 'steps_per_iteration': cfg.env_steps_per_iteration}
  differ = [f'{key} {profile.get(key)} vs {want}' for key, want in same.items() if profile.get(key) != want]
  if differ:
    logging.warning(
        '--memory_profile was measured on another workload (%s: profile vs this run); the plan uses '
        'estimates only.', ', '.join(differ))
    return {}
  out = {}
  if profile.get('train', {}).get('peak_bytes_in_use'):
    out['trainer'] = int(profile['train']['peak_bytes_in_use'])
  group = profile.get('groups', {}).get(str(cfg.group_envs), {})
  if cfg.schedule.colocate_generation and group.get('peak_bytes_in_use'):  # sim and generation in one process
    out['rollout'] = int(group['peak_bytes_in_use'])
  return out


def _no_fit(roles: Mapping[str, RoleBudget], device_total: Optional[int], cfg) -> str:
  r, s = cfg.resources, cfg.sim
  if device_total is None:
    listed = '; '.join(f'{role} {b.fraction:.3f}' for role, b in roles.items())
    return (f'--memory_fractions={r.memory_fractions}: the processes\' fractions ({listed}) sum to '
            f'{sum(b.fraction for b in roles.values()):.3f}, more than {PLAN_CAP} of the GPU.')
  listed = '; '.join(f'{role}: footprint {b.footprint / MIB:.0f} MiB -> budget {b.budget / MIB:.0f} MiB ({b.source})'
                     for role, b in roles.items())
  used = sum(b.budget for b in roles.values()) + len(roles) * CONTEXT_BYTES
  standbys = sum(role.startswith('standby/') for role in roles)
  why_standby = (f' (the {standbys} standby roles are the warm standbys that --quota_schedule / --replan start '
                 f'beside the rollout workers: without live quota changes they are not planned)') if standbys else ''
  return (f'The GPU memory plan does not fit{why_standby}: {listed}; plus {len(roles)} CUDA contexts x '
          f'{CONTEXT_BYTES // MIB} '
          f'MiB: {used / MIB:.0f} MiB in all, more than {PLAN_CAP:.0%} of the device\'s {device_total / MIB:.0f} '
          f'MiB ({PLAN_CAP * device_total / MIB:.0f} MiB). Shrink the largest: the rollouts with --num_envs (now '
          f'{s.num_envs}) or fewer --num_groups (now {cfg.schedule.num_groups}), the trainer with --batch_size '
          f'(now {cfg.algo.batch_size}) x --num_minibatches (now {cfg.algo.num_minibatches}); or lower '
          f'--memory_headroom (now {r.memory_headroom}) or fix fractions with --memory_fractions (now '
          f'{r.memory_fractions!r}).')


def make_plan(cfg,
              processes: Sequence[str],
              device_total: Optional[int],
              role_footprints: Optional[Mapping[str, Footprint]] = None) -> MemoryPlan:
  """Budgets of `processes` (roles like 'trainer', 'rollout/0'); raises ValueError naming every footprint, the
  device total and the flags to change when they do not fit. `device_total` None: the equal share (no plan)."""
  fixed, headroom = cfg.resources.fractions, cfg.resources.memory_headroom
  roles: Dict[str, RoleBudget] = {}
  for role in processes:
    kind = role.split('/')[0]
    kind = 'rollout' if kind == 'standby' else kind  # a warm standby is its group's next rollout worker
    if device_total is None:
      roles[role] = RoleBudget(None, None, fixed.get(kind, EQUAL_SHARE / len(processes)),
                               '--memory_fractions' if kind in fixed else 'equal share')
      continue
    fp = role_footprints[kind]
    if kind in fixed:
      budget, source = int(fixed[kind] * device_total), '--memory_fractions'
    else:
      budget, source = max(int(fp.total * headroom), MIN_POOL_BYTES), fp.source
    roles[role] = RoleBudget(fp.total, budget, budget / device_total, source)
  if device_total is None:
    fits = sum(b.fraction for b in roles.values()) <= PLAN_CAP
  else:
    fits = sum(b.budget for b in roles.values()) + len(roles) * CONTEXT_BYTES <= PLAN_CAP * device_total
  if not fits:
    raise ValueError(_no_fit(roles, device_total, cfg))
  return MemoryPlan(roles, device_total, headroom)


def device_total_bytes(device: str) -> Optional[int]:
  """NVML's total memory of GPU `device` (index or UUID, as `telemetry.visible_gpu` names it); None without NVML
  or a GPU."""
  try:
    pynvml.nvmlInit()
    try:
      return int(pynvml.nvmlDeviceGetMemoryInfo(telemetry.nvml_handle(pynvml, device)).total)
    finally:
      pynvml.nvmlShutdown()
  except Exception as e:  # pylint: disable=broad-except  (no pynvml, no driver, no such device, ...)
    logging.debug('NVML: no memory total for GPU %s: %s', device, e)
    return None


def plan_for_run(cfg, spec, processes: Sequence[str]) -> MemoryPlan:
  """The run's plan: budgets from footprints on the GPU the workers will see, or the equal share without one."""
  if cfg.resources.platform == 'cpu':
    total, note = None, '--platform=cpu'
  else:
    device = telemetry.visible_gpu()
    total = device_total_bytes(device)
    note = '' if total is not None else f'NVML sees no GPU {device}'
  if total is None:
    return make_plan(cfg, processes, None)._replace(note=note)
  profile = None
  if cfg.resources.memory_profile:
    try:
      with open(cfg.resources.memory_profile) as f:
        profile = json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f'--memory_profile={cfg.resources.memory_profile} cannot be read: {e}') from None
  return make_plan(cfg, processes, total, footprints(cfg, spec, profile))
