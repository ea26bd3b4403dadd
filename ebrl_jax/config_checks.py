"""Validation helpers shared by the config dataclasses: each error is a `ValueError` naming the field as its flag
and what is allowed."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple


def check_choice(field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f'--{field}={value!r} is not valid; allowed values: {", ".join(map(str, allowed))}.')


def check_positive(field: str, value, allow_zero: bool = False) -> None:
  if isinstance(value, float) and not math.isfinite(value):  # nan fails the comparison; inf would pass it
    raise ValueError(f'--{field}={value!r} must be a finite number.')
  ok = value >= 0 if allow_zero else value > 0
  if not ok:
    bound = '>= 0' if allow_zero else '> 0'
    raise ValueError(f'--{field}={value!r} must be {bound}.')


# The seeds a run accepts: JAX (without x64) keeps a seed's low 32 bits, so 2**32 would draw seed 0's numbers and
# -1 seed 2**32 - 1's; numpy's SeedSequence (the native pools' seeds, `rollout.keys.env_seed`) takes no negative.
MAX_SEED = 2**32 - 1


def check_seed(seed: int, field: str = 'seed') -> None:
  if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
    raise ValueError(f'--{field}={seed!r} must be an integer in [0, {MAX_SEED}] (2**32 - 1): JAX keeps only a '
                     'seed\'s low 32 bits (a larger one would repeat a smaller one\'s numbers) and numpy\'s seeds '
                     'are >= 0.')


# MJX (Brax's EpisodeWrapper) counts an episode's env steps in float32, exact only up to 2**24, and the native pools
# report episode lengths in int32: an --episode_length beyond it never ends (or overflows). No task runs near it.
MAX_EPISODE_LENGTH = 2**24


def check_episode_length(sim) -> None:
  """--episode_length and --action_repeat (`sim` a `config.SimConfig`) within `MAX_EPISODE_LENGTH`."""
  for field in ('episode_length', 'action_repeat'):
    if getattr(sim, field) > MAX_EPISODE_LENGTH:
      raise ValueError(f'--{field}={getattr(sim, field)} must be <= {MAX_EPISODE_LENGTH} (2**24): MJX counts an '
                       'episode\'s env steps in float32, exact only that far, and the native pools report them in '
                       'int32.')


def default_of(config, field: str):
  return next(f.default for f in dataclasses.fields(config) if f.name == field)


def no_effect(cfg) -> List[str]:
  """The flags of a `Config` set away from their defaults that its run does not read, where they are harmless and
  a run may still carry them (a flagfile shared by several schedules, `experiments.bench.stage_profile` reading
  --num_groups beside a fused flagfile): one warning line each. Flags that cannot take effect and that nothing else
  reads are errors instead (their checks)."""
  schedule, out = cfg.schedule, []
  if schedule.name == 'fused' and schedule.num_groups != default_of(schedule, 'num_groups'):
    out.append(f'--num_groups={schedule.num_groups} has no effect with --schedule=fused (one program steps every '
               'env); it sizes the env groups of the process schedules.')
  if cfg.algo.episodic:
    for field, what in GRPO_UNREAD:
      value = getattr(cfg.algo, field)
      if value != default_of(cfg.algo, field):
        out.append(f'--{field}={value} has no effect with --algo=grpo, which {what}; it is read by --algo=ppo.')
  return out


# PPO's flags that GRPO's training does not read (a flagfile written for PPO may carry them into a GRPO run), with
# why. --unroll_length is not among them: GRPO's calibrations time unrolls of its length
# (resources.calibrate.timed_unroll_steps).
GRPO_UNREAD = (
    ('discount', 'scores each episode by its undiscounted return'),
    ('gae_lambda', 'estimates no advantages from a critic'),
    ('reward_scaling', 'normalises returns within each group'),
    ('normalize_advantage', 'normalises returns within each group'),
    ('batch_size', 'collects one whole episode per env and splits the envs into --num_minibatches'),
)


def check_range(field: str, value: float, lo: float, hi: float) -> None:
  if not lo <= value <= hi:
    raise ValueError(f'--{field}={value!r} must lie in [{lo}, {hi}].')


def check_playground_sim(sim, prefix: str) -> None:
  """A `playground:` task (`sim` a `config.SimConfig`): an env named, on an MJX backend."""
  if not sim.task[len(prefix):]:
    raise ValueError(f'--task={sim.task} must name a Playground env, e.g. --task=playground:CartpoleBalance.')
  if sim.backend == 'mujoco_cpu':
    raise ValueError(f'--task={sim.task} is a MuJoCo Playground env, which runs on MJX: it needs --backend=mjx '
                     'or --backend=mjx_warp (got --backend=mujoco_cpu).')


def check_solver_caps(sim, prefix: str) -> None:
  """--solver_iterations / --ls_iterations (MjOption `iterations` / `ls_iterations` of the task's model, on every
  backend; 0 keeps the task's: Brax's 1 / 4 for ant and humanoid, MuJoCo's 100 / 50 for the others). MJX 3.17 runs
  its solver as a loop until every env of the batch has converged or reached the cap, and its linesearch as a scan
  of `ls_iterations` steps that every env computes: the caps bound both. Playground envs set their own."""
  check_positive('solver_iterations', sim.solver_iterations, allow_zero=True)
  check_positive('ls_iterations', sim.ls_iterations, allow_zero=True)
  if (sim.solver_iterations or sim.ls_iterations) and sim.task.startswith(prefix):
    raise ValueError(f'--solver_iterations / --ls_iterations apply to the project\'s own tasks, not --task={sim.task} '
                     '(a Playground env takes its solver options from its own config).')


def parse_group_schedule(text: str):
  """'iteration:groups=G,...' -> ((iteration, G), ...) in iteration order; errors name --group_schedule."""
  out = []
  for item in filter(None, (p.strip() for p in text.split(','))):
    when, _, change = item.partition(':')
    key, _, value = change.partition('=')
    try:
      iteration, groups = int(when), int(value)
    except ValueError:
      raise ValueError(f'--group_schedule: {item!r} must read iteration:groups=G, e.g. 10:groups=4.') from None
    if key != 'groups' or iteration < 1 or groups < 1:
      raise ValueError(f'--group_schedule: {item!r} must read iteration:groups=G with iteration >= 1 and G >= 1.')
    out.append((iteration, groups))
  if len({i for i, _ in out}) != len(out):
    raise ValueError(f'--group_schedule={text}: two changes at one iteration.')
  return tuple(sorted(out))


def _live_quota_changes(resources) -> list:
  """The flags of a `ResourceConfig` that change the rollout workers' quota during the run, as given."""
  return [f'--{name}' for name in ('quota_schedule', 'replan', 'slack_quotas') if getattr(resources, name)]


def check_host_rollout_quotas(cfg) -> None:
  """A `Config` whose rollout workers simulate on the host (`cfg.rollout_on_host`) gives them no SM quota."""
  if not cfg.rollout_on_host:
    return
  resources = cfg.resources
  hint = ('the rollout workers simulate on CPU cores and the separate generation worker acts for them, so they hold '
          'no GPU context and have no SM quota')
  if 'rollout' in resources.quotas:
    raise ValueError(f'--sm_quotas={resources.sm_quotas} gives the rollout workers a quota, but {hint}; give '
                     '--sm_quotas=generation=...,trainer=... instead.')
  if _live_quota_changes(resources):
    raise ValueError(f'--quota_schedule / --replan / --slack_quotas change the rollout workers\' quota, but {hint}.')


def check_schedule_options(cfg) -> None:
  """`--plan`, `--quota_schedule`, `--slack_quotas` (process schedules only), `--schedule=auto`, `--deterministic`,
  `--group_schedule` and `--replan_groups` of a `Config` against what they cannot be combined with."""
  schedule, resources = cfg.schedule, cfg.resources
  if schedule.target_return is not None and not math.isfinite(schedule.target_return):
    raise ValueError(f'--target_return={schedule.target_return!r} must be a finite number (leave it unset for none).')
  if resources.plan and schedule.name == 'fused':
    raise ValueError('--plan chooses env groups and SM quotas for the process schedules; it needs --schedule=sync or '
                     '--schedule=async (or --schedule=overlap).')
  if resources.quota_schedule and schedule.name == 'fused':
    raise ValueError(f'--quota_schedule={resources.quota_schedule} swaps rollout workers; it needs --schedule=sync or '
                     '--schedule=async (or --schedule=overlap).')
  if resources.slack_quotas and schedule.name == 'fused':
    raise ValueError('--slack_quotas changes the rollout workers\' quota; it needs a process schedule (sync, async or '
                     'overlap).')
  if schedule.relaid:
    _check_group_schedule(cfg)
  if schedule.name == 'auto':
    live = _live_quota_changes(resources) + (['--group_schedule'] if schedule.group_schedule else [])
    if live:
      raise ValueError(f'--schedule=auto cannot be combined with {" / ".join(live)}: they change a process '
                       'schedule\'s quotas during the run, and auto may choose fused; choose the schedule yourself '
                       'to use them.')
  if schedule.deterministic:
    _check_deterministic(schedule, resources)


def _check_group_schedule(cfg) -> None:
  """--group_schedule and --replan_groups (live env-group changes, controller/relayout.py)."""
  schedule, text = cfg.schedule, f'--group_schedule={cfg.schedule.group_schedule}'
  if schedule.replan_groups:
    text = f'--replan_groups={",".join(map(str, schedule.replan_groups))}'
    if schedule.group_changes:
      raise ValueError(f'{text} and --group_schedule={schedule.group_schedule} both change the env groups during '
                       'the run; give one.')
    if any(g < 1 for g in schedule.replan_groups):
      raise ValueError(f'{text}: every group count must be >= 1.')
  if schedule.name not in ('sync', 'async'):
    raise ValueError(f'{text} changes the env groups of a process schedule; it needs --schedule=sync or async (got '
                     f'--schedule={schedule.name}).')
  if not schedule.colocate_generation:
    raise ValueError(f'{text} needs --colocate_generation: a separate generation worker serves a fixed set of '
                     'groups and slices.')
  live = _live_quota_changes(cfg.resources)
  if live or schedule.deterministic:
    raise ValueError(f'{text} cannot be combined with {" / ".join(live) or "--deterministic"}: one live change '
                     'of the rollout workers at a time (and --deterministic leaves nothing to timing).')
  blocks, n = schedule.block_count, cfg.sim.num_envs
  if n % blocks or (n // blocks) % cfg.sim.group_size:
    raise ValueError(f'{text} with --num_groups={schedule.num_groups}: every layout\'s groups must hold whole blocks '
                     f'of --num_envs={n} / {blocks} (the lcm of the group counts) envs, each whole GRPO groups of '
                     f'--group_size={cfg.sim.group_size}.')
  sizes = sorted({n // g for g in (*schedule.replan_groups, schedule.num_groups)})
  if schedule.replan_groups and any(e & (e - 1) for e in sizes):
    raise ValueError(f'{text} with --num_groups={schedule.num_groups}: the planner\'s model (like --plan\'s) '
                     f'predicts power-of-two group sizes; --num_envs={n} gives sizes {sizes}.')


def _check_deterministic(schedule, resources) -> None:
  """`--deterministic` against what would let timing decide the run anyway. Deterministic: each group's iteration i
  acts with exactly version max(0, i - bound) (bound: --max_staleness for async, 0 for sync) and the trainer's
  iteration v trains on every group's iteration v in group order, so two runs with one seed give the same curve
  (on CPU; GPU reductions may still differ)."""
  if schedule.name not in ('sync', 'async'):
    raise ValueError(f'--deterministic fixes what the process schedules leave to timing; it needs --schedule=sync '
                     f'or async (got --schedule={schedule.name}: fused and overlap are repeatable as they are).')
  if not schedule.colocate_generation:
    raise ValueError('--deterministic needs --colocate_generation: a separate generation worker batches whichever '
                     'requests are ready, so its batches (and their keys) depend on timing.')
  live = _live_quota_changes(resources)
  if live:
    raise ValueError(f'--deterministic cannot be combined with {" / ".join(live)}: a live quota change replaces a '
                     'rollout worker, whose replacement starts new episodes at a moment set by timing.')


def check_env_slices(cfg) -> None:
  """`--env_slices` of a `Config` against the schedule, the generation layout and the group size."""
  slices = cfg.schedule.env_slices
  if slices == 1:
    return
  if (cfg.schedule.name == 'fused' or cfg.schedule.colocate_generation or cfg.sim.backend != 'mujoco_cpu'):
    raise ValueError(f'--env_slices={slices} splits the env groups that a separate generation worker serves: '
                     'it needs --schedule=sync or async, --nocolocate_generation and --backend=mujoco_cpu '
                     f'(got --schedule={cfg.schedule.name}, --colocate_generation='
                     f'{cfg.schedule.colocate_generation}, --backend={cfg.sim.backend}).')
  group_envs = cfg.sim.num_envs // cfg.schedule.num_groups
  if group_envs % slices:
    raise ValueError(f'--env_slices={slices} must divide the {group_envs} envs of each env group '
                     f'(--num_envs={cfg.sim.num_envs} / --num_groups={cfg.schedule.num_groups}).')


def check_grpo_run(cfg) -> None:
  """A GRPO run (`cfg` a `config.Config`): whole episodes after group resets (no critic to bootstrap from), with
  minibatches splitting the envs."""
  if cfg.sim.group_size < 2:
    raise ValueError(f'--algo=grpo needs --group_size >= 2 (got {cfg.sim.group_size}): advantages are '
                     'normalised within groups of envs that share an initial state.')
  if cfg.sim.num_envs % cfg.algo.num_minibatches:
    raise ValueError(f'--num_envs={cfg.sim.num_envs} must be a multiple of '
                     f'--num_minibatches={cfg.algo.num_minibatches} for --algo=grpo (minibatches split envs).')
  if cfg.sim.episode_length % cfg.policy.action_chunk:
    raise ValueError(f'--episode_length={cfg.sim.episode_length} must be a multiple of '
                     f'--action_chunk={cfg.policy.action_chunk} for --algo=grpo.')


def check_batch_shape(algo, t: int, s: int, k: int, rank_share: bool = False) -> None:
  """A training batch of S segments of T policy steps (K actions each) against `algo` (a `config.AlgoConfig`), as
  `trainer.stages.train_step` takes it: PPO's T x K must be --unroll_length and its S --batch_size x
  --num_minibatches (unless `rank_share`: a data-parallel rank's S is its share of the ranks' batch); every S must
  split into --num_minibatches. GRPO's T (an episode) and S (the envs) are the SimConfig's, not the algo's."""
  if not algo.episodic:
    u, segments = algo.unroll_length, algo.batch_size * algo.num_minibatches
    if t * k != u:
      raise ValueError(f'--unroll_length={u} actions a segment expects T = {u / k:g} policy steps of K={k} '
                       f'actions; the batch has T={t} ({t * k} actions): collect segments of --unroll_length.')
    if not rank_share and s != segments:
      raise ValueError(f'--batch_size={algo.batch_size} x --num_minibatches={algo.num_minibatches} expects '
                       f'S={segments} segments; the batch has S={s}.')
  if s % algo.num_minibatches:
    raise ValueError(f'the batch\'s S={s} segments do not split into --num_minibatches={algo.num_minibatches}.')


GRAD_CLIP_SCOPES = ('global', 'per_network')  # trainer/stages.make_optimizer


def check_optimizer(algo) -> None:
  """--learning_rate_end / --learning_rate_decay_updates / --learning_rate_warmup_updates, --grad_clip_scope,
  --max_update_kl, --value_norm_rate and --value_cost (`algo` a `config.AlgoConfig`)."""
  check_choice('grad_clip_scope', algo.grad_clip_scope, GRAD_CLIP_SCOPES)
  if algo.name == 'grpo' and algo.grad_clip_scope == 'per_network':
    raise ValueError('--grad_clip_scope=per_network clips the critic\'s gradient apart from the policy\'s; --algo=grpo '
                     'trains no critic, so it would clip as --grad_clip_scope=global does: drop it.')
  if algo.name == 'grpo' and algo.value_cost != default_of(algo, 'value_cost'):
    raise ValueError(f'--value_cost={algo.value_cost} weighs the critic\'s loss; --algo=grpo trains no critic: drop '
                     'it.')
  if algo.grad_clip_scope != 'global' and algo.max_grad_norm is None:
    raise ValueError(f'--grad_clip_scope={algo.grad_clip_scope} says how --max_grad_norm clips: set --max_grad_norm.')
  if algo.max_update_kl is not None:
    check_positive('max_update_kl', algo.max_update_kl)
  if algo.value_norm_rate is not None:
    if algo.name != 'ppo':
      raise ValueError(f'--value_norm_rate normalises the critic\'s targets; --algo={algo.name} trains no critic.')
    if not 0.0 < algo.value_norm_rate <= 1.0:
      raise ValueError(f'--value_norm_rate={algo.value_norm_rate} must be in (0, 1] (the statistics\' step per '
                       'iteration; 1 takes each batch\'s own).')
  check_positive('learning_rate_decay_updates', algo.learning_rate_decay_updates, allow_zero=True)
  check_positive('learning_rate_warmup_updates', algo.learning_rate_warmup_updates, allow_zero=True)
  if algo.learning_rate_end is None:
    if algo.learning_rate_decay_updates:
      raise ValueError(f'--learning_rate_decay_updates={algo.learning_rate_decay_updates} needs --learning_rate_end '
                       '(the value the learning rate decays to).')
    return
  check_range('learning_rate_end', algo.learning_rate_end, 0.0, algo.learning_rate)


def planned_iterations(num_timesteps: int, env_steps_per_iteration: int, num_evals: int) -> Tuple[int, int]:
  """(training iterations, iterations per evaluation) of a run: enough for `num_timesteps`, rounded up to whole
  chunks between evaluations (a shorter last chunk would be a second program to compile mid-run)."""
  total = max(1, math.ceil(num_timesteps / env_steps_per_iteration))
  per_eval = max(1, math.ceil(total / max(1, num_evals)))
  return math.ceil(total / per_eval) * per_eval, per_eval


def run_gradient_steps(algo, schedule, env_steps_per_iteration: int) -> int:
  """The optimizer steps of a run's planned iterations (`planned_iterations`) at `env_steps_per_iteration`."""
  iterations, _ = planned_iterations(schedule.num_timesteps, env_steps_per_iteration, schedule.num_evals)
  return iterations * algo.num_updates_per_batch * algo.num_minibatches


def decay_filled(algo, schedule, env_steps_per_iteration: int, planned_for=None):
  """`algo` (a `config.AlgoConfig`) whose --learning_rate_end decay spans the run's gradient steps where its
  length is unset (0), or is the one filled in for `planned_for` ((schedule, env steps per iteration) of the plan
  before a cell's or a resume's change of the iteration's size: `controller.cells`); then the warm-up must end
  before the decay, refused here rather than when the optimizer is built."""
  if algo.learning_rate_end is None:
    return algo
  decay = algo.learning_rate_decay_updates
  if not decay or (planned_for is not None and decay == run_gradient_steps(algo, *planned_for)):
    decay = run_gradient_steps(algo, schedule, env_steps_per_iteration)
  if algo.learning_rate_warmup_updates >= decay:
    raise ValueError(f'--learning_rate_warmup_updates={algo.learning_rate_warmup_updates} must be below the decay\'s '
                     f'length, {decay} gradient steps (--learning_rate_decay_updates, or the run\'s own where unset).')
  return dataclasses.replace(algo, learning_rate_decay_updates=decay)
