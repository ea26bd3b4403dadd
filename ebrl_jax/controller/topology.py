"""The topology of a run, as a value: which worker processes there are, what crosses between them (record specs,
the parameter template, channel capacities), which of them hold a GPU, and the cell they make (one per GPU: its
trainer rank of how many, `controller.cells`; one GPU is the cell of one). Built from a `Config` (and the cell) by
`make_topology` before any worker starts; printed at start and kept in the summary."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import jax

from ebrl_jax import config as config_lib
from ebrl_jax import config_generation
from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax import transport
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import iteration_graph as graph_lib
from ebrl_jax.generation import policies
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.rollout import evaluator as evaluator_lib
from ebrl_jax.rollout import groups
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import trace_cache
from ebrl_jax.transport import cuda_ipc
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import stages as trainer_stages


@dataclasses.dataclass(frozen=True)
class Topology:
  """The processes of a `sync`/`async` run and what crosses between them.

  cpu_roles simulate on CPU cores (native-MuJoCo rollout workers); feeder_roles drive the GPU (the trainer, a
  generation worker, MJX rollout workers, an evaluator: it takes one core like a feeder, being off the critical
  path, even when it steps native MuJoCo). gpu_roles hold a GPU context (an SM quota and a memory budget);
  planned_roles are the processes the memory plan budgets (the GPU roles, plus a warm standby per group when the
  rollout quota changes during the run). trainer, rollout, generation and evaluator are the parts of the config
  each worker receives (never the whole `Config`). `cell`: the cell these processes are (its trainer worker is
  the rank that joins the others; every other worker serves this cell only).
  """
  env_spec: types.EnvSpec
  num_groups: int
  cpu_roles: Tuple[str, ...]
  feeder_roles: Tuple[str, ...]
  gpu_roles: Tuple[str, ...]
  planned_roles: Tuple[str, ...]
  segment_spec: transport.RecordSpec
  segment_capacity: int
  request_spec: Optional[transport.RecordSpec]  # None: generation is co-located with simulation
  reply_spec: Optional[transport.RecordSpec]
  param_template: Any  # the policy parameters' shapes (jax.ShapeDtypeStruct leaves)
  trainer: driver.TrainerConfig
  rollout: groups.RolloutConfig  # every group's (the group index is the worker's argument)
  generation: Optional[generation_worker.GenerationConfig]  # None: generation is co-located with simulation
  iteration_graph: graph_lib.IterationGraph  # the tasks of one iteration and the windows the schedule runs
  # --evaluator=process (sync / async): the evaluator's part and its report records; None: the trainer evaluates.
  evaluator: Optional[evaluator_lib.EvaluatorConfig] = None
  report_spec: Optional[transport.RecordSpec] = None
  # Versions the parameter store holds: 2 (double buffering), or with --deterministic every version a group may
  # still be due (the bound's + 1) and one being written.
  param_history: int = 2
  cell: cells_lib.Cell = cells_lib.Cell()

  @property
  def roles(self) -> Tuple[str, ...]:
    return self.feeder_roles + self.cpu_roles

  def on_gpu(self, role: str) -> bool:
    base = role.split('#')[0]  # a rollout role of another layout (--group_schedule) is where rollout/0 is
    return base in self.gpu_roles or base.startswith('standby/') or (base.startswith('rollout/') and
                                                                     'rollout/0' in self.gpu_roles)

  def describe(self) -> Dict[str, Any]:
    """A JSON-able description (kept in the summary)."""
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.param_template))
    out = {
        'roles': list(self.roles),
        'gpu_roles': list(self.gpu_roles),
        'cpu_roles': list(self.cpu_roles),
        'planned_roles': list(self.planned_roles),
        'num_groups': self.num_groups,
        'segment_bytes': self.segment_spec.nbytes,
        'segment_capacity': self.segment_capacity,
        'param_bytes': param_bytes,
        'param_history': self.param_history,
        'cell': {
            'rank': self.cell.rank,
            'count': self.cell.count
        }
    }
    if self.request_spec is not None:
      out['request_bytes'], out['reply_bytes'] = self.request_spec.nbytes, self.reply_spec.nbytes
      out['generation_transport'] = self.rollout.generation_transport
    return out


def segment_spec(cfg: config_lib.Config, spec: types.EnvSpec) -> transport.RecordSpec:
  """The shared-memory spec of one env group's (or env block's) `SegmentRecord` for one iteration (derived from
  `types.segment_template`, the records' one definition)."""
  unrolls, steps = cfg.segment_shape
  return transport.spec_of(
      types.segment_template(steps, unrolls * block_envs(cfg), spec.obs_dim, cfg.policy.action_chunk, spec.action_dim,
                             spec.pixel_shape))


def block_envs(cfg: config_lib.Config) -> int:
  """Envs of one segment record: the group's, or with --group_schedule / --replan_groups one block
  (`ScheduleConfig.block_count`)."""
  return cfg.sim.num_envs // cfg.schedule.block_count


def generation_transport(cfg: config_lib.Config) -> str:
  """How a separate generation worker's hand-off travels: 'host' (the shared-memory mailbox) or 'cuda_ipc' (MJX
  groups' device buffers; config_generation.py); '' with co-located generation."""
  if cfg.schedule.colocate_generation:
    return ''
  return config_generation.resolve_transport(cfg.schedule.generation_transport, cfg.sim.backend, cfg.resources.platform,
                                             cuda_ipc.host_reason)


def mailbox_specs(cfg: config_lib.Config, spec: types.EnvSpec, ipc: bool = False):
  """Request and reply specs of one env slice (the whole group without `--env_slices`)."""
  return act_record_specs(cfg.slice_envs, spec.obs_dim, cfg.policy.action_chunk, spec.action_dim, ipc)


def act_record_specs(envs: int, obs_dim: int, chunk: int, action_dim: int, ipc: bool = False):
  """Act request / reply specs of a slice of `envs` envs. With `ipc` (CUDA IPC) the arrays have 0 rows: they
  travel in the slice's device buffer, the records are only the per-step flags."""
  rows, k, a = (0 if ipc else envs), chunk, action_dim
  ints = {'group': 'int32', 'env_slice': 'int32', 'seq': 'int32'}
  request = transport.record_spec(types.ActRequest, {
      'group': (),
      'env_slice': (),
      'seq': (),
      'min_version': (),
      'obs': (rows, obs_dim),
      'key': (2,),
      'owner': (),
      'handle': (cuda_ipc.HANDLE_BYTES,)
  },
                                  dtypes={
                                      **ints, 'min_version': 'int32',
                                      'key': 'uint32',
                                      'owner': 'int32',
                                      'handle': 'uint8'
                                  })
  reply = transport.record_spec(types.ActReply, {
      'group': (),
      'env_slice': (),
      'seq': (),
      'version': (),
      'actions': (rows, k, a),
      'raw_actions': (rows, k, a),
      'log_probs': (rows,)
  },
                                dtypes={
                                    **ints, 'version': 'int32'
                                })
  return request, reply


def param_template(cfg: config_lib.Config, spec: types.EnvSpec):
  """Shapes of the policy parameters, without computing them (the controller touches no accelerator)."""
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  state = jax.eval_shape(lambda: trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(
      0), spec.obs_dim, cfg.policy.normalize_observations, spec.pixel_shape))
  return state.params


