"""Task registry: one `TaskDef` per task, shared by the MJX and native-MuJoCo backends.

    from ebrl_jax.sim import registry
    task = registry.load('hopper')          # TaskDef; unknown names raise ValueError listing the valid ones
    spec = registry.env_spec('hopper', episode_length=1000, action_repeat=1)

Physics facts (frame skip, the MuJoCo option overrides Brax applies for backend='mjx') and the parameters of
reward and termination are copied from `brax.envs.<task>` (brax 0.14.2), with Brax's constructor defaults.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

from ebrl_jax import config as config_lib
from ebrl_jax.config_vision import PIXEL_STATES
from ebrl_jax import types
from ebrl_jax.sim import manipulation
from ebrl_jax.sim import tasks

# mujoco.mjtSolver.mjSOL_NEWTON and mujoco.mjtDisableBit.mjDSBL_EULERDAMP, as ints so that this module does
# not import mujoco; tests check them against the enums.
SOLVER_NEWTON = 2
DISABLE_EULERDAMP = 1 << 15
# What Brax's ant and humanoid apply with `sys.tree_replace` for backend='mjx' (the others apply nothing).
# NOTE: `disableflags` is *replaced*, not or-ed, as Brax does.
_MJX_NEWTON_1 = (('solver', SOLVER_NEWTON), ('disableflags', DISABLE_EULERDAMP), ('iterations', 1), ('ls_iterations',
                                                                                                     4))


@dataclasses.dataclass(frozen=True, eq=False)
class TaskDef:
  """Everything both backends need to know about a task.

  reset_fn(rng, n, consts) -> (qpos [n, nq], qvel [n, nv]); obs_fn(frame, consts) -> [n, O];
  reward_fn(before, after, ctrl, consts) -> (reward [n], done [n] bool). See `ebrl_jax.sim.tasks`.

  Brax's tasks name their MJCF by `xml_file` under brax/envs/assets. A task of this project gives `asset_path`
  (an absolute MJCF path) instead, and `brax_module`: the module that registers its Brax env as `brax_name`
  with `brax.envs.register_environment` (`load` imports it, so `brax.envs.get_environment(brax_name)` finds it).
  """
  name: str
  brax_name: str
  xml_file: str  # file name under brax/envs/assets ('' with asset_path)
  n_frames: int  # physics steps per env step (Brax's default for backend='mjx')
  obs_dim: int
  action_dim: int
  mjx_opt_overrides: Tuple[Tuple[str, int], ...]  # (MjOption field, value) pairs
  params: Mapping[str, float]
  data_fields: Tuple[str, ...]  # MjData fields obs_fn/reward_fn read
  scale_actions: bool  # Brax maps [-1, 1] to the actuator ctrlrange before stepping
  reset_fn: Callable
  obs_fn: Callable
  reward_fn: tasks.RewardFn
  default_episode_length: int = 1000
  asset_path: Optional[str] = None  # absolute MJCF path; None: xml_file under brax/envs/assets
  brax_module: str = ''  # module that registers the Brax env `brax_name` ('' for Brax's own envs)
  # The observation's first `proprio_dim` values are the robot's own (joints, fingertip): what --pixel_state=proprio
  # keeps beside the camera frames. 0: the task does not say (it then offers only --pixel_state=full).
  proprio_dim: int = 0

  def __post_init__(self):
    if not 0 <= self.proprio_dim <= self.obs_dim:
      raise ValueError(f'TaskDef {self.name!r}: proprio_dim={self.proprio_dim} must be in [0, obs_dim={self.obs_dim}].')
    if self.n_frames <= 0:
      raise ValueError(f'TaskDef {self.name!r}: n_frames={self.n_frames} must be > 0.')
    unknown = set(dict(self.mjx_opt_overrides)) - {'solver', 'disableflags', 'iterations', 'ls_iterations'}
    if unknown:
      raise ValueError(f'TaskDef {self.name!r}: unsupported mjx_opt_overrides {sorted(unknown)}.')

  @property
  def xml_path(self) -> str:
    """The MJCF file: `asset_path`, or `xml_file` inside the installed brax package (brax is not imported)."""
    if self.asset_path is not None:
      return self.asset_path
    spec = importlib.util.find_spec('brax')
    if spec is None or not spec.submodule_search_locations:
      raise ImportError('brax is not installed; the task models ship with it.')
    return os.path.join(list(spec.submodule_search_locations)[0], 'envs', 'assets', self.xml_file)


def cap_fields(caps: Tuple[int, int]) -> Dict[str, int]:
  """The MjOption fields `caps` = (--solver_iterations, --ls_iterations) set ({} with no caps; 0 keeps a field)."""
  if min(caps) < 0:
    raise ValueError(f'solver caps {caps} must be >= 0 (0 keeps the task\'s own).')
  return {k: int(v) for k, v in zip(('iterations', 'ls_iterations'), caps) if v > 0}


def solver_caps(task: TaskDef, caps: Tuple[int, int] = (0, 0)) -> Tuple[Tuple[str, int], ...]:
  """The MjOption fields to set on `task`'s model for MJX and native MuJoCo alike: the task's own overrides with
  `cap_fields(caps)` in place of its `iterations` / `ls_iterations`."""
  options = dict(task.mjx_opt_overrides)
  options.update(cap_fields(caps))
  return tuple(options.items())


_REGISTRY: Dict[str, TaskDef] = {}


def register(name: str, task_def: TaskDef) -> None:
  if name in _REGISTRY:
    raise ValueError(f'Task {name!r} is already registered.')
  _REGISTRY[name] = task_def


def names() -> Tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def _playground():
  """`ebrl_jax.sim.playground`, for a `playground:` task."""
  # lazy: MuJoCo Playground (an optional extra) and JAX load only for a playground: task; this module stays light.
  from ebrl_jax.sim import playground  # pylint: disable=g-import-not-at-top
  return playground


def load(name: str) -> TaskDef:
  """The task's definition. NOTE: for a task with `brax_module` this imports that module (and so brax and
  jax, which `cpu_env.load_model` imports anyway) to register the task's Brax env."""
  if name.startswith(config_lib.PLAYGROUND_PREFIX):
    raise ValueError(f'--task={name} is a MuJoCo Playground env: it has no TaskDef and runs on MJX only '
                     '(--backend=mjx or mjx_warp).')
  if name not in _REGISTRY:
    raise ValueError(f'Unknown task {name!r}; valid tasks: {", ".join(names())}.')
  task = _REGISTRY[name]
  if task.brax_module:
    importlib.import_module(task.brax_module)
  return task


