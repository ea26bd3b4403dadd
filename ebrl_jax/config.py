"""Frozen configuration dataclasses: one per component, validated on construction.

`Config` is the single value a run is built from. `main.py` fills it from absl flags (whose defaults are read
from these dataclasses); notebooks and tests build it in Python. Each worker receives only its own part.
Validation errors are `ValueError`s that name the field (as its flag) and the allowed values.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from ebrl_jax.config_cells import LAUNCHERS, CellConfig, agreed_flags, check_run_cells
from ebrl_jax.config_checks import check_choice as _check_choice, check_positive as _check_positive
from ebrl_jax.config_checks import check_episode_length, check_playground_sim, check_solver_caps
from ebrl_jax.config_checks import check_env_slices, check_host_rollout_quotas, check_range as _check_range, check_seed
from ebrl_jax.config_checks import check_grpo_run, check_optimizer, check_schedule_options, decay_filled
from ebrl_jax.config_checks import GRAD_CLIP_SCOPES, parse_group_schedule
from ebrl_jax.config_generation import CRITICS, GENERATION_TRANSPORTS, check_critic, check_generation
from ebrl_jax.config_generation import check_grad_clip_critic
from ebrl_jax.config_randomize import RANDOMIZE_PARAMS, RandomizationConfig, parse_randomize
from ebrl_jax.config_resources import EVALUATOR_QUOTA, QUOTA_ROLES, ResourceConfig
from ebrl_jax.config_vision import OBS_MODES, check_policy_vision, check_run_pixels, check_sim_obs, pixel_shape

# Names accepted by the registries; the registries themselves check membership against these same tuples.
TASKS = ('ant', 'halfcheetah', 'hopper', 'walker2d', 'humanoid', 'pusher', 'reacher', 'inverted_pendulum', 'push_cube')
# `--task=playground:CartpoleBalance`: a MuJoCo Playground env by its registry name (the `playground` extra).
PLAYGROUND_PREFIX = 'playground:'
BACKENDS = ('mujoco_cpu', 'mjx', 'mjx_warp')
POLICIES = ('mlp', 'transformer', 'token')
COMPUTE_DTYPES = ('float32', 'bfloat16')
ALGORITHMS = ('ppo', 'grpo')
POLICY_RATIOS = ('joint', 'geometric')  # trainer/losses.clipped_surrogate
SCHEDULES = ('fused', 'sync', 'async', 'overlap', 'auto')  # auto: one of the first three, from stage profiles
TRANSPORTS = ('shm', 'thread')
FAULT_POLICIES = ('restart', 'stop')
EVALUATORS = ('process', 'trainer')


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """Simulation: which task, on which backend, how many environments."""
  task: str = 'inverted_pendulum'
  backend: str = 'mujoco_cpu'
  num_envs: int = 64
  episode_length: int = 1000
  action_repeat: int = 1
  num_threads: int = 0  # threads stepping native MuJoCo envs (mj_step releases the GIL); 0: one per available core
  # GRPO: envs come in groups of `group_size` that reset to the same initial state. 1 disables grouping.
  group_size: int = 1
  num_eval_envs: int = 16
  # Domain randomisation, e.g. 'friction=0.8:1.2,mass=0.9:1.1,gain=0.9:1.1' (see config_randomize); '' is off.
  randomize: str = ''
  obs: str = 'state'  # or 'pixels': stacked uint8 camera frames beside the state (config_vision)
  image_size: int = 64
  frame_stack: int = 1
  pixel_depth: bool = False  # --obs=pixels: a uint8 depth channel after each frame's RGB (config_vision)
  pixel_state: str = 'full'  # --obs=pixels: the state beside the frames, full or proprio (config_vision)
  # Constraint-solver caps on every backend, 0: the task's own (config_checks.check_solver_caps says which).
  solver_iterations: int = 0
  ls_iterations: int = 0

  def __post_init__(self):
    _check_choice('backend', self.backend, BACKENDS)
    if self.task.startswith(PLAYGROUND_PREFIX):
      check_playground_sim(self, PLAYGROUND_PREFIX)
    else:
      _check_choice('task', self.task, TASKS)
    if self.randomization.enabled and self.task.startswith(PLAYGROUND_PREFIX):
      raise ValueError(f'--randomize={self.randomize} runs on the project\'s own tasks, not --task={self.task} '
                       '(Playground ships its own randomisers).')
    _check_positive('num_envs', self.num_envs)
    _check_positive('episode_length', self.episode_length)
    _check_positive('action_repeat', self.action_repeat)
    check_episode_length(self)
    _check_positive('num_threads', self.num_threads, allow_zero=True)
    _check_positive('group_size', self.group_size)
    _check_positive('num_eval_envs', self.num_eval_envs)
    if self.num_envs % self.group_size:
      raise ValueError(f'--num_envs={self.num_envs} must be a multiple of --group_size={self.group_size}.')
    check_sim_obs(self)
    check_solver_caps(self, PLAYGROUND_PREFIX)

  @property
  def randomization(self) -> RandomizationConfig:
    """The parsed `randomize` ranges (nothing randomised when it is '')."""
    return parse_randomize(self.randomize)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The actor-critic network. `mlp` follows Brax's PPO defaults; `transformer` stands for a VLA-style policy
  with a Gaussian action head; `token` is an autoregressive action-token decoder (OpenVLA-style: each action
  value one of `num_bins` tokens, decoded one at a time with a KV cache)."""
  kind: str = 'mlp'
  policy_hidden_sizes: Tuple[int, ...] = (32, 32, 32, 32)
  value_hidden_sizes: Tuple[int, ...] = (256, 256, 256, 256, 256)
  normalize_observations: bool = True
  min_std: float = 0.001
  # Transformer and token policies: the observation is cut into tokens of `obs_token_size` values;
  # `action_chunk` actions (k consecutive env steps) come out of one policy step.
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_ratio: int = 4
  obs_token_size: int = 4
  action_chunk: int = 1
  # Token policy only: bins per action dimension (bin centres span [-1, 1]).
  num_bins: int = 256
  # Transformer and token policies: dtype of the trunk's activations; params, optimizer state, logits and
  # log-probs stay float32.
  compute_dtype: str = 'float32'
  critic: str = 'auto'  # transformer/token: the value network (config_generation.critic_of says which 'auto' is)
  vision_encoder: str = 'cnn'  # --obs=pixels (config_vision): cnn or patches; the CNN's widths, blocks; ViT patch
  cnn_channels: Tuple[int, ...] = (16, 32, 32)
  cnn_blocks: int = 2
  patch_size: int = 8

  def __post_init__(self):
    _check_choice('policy', self.kind, POLICIES)
    check_policy_vision(self)
    _check_choice('compute_dtype', self.compute_dtype, COMPUTE_DTYPES)
    check_critic(self)
    for name in ('d_model', 'num_layers', 'num_heads', 'mlp_ratio', 'obs_token_size', 'action_chunk'):
      _check_positive(name, getattr(self, name))
    # Token ids travel as float32 (Transition.raw_action), exact only below 2^24.
    if not 2 <= self.num_bins <= 2**24:
      raise ValueError(f'--num_bins={self.num_bins} must lie in [2, 2^24] (token ids travel as float32).')
    if not self.policy_hidden_sizes or any(h <= 0 for h in self.policy_hidden_sizes):
      raise ValueError(f'--policy_hidden_sizes={list(self.policy_hidden_sizes)} must be non-empty and positive.')
    if not self.value_hidden_sizes or any(h <= 0 for h in self.value_hidden_sizes):
      raise ValueError(f'--value_hidden_sizes={list(self.value_hidden_sizes)} must be non-empty and positive.')
    if self.d_model % self.num_heads:
      raise ValueError(f'--d_model={self.d_model} must be a multiple of --num_heads={self.num_heads}.')
    if self.kind == 'mlp' and self.action_chunk != 1:
      raise ValueError(f'--action_chunk={self.action_chunk} needs --policy=transformer or token (the MLP emits one '
                       'action).')
    _check_positive('min_std', self.min_std)


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """PPO or GRPO. Batch shapes follow Brax's PPO naming so its published hyperparameters carry over:
  one iteration collects `batch_size * num_minibatches` segments of `unroll_length` steps, then runs
  `num_updates_per_batch` epochs over `num_minibatches` minibatches of `batch_size` segments."""
  name: str = 'ppo'
  learning_rate: float = 3e-4
  discount: float = 0.97
  gae_lambda: float = 0.95
  clip_epsilon: float = 0.3
  entropy_cost: float = 1e-2
  value_cost: float = 0.25
  reward_scaling: float = 10.0
  normalize_advantage: bool = True
  max_grad_norm: Optional[float] = None
  unroll_length: int = 5
  batch_size: int = 256
  num_minibatches: int = 8
  num_updates_per_batch: int = 4
  # Decoupled PPO: the behaviour/proximal importance weight is clipped at this value (async schedules).
  max_behaviour_ratio: float = 2.0
  policy_ratio: str = 'joint'  # or 'geometric': per action value (GSPO's length-normalised ratio)
  learning_rate_end: Optional[float] = None  # a linear decay to this over the run's gradient steps (None: constant)
  learning_rate_decay_updates: int = 0  # the decay's gradient steps (0: the run's, filled in by Config)
  learning_rate_warmup_updates: int = 0  # a linear warm-up from 0 over these gradient steps (trainer/stages)
  grad_clip_scope: str = 'global'  # or 'per_network': policy and critic parameters clipped apart (make_optimizer)
  max_update_kl: Optional[float] = None  # undo a step past this rise of approx KL, skip the rest (trainer/stages)
  value_norm_rate: Optional[float] = None  # PopArt: value targets' statistics move at this rate (trainer/critic)

  def __post_init__(self):
    _check_choice('algo', self.name, ALGORITHMS)
    check_optimizer(self)
    _check_choice('policy_ratio', self.policy_ratio, POLICY_RATIOS)
    _check_positive('learning_rate', self.learning_rate)
    _check_range('discount', self.discount, 0.0, 1.0)
    _check_range('gae_lambda', self.gae_lambda, 0.0, 1.0)
    _check_range('clip_epsilon', self.clip_epsilon, 0.0, 1.0)
    _check_positive('entropy_cost', self.entropy_cost, allow_zero=True)
    _check_positive('value_cost', self.value_cost, allow_zero=True)
    _check_positive('reward_scaling', self.reward_scaling)
    if self.max_grad_norm is not None:
      _check_positive('max_grad_norm', self.max_grad_norm)
    for name in ('unroll_length', 'batch_size', 'num_minibatches', 'num_updates_per_batch'):
      _check_positive(name, getattr(self, name))
    if not self.max_behaviour_ratio >= 1.0:  # NaN too
      raise ValueError(f'--max_behaviour_ratio={self.max_behaviour_ratio} must be >= 1.')

  @property
  def segments_per_iteration(self) -> int:
    return self.batch_size * self.num_minibatches

  @property
  def episodic(self) -> bool:
    """GRPO collects one whole episode per env after a group reset (no critic to bootstrap from); PPO collects
    fixed-length segments from envs that reset on their own."""
    return self.name == 'grpo'


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How the stages are run and for how long."""
  name: str = 'fused'
  num_timesteps: int = 200_000
  num_evals: int = 10
  seed: int = 0
  # Stop early once the evaluation return reaches this (None: run all `num_timesteps`).
  target_return: Optional[float] = None
  run_dir: str = 'runs/default'
  # Where JAX's persistent compilation cache lives; '' disables it.
  compilation_cache_dir: str = '~/.cache/ebrl_jax/xla'
  trace_cache: bool = True  # programs' traces kept inside it, so warm starts skip tracing (runtime/trace_cache.py)
  checkpoint_every: int = 1  # in evaluations; 0 disables checkpoints
  # A first checkpoint after this many iterations (0: none before the --checkpoint_every cadence), so that a run
  # stopped early has one to resume.
  first_checkpoint_iteration: int = 1
  # Wall-clock budget in seconds from process start (0: none): the run stops at the next iteration boundary after
  # it, saves a checkpoint and writes its summary (`stopped: 'max_wall_s'`).
  max_wall_s: float = 0.0
  # Seconds of training, start-up excluded (what the rate counts; 0: none): a stop as at --max_wall_s's (auto's trial).
  max_train_s: float = 0.0
  # Evaluate the policy's mode (True) or sample actions as in training (False, Brax's default).
  deterministic_eval: bool = True
  # sync / async / overlap: who evaluates the published versions. 'process': an evaluator process beside the
  # trainer (docs/architecture.md, The evaluator); 'trainer': the trainer, in line between iterations (overlap:
  # in its 'evaluate' window where the graph has one). fused evaluates in line whatever this says.
  evaluator: str = 'process'
  # --evaluator=process: at the run's end, how long the trainer waits for the evaluations still outstanding (the
  # final version's among them) before it writes its summary without them.
  evaluator_wait_s: float = 120.0
  # Process schedules (sync, async): env groups, each stepped by its own rollout worker process.
  num_groups: int = 2
  # async: a group may run at most this many policy versions ahead of the trainer (sync is 0 by definition).
  max_staleness: int = 1
  transport: str = 'shm'  # 'shm': worker processes over shared memory; 'thread': threads in one process
  # What happens when a rollout or generation worker dies: restart it (its group resets) or stop the run cleanly.
  worker_fault: str = 'restart'
  # A worker that dies more often than this (e.g. it cannot start at its quota) stops the run.
  max_restarts: int = 3
  trace_dir: str = ''  # '' disables the Perfetto/chrome://tracing timeline
  # Process schedules: act inside each rollout worker (True), or in one generation worker process that batches
  # the groups' requests (False; config_generation.py says how MJX groups hand observations over).
  colocate_generation: bool = True
  generation_transport: str = 'auto'  # MJX with --nocolocate_generation: auto, host or cuda_ipc
  # With a separate generation worker: split each native-MuJoCo env group into this many slices that step and
  # ask for actions on their own, so a slice waiting for actions never holds its group's other envs.
  env_slices: int = 1
  deterministic: bool = False  # sync/async: a repeatable run (config_checks, docs/architecture.md: Schedules)
  group_schedule: str = ''  # sync/async: live env-group changes, 'iteration:groups=G,...' (controller/relayout.py)
  replan_groups: Tuple[int, ...] = ()  # sync/async: group counts the re-planner may switch to (group_replan.py)
  resume: bool = False
  progress_bar: bool = True

  def __post_init__(self):
    _check_choice('schedule', self.name, SCHEDULES)
    _check_positive('num_timesteps', self.num_timesteps)
    for name in ('num_evals', 'checkpoint_every', 'first_checkpoint_iteration', 'max_wall_s', 'max_train_s'):
      _check_positive(name, getattr(self, name), allow_zero=True)
    check_seed(self.seed)
    if not self.run_dir:
      raise ValueError('--run_dir must not be empty.')
    _check_positive('num_groups', self.num_groups)
    _check_positive('max_staleness', self.max_staleness, allow_zero=True)
    _check_choice('transport', self.transport, TRANSPORTS)
    _check_choice('worker_fault', self.worker_fault, FAULT_POLICIES)
    _check_positive('max_restarts', self.max_restarts, allow_zero=True)
    _check_positive('env_slices', self.env_slices)
    _check_choice('generation_transport', self.generation_transport, GENERATION_TRANSPORTS)
    _check_choice('evaluator', self.evaluator, EVALUATORS)
    _check_positive('evaluator_wait_s', self.evaluator_wait_s)
    _ = self.group_changes  # parses and checks

  @property
  def group_changes(self) -> Tuple[Tuple[int, int], ...]:
    return parse_group_schedule(self.group_schedule)  # ((trainer iteration, groups), ...), in iteration order

  @property
  def group_counts(self) -> Tuple[int, ...]:
    """Every env-group count the run may take: --num_groups, then --group_schedule's and --replan_groups'."""
    return (self.num_groups, *(g for _, g in self.group_changes), *self.replan_groups)

  @property
  def relaid(self) -> bool:
    """The env groups may change while the run goes on (--group_schedule or --replan_groups)."""
    return bool(self.group_changes or self.replan_groups)

  @property
  def block_count(self) -> int:
    """Records per iteration: one per group, or with --group_schedule / --replan_groups one per env block
    (num_envs / lcm of every layout's group count envs: every layout's groups hold whole blocks)."""
    return math.lcm(*self.group_counts)

  @property
  def staleness_bound(self) -> int:
    """Versions a segment's policy may lag the trainer's: 0 for fused, sync and overlap (on-policy)."""
    return self.max_staleness if self.name == 'async' else 0


@dataclasses.dataclass(frozen=True)
class CollectSpec:
  """How one iteration's data comes from each env, derived from a `Config` (`Config.collect_spec`): what the
  rollout stages take instead of the whole config. Hashable, so jitted code can take it as a static argument."""
  episodic: bool  # one whole episode per env after a group reset (GRPO), else `unrolls` segments per env
  unrolls: int  # segments per env per iteration
  steps: int  # policy steps (action chunks) per segment
  action_chunk: int  # env steps per policy step
  group_size: int  # envs that reset to one initial state (GRPO)
  min_std: float


@dataclasses.dataclass(frozen=True)
class Config:
  sim: SimConfig = dataclasses.field(default_factory=SimConfig)
  policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
  algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
  schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
  resources: ResourceConfig = dataclasses.field(default_factory=ResourceConfig)
  cells: CellConfig = dataclasses.field(default_factory=CellConfig)

  def __post_init__(self):
    if self.sim.num_envs % self.schedule.num_groups and self.schedule.name != 'fused':
      raise ValueError(f'--num_envs={self.sim.num_envs} must be a multiple of --num_groups='
                       f'{self.schedule.num_groups} (env groups are equal in size).')
    if self.schedule.name != 'fused' and (self.sim.num_envs // self.schedule.num_groups) % self.sim.group_size:
      raise ValueError(f'each env group ({self.sim.num_envs} / --num_groups={self.schedule.num_groups}) must hold '
                       f'whole GRPO groups of --group_size={self.sim.group_size}.')
    check_generation(self)
    check_grad_clip_critic(self)
    check_env_slices(self)
    check_schedule_options(self)
    check_run_pixels(self)
    check_run_cells(self, self.cells.num_processes)
    check_host_rollout_quotas(self)
    object.__setattr__(self, 'algo', decay_filled(self.algo, self.schedule, self.env_steps_per_iteration))
    if self.algo.episodic:
      check_grpo_run(self)
      return
    if self.algo.unroll_length % self.policy.action_chunk:
      raise ValueError(f'--unroll_length={self.algo.unroll_length} must be a multiple of '
                       f'--action_chunk={self.policy.action_chunk}.')
    seg = self.algo.segments_per_iteration
    if seg % self.sim.num_envs:
      raise ValueError(
          f'--batch_size={self.algo.batch_size} x --num_minibatches={self.algo.num_minibatches} = {seg} segments '
          f'per iteration must be a multiple of --num_envs={self.sim.num_envs} (each env contributes whole '
          f'segments of --unroll_length={self.algo.unroll_length} steps).')

  @property
  def collect_spec(self) -> CollectSpec:
    unrolls, steps = self.segment_shape
    return CollectSpec(episodic=self.algo.episodic,
                       unrolls=unrolls,
                       steps=steps,
                       action_chunk=self.policy.action_chunk,
                       group_size=self.sim.group_size,
                       min_std=self.policy.min_std)

  @property
  def rollout_on_host(self) -> bool:
    """The process schedules' rollout workers simulate on CPU cores and a separate generation worker acts for
    them: they run JAX on the CPU, hold no GPU context and get no SM quota or GPU memory budget."""
    return (self.schedule.name != 'fused' and self.sim.backend == 'mujoco_cpu' and
            not self.schedule.colocate_generation)

  @property
  def evaluator_process(self) -> bool:
    """The run's evaluations come from an evaluator process (sync / async / overlap with --evaluator=process)."""
    return self.schedule.name in ('sync', 'async', 'overlap') and self.schedule.evaluator == 'process'

  @property
  def group_envs(self) -> int:
    """Envs of one env group (process schedules)."""
    return self.sim.num_envs // self.schedule.num_groups

  @property
  def slice_envs(self) -> int:
    """Envs of one slice of an env group (`--env_slices`)."""
    return self.group_envs // self.schedule.env_slices

  @property
  def env_steps_per_iteration(self) -> int:
    if self.algo.episodic:
      return self.sim.num_envs * self.sim.episode_length * self.sim.action_repeat
    return self.algo.segments_per_iteration * self.algo.unroll_length * self.sim.action_repeat

  @property
  def unrolls_per_env(self) -> int:
    return self.algo.segments_per_iteration // self.sim.num_envs

  @property
  def segment_shape(self) -> Tuple[int, int]:
    """(unrolls per env, policy steps per segment) of one iteration: PPO collects `unrolls_per_env` segments of
    unroll_length / action_chunk steps from every env, GRPO one whole episode per env."""
    k = self.policy.action_chunk
    if self.algo.episodic:
      return 1, self.sim.episode_length // k
    return self.unrolls_per_env, self.algo.unroll_length // k