def _roles(cfg: config_lib.Config) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """(CPU-simulating roles, GPU-feeder roles)."""
  rollouts = tuple(f'rollout/{g}' for g in range(cfg.schedule.num_groups))
  feeders = ('trainer',) + (() if cfg.schedule.colocate_generation else ('generation',))
  feeders += ('evaluator',) if cfg.evaluator_process else ()
  if cfg.sim.backend == 'mujoco_cpu':
    return rollouts, feeders
  return (), feeders + rollouts


def evaluator_parts(cfg: config_lib.Config, process: startup.ProcessConfig):
  """(the evaluator's config, its report spec), or (None, None) where the trainer evaluates."""
  if not cfg.evaluator_process:
    return None, None
  evaluator = evaluator_lib.EvaluatorConfig(process=process,
                                            sim=cfg.sim,
                                            policy=cfg.policy,
                                            seed=cfg.schedule.seed,
                                            deterministic=cfg.schedule.deterministic_eval)
  report = transport.record_spec(types.EvalReport, {name: () for name in types.EvalReport._fields},
                                 dtypes={'version': 'int64'},
                                 default_dtype='float64')
  return evaluator, report


def process_config(cfg: config_lib.Config) -> startup.ProcessConfig:
  return startup.ProcessConfig(run_dir=cfg.schedule.run_dir,
                               trace_dir=cfg.schedule.trace_dir,
                               platform=cfg.resources.platform,
                               compilation_cache_dir=cfg.schedule.compilation_cache_dir,
                               trace_cache_dir=trace_cache.cache_dir_for(cfg.schedule.compilation_cache_dir,
                                                                         cfg.schedule.trace_cache))