def get_default_config(name: str) -> config_lib.SimConfig:
  """A `SimConfig` for the task with its default episode length (Brax's 1000 for Brax's tasks) and no action
  repeat."""
  if name.startswith(config_lib.PLAYGROUND_PREFIX):
    return config_lib.SimConfig(task=name,
                                backend='mjx',
                                episode_length=_playground().default_episode_length(name),
                                action_repeat=1)
  task = load(name)
  return config_lib.SimConfig(task=name, episode_length=task.default_episode_length, action_repeat=1)


@functools.lru_cache(maxsize=None)
def _timestep(xml_path: str) -> float:
  import mujoco  # pylint: disable=g-import-not-at-top
  return float(mujoco.MjModel.from_xml_path(xml_path).opt.timestep)


def state_dim(task: TaskDef, pixel_state: str = 'full') -> int:
  """How many state values an observation carries: all `task.obs_dim`, or with --pixel_state=proprio (camera
  frames beside it) the task's proprioceptive prefix `task.proprio_dim`."""
  if pixel_state == 'full':
    return task.obs_dim
  if pixel_state != 'proprio':
    raise ValueError(f'--pixel_state={pixel_state!r} is not valid; allowed values: {", ".join(PIXEL_STATES)}.')
  if not task.proprio_dim:
    raise ValueError(f'--pixel_state=proprio: --task={task.name} does not say which of its observation values are '
                     'proprioceptive (TaskDef.proprio_dim); use --pixel_state=full.')
  return task.proprio_dim


def env_spec(name: str,
             episode_length: int,
             action_repeat: int = 1,
             pixel_shape: Tuple[int, ...] = (),
             pixel_state: str = 'full') -> types.EnvSpec:
  """EnvSpec of the wrapped env: dt is the simulated time of one wrapped step (n_frames x action_repeat);
  `pixel_shape` [H, W, C] of its stacked camera frames with --obs=pixels (`config.pixel_shape(sim)`), else ();
  `pixel_state` (--pixel_state) how much of the state rides beside them (`state_dim`)."""
  if name.startswith(config_lib.PLAYGROUND_PREFIX):
    return _playground().env_spec(name, episode_length, action_repeat)._replace(pixel_shape=tuple(pixel_shape))
  task = load(name)
  if episode_length <= 0 or action_repeat <= 0:
    raise ValueError(f'episode_length={episode_length} and action_repeat={action_repeat} must be > 0.')
  dt = _timestep(task.xml_path) * task.n_frames * action_repeat
  return types.EnvSpec(task=name,
                       obs_dim=state_dim(task, pixel_state) if pixel_shape else task.obs_dim,
                       action_dim=task.action_dim,
                       episode_length=episode_length,
                       dt=dt,
                       pixel_shape=tuple(pixel_shape))


def spec_of(sim: config_lib.SimConfig) -> types.EnvSpec:
  """The EnvSpec of a run's `SimConfig`: its task, episode, action repeat, camera frames and --pixel_state."""
  return env_spec(sim.task, sim.episode_length, sim.action_repeat, config_lib.pixel_shape(sim), sim.pixel_state)


def _params(**kw) -> Mapping[str, float]:
  return dict(kw)  # NOTE: treat as read-only; shared by every pool of the task


_BASIC = ('qpos', 'qvel', 'xpos')
_WALKER_PARAMS = dict(forward_reward_weight=1.0, ctrl_cost_weight=1e-3, healthy_reward=1.0)

_TASKS = (
    TaskDef('ant', 'ant', 'ant.xml', 5, 27, 8, _MJX_NEWTON_1,
            _params(ctrl_cost_weight=0.5, healthy_reward=1.0, healthy_z_min=0.2, healthy_z_max=1.0), _BASIC, False,
            tasks.reset_ant, tasks.obs_ant, tasks.reward_ant),
    TaskDef('halfcheetah', 'halfcheetah', 'half_cheetah.xml', 5, 17, 6, (),
            _params(forward_reward_weight=1.0, ctrl_cost_weight=0.1), _BASIC, False, tasks.reset_halfcheetah,
            tasks.obs_halfcheetah, tasks.reward_halfcheetah),
    TaskDef(
        'hopper', 'hopper', 'hopper.xml', 4, 11, 3, (),
        _params(**_WALKER_PARAMS,
                healthy_z_min=0.7,
                healthy_z_max=float('inf'),
                healthy_angle_min=-0.2,
                healthy_angle_max=0.2,
                healthy_state_min=-100.0,
                healthy_state_max=100.0), _BASIC, False, tasks.reset_hopper, tasks.obs_planar_walker,
        tasks.reward_planar_walker),
    TaskDef(
        'walker2d', 'walker2d', 'walker2d.xml', 4, 17, 6, (),
        _params(**_WALKER_PARAMS, healthy_z_min=0.8, healthy_z_max=2.0, healthy_angle_min=-1.0, healthy_angle_max=1.0),
        _BASIC, False, tasks.reset_walker2d, tasks.obs_planar_walker, tasks.reward_planar_walker),
    TaskDef(
        'humanoid', 'humanoid', 'humanoid.xml', 5, 244, 17, _MJX_NEWTON_1,
        _params(forward_reward_weight=1.25,
                ctrl_cost_weight=0.1,
                healthy_reward=5.0,
                healthy_z_min=1.0,
                healthy_z_max=2.0), ('qpos', 'qvel', 'xpos', 'xipos', 'ximat', 'cvel', 'subtree_com', 'qfrc_actuator'),
        True, tasks.reset_humanoid, tasks.obs_humanoid, tasks.reward_humanoid),
    TaskDef('pusher', 'pusher', 'pusher.xml', 5, 23, 7, (), _params(ctrl_cost_weight=0.1, near_weight=0.5),
            ('qpos', 'qvel', 'xipos'), True, tasks.reset_pusher, tasks.obs_pusher, tasks.reward_pusher),
    TaskDef('reacher', 'reacher', 'reacher.xml', 2, 11, 2, (), _params(),
            ('qpos', 'qvel', 'xpos', 'xmat', 'cvel', 'subtree_com'), False, tasks.reset_reacher, tasks.obs_reacher,
            tasks.reward_reacher),
    TaskDef('inverted_pendulum', 'inverted_pendulum', 'inverted_pendulum.xml', 2, 4, 1, (), _params(max_pole_angle=0.2),
            ('qpos', 'qvel'), True, tasks.reset_inverted_pendulum, tasks.obs_inverted_pendulum,
            tasks.reward_inverted_pendulum),
    # The project's own manipulation task: 4 physics steps of 5 ms per env step, 250 steps (5 s) an episode.
    TaskDef('push_cube',
            'ebrl_push_cube',
            '',
            4,
            manipulation.OBS_DIM,
            manipulation.NU, (),
            manipulation.PARAMS, ('qpos', 'qvel', 'site_xpos'),
            False,
            manipulation.reset_push_cube,
            manipulation.obs_push_cube,
            manipulation.reward_push_cube,
            default_episode_length=250,
            asset_path=manipulation.XML_PATH,
            brax_module='ebrl_jax.sim.manipulation_mjx',
            proprio_dim=manipulation.PROPRIO_DIM),
)

for _task in _TASKS:
  register(_task.name, _task)
assert set(names()) == set(config_lib.TASKS), (names(), config_lib.TASKS)