def _worker_configs(cfg: config_lib.Config, switches: Tuple[str, ...], cell: cells_lib.Cell):
  """The trainer's, the rollout workers' and the generation worker's parts of `cell`; `switches` are the overlap
  windows the iteration graph realises (each worker runs the ones it owns)."""
  process = process_config(cfg)
  rollout = groups.RolloutConfig(process=process,
                                 sim=cfg.sim,
                                 policy=cfg.policy,
                                 collect=cfg.collect_spec,
                                 seed=cfg.schedule.seed,
                                 group_envs=cfg.group_envs,
                                 staleness_bound=cfg.schedule.staleness_bound,
                                 env_slices=cfg.schedule.env_slices,
                                 windows=switches,
                                 deterministic=cfg.schedule.deterministic,
                                 block_envs=block_envs(cfg),
                                 generation_transport=generation_transport(cfg),
                                 cell=cell.rank)
  generation = None
  if not cfg.schedule.colocate_generation:
    generation = generation_worker.GenerationConfig(process=process,
                                                    sim=cfg.sim,
                                                    policy=cfg.policy,
                                                    seed=cfg.schedule.seed,
                                                    num_requesters=cfg.schedule.num_groups * cfg.schedule.env_slices,
                                                    slice_envs=cfg.slice_envs,
                                                    total_envs=cfg.sim.num_envs,
                                                    transport=rollout.generation_transport,
                                                    action_chunk=cfg.policy.action_chunk,
                                                    cell=cell.rank)
  trainer = dataclasses.replace(driver.trainer_config(cfg, process), windows=switches)
  return cells_lib.trainer_of_cell(trainer, cell, cfg.schedule.resume), rollout, generation


def make_topology(cfg: config_lib.Config, cell: Optional[cells_lib.Cell] = None) -> Topology:
  """The topology of `cfg`'s run as `cell` (None: the one cell of a one-GPU run)."""
  cell = cell or cells_lib.Cell(run_dir=cfg.schedule.run_dir)
  spec = sim.spec_of(cfg.sim)
  cpu_roles, feeders = _roles(cfg)
  # Native-MuJoCo rollout workers served by a generation worker hold no GPU context.
  gpu_roles = tuple(r for r in feeders + cpu_roles if not (cfg.rollout_on_host and r.startswith('rollout/')))
  planned = gpu_roles
  most = max(cfg.schedule.group_counts)
  if cfg.schedule.relaid and 'rollout/0' in gpu_roles:  # every layout's workers, and their standbys
    planned += tuple(f'rollout/{g}' for g in range(cfg.schedule.num_groups, most))
    planned += tuple(f'standby/{g}' for g in range(most))
  if (cfg.resources.quota_schedule or cfg.resources.replan or cfg.resources.slack_quotas) and 'rollout/0' in gpu_roles:
    planned += tuple(f'standby/{g}' for g in range(cfg.schedule.num_groups))
  request = reply = None
  if not cfg.schedule.colocate_generation:
    request, reply = mailbox_specs(cfg, spec, ipc=generation_transport(cfg) == 'cuda_ipc')
  graph = graph_lib.make_graph(cfg)
  trainer, rollout, generation = _worker_configs(cfg, graph.switches(), cell)
  evaluator, report = evaluator_parts(cfg, trainer.process)
  return Topology(env_spec=spec,
                  num_groups=cfg.schedule.num_groups,
                  cpu_roles=cpu_roles,
                  feeder_roles=feeders,
                  gpu_roles=gpu_roles,
                  planned_roles=planned,
                  segment_spec=segment_spec(cfg, spec),
                  segment_capacity=cfg.schedule.block_count * (cfg.schedule.staleness_bound + 1),
                  request_spec=request,
                  reply_spec=reply,
                  param_template=param_template(cfg, spec),
                  trainer=trainer,
                  rollout=rollout,
                  generation=generation,
                  iteration_graph=graph,
                  evaluator=evaluator,
                  report_spec=report,
                  param_history=cfg.schedule.staleness_bound + 2 if cfg.schedule.deterministic else 2,
                  cell=cell)
