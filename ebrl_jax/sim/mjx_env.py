"""Brax environments on the MJX backend, wrapped for training.

`make_mjx_env` returns Brax's own env (`brax.envs.get_environment(brax_name, backend='mjx')`) wrapped with
Brax's training wrappers: VmapWrapper -> EpisodeWrapper(episode_length, action_repeat) -> AutoResetWrapper.
With auto_reset=False the last wrapper is `FreezeWhenDoneWrapper` instead (GRPO rolls whole episodes).

NOTE: Brax's AutoResetWrapper restarts a finished env from the initial state that env got at `reset`
(`info['first_pipeline_state']`), not from a fresh random one; the native-MuJoCo pool draws a fresh state.
Call `stages.reset` again to redraw.

impl='warp' (`--backend=mjx_warp`) runs the same Brax env with MJX's Warp implementation doing the physics
(`ebrl_jax.sim.warp`: needs a CUDA GPU and warp-lang, else a `WarpUnavailableError` naming the flag). Its batched
state holds leaves without an env axis (MuJoCo Warp's contact buffer, shared by all envs): select envs with
`where_envs`, never with a plain `jax.tree.map` over the state.

The env is a plain Python object hashed by identity; `make_mjx_env` is memoised so equal arguments give the
same object, which makes it usable as a `jax.jit` static argument without recompiling.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Optional, Tuple

import jax
from jax import numpy as jnp

from brax import envs as brax_envs
from brax.envs import base as brax_base
from brax.envs.wrappers import training as brax_training
from mujoco.mjx._src import io as mjx_io

from ebrl_jax import config as config_lib
from ebrl_jax import config_vision
from ebrl_jax.sim import playground
from ebrl_jax.sim import randomize
from ebrl_jax.sim import registry
from ebrl_jax.sim import render


def _where_batch(mask: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """jnp.where with a [B] mask broadcast over the trailing axes of x, y [B, ...]."""
  return jnp.where(jnp.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim)), x, y)


IMPLS = ('jax', 'warp')
# --backend -> MJX implementation, for the backends that run on MJX.
BACKEND_IMPLS = {'mjx': 'jax', 'mjx_warp': 'warp'}


def impl_for_backend(backend: str) -> str:
  """'jax' for --backend=mjx, 'warp' for --backend=mjx_warp."""
  if backend not in BACKEND_IMPLS:
    raise ValueError(f'--backend={backend} does not run on MJX (MJX backends: {", ".join(BACKEND_IMPLS)}).')
  return BACKEND_IMPLS[backend]


@functools.lru_cache(maxsize=1)
def _warp_non_vmap():
  """(DataWarp class, names of its fields that have no env axis); (None, ()) if MJX lacks them."""
  try:
    from mujoco.mjx.warp import types as mjxw_types  # lazy: MJX releases before 3.17 lack the Warp types
  except ImportError:
    return None, frozenset()
  return mjxw_types.DataWarp, frozenset(mjxw_types.DATA_NON_VMAP)


def _is_warp_data(x) -> bool:
  cls, _ = _warp_non_vmap()
  return cls is not None and isinstance(x, cls)


def _where_node(mask: jax.Array, x, y):
  if not _is_warp_data(x):
    return _where_batch(mask, x, y)
  # MJX-Warp data: the contact buffer and the counters in DATA_NON_VMAP are shared by all envs (no env axis);
  # every physics step rewrites them, so keep y's (the newer state in every caller here), as `mjx.Data.where`.
  _, non_vmap = _warp_non_vmap()
  fields = {}
  for f in dataclasses.fields(x):
    a, b = getattr(x, f.name), getattr(y, f.name)
    fields[f.name] = b if f.name in non_vmap or not hasattr(a, 'shape') else _where_batch(mask, a, b)
  return y.replace(**fields)


def where_envs(mask: jax.Array, x, y):
  """Per-env select between two pytrees whose leaves have a leading batch axis [B, ...]: x where mask, else y.
  Leaves of MJX-Warp data that have no env axis are taken from y."""
  return jax.tree.map(functools.partial(_where_node, mask), x, y, is_leaf=_is_warp_data)


def strong_types(tree):
  """Drops weak types, so that states from `reset` and `step` share one jit signature (else step compiles
  twice: Brax's wrappers return weakly typed done/truncation after a step but not after a reset)."""
  return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype), tree)


class FreezeWhenDoneWrapper(brax_base.Wrapper):
  """Keeps a finished env as it is: no physics, reward 0, done 1; info (truncation, steps) is kept too."""

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    finished = state.done > 0
    nstate = self.env.step(state, action)
    frozen = state.replace(reward=jnp.zeros_like(nstate.reward))
    return where_envs(finished, frozen, nstate)


def finite_rows(tree) -> jax.Array:
  """[B] bool: env b's floating leaves of `tree` (each [B, ...]) are all finite."""
  leaves = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.isfinite(jnp.concatenate(leaves, axis=1)).all(axis=1)


class NonFiniteEndsEpisodeWrapper(brax_base.Wrapper):
  """Ends the episode of an env whose simulation blew up (NaN/inf in its observation or reward): done 1 (a failure),
  reward 0, observation 0, so no NaN reaches the batch and auto-reset starts it afresh; as `cpu_env` ends one whose
  MuJoCo step reset its data on a bad state. Batched: above the vmap wrapper."""

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    state = self.env.step(state, action)
    bad = ~(finite_rows(state.obs) & jnp.isfinite(state.reward))
    obs = jax.tree.map(lambda x: _where_batch(bad, jnp.zeros_like(x), x), state.obs)
    reward, done = jnp.where(bad, 0, state.reward), jnp.where(bad, 1, state.done)
    return state.replace(obs=obs, reward=reward.astype(state.reward.dtype), done=done.astype(state.done.dtype))


class StateSliceWrapper(brax_base.Wrapper):
  """Keeps the first `size` values of every observation (--pixel_state=proprio: the robot's own state beside the
  camera frames, so the policy must see the objects). Sits right above the batching wrapper, so the episode and
  auto-reset wrappers above it (their `first_obs` too) hold the cut observation."""

  def __init__(self, env, size: int):
    super().__init__(env)
    self.size = int(size)

  @property
  def observation_size(self) -> int:
    return self.size

  def reset(self, rng: jax.Array) -> brax_base.State:
    state = self.env.reset(rng)
    return state.replace(obs=state.obs[..., :self.size])

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    nstate = self.env.step(state, action)
    return nstate.replace(obs=nstate.obs[..., :self.size])


def make_mjx_env(task: str,
                 episode_length: int,
                 action_repeat: int = 1,
                 auto_reset: bool = True,
                 impl: str = 'jax',
                 randomization: Optional[config_lib.RandomizationConfig] = None,
                 camera: Optional[render.CameraObs] = None,
                 solver: Tuple[int, int] = (0, 0)) -> brax_base.Wrapper:
  """The wrapped batch env: `reset(keys [B, 2])`, `step(state, actions [B, A])` (Brax's API).

  impl: MJX's implementation of the physics, 'jax' (--backend=mjx) or 'warp' (--backend=mjx_warp; CUDA GPU and
  warp-lang needed). randomization (enabled): each env resets, steps and renders with its own model fields, drawn
  at reset (`PerEnvModel`). camera (impl='warp' only): the env carries a `warp_render.WarpRenderer`
  (`pixel_renderer(env)`) that `sim.stages` renders stacked frames with. solver: (iterations, ls_iterations) caps
  of the constraint solver (0: the task's own; `registry.solver_caps`), as on native MuJoCo. Memoised: equal
  arguments (defaults filled in) give the same env object.
  """
  if randomization is not None and not randomization.enabled:
    randomization = None
  return _make_mjx_env(task, int(episode_length), int(action_repeat), bool(auto_reset), impl, randomization, camera,
                       tuple(int(c) for c in solver))


def pixel_renderer(env):
  """The env's `warp_render.WarpRenderer` (built with a camera), else None."""
  while env is not None:
    renderer = vars(env).get('renderer')
    if renderer is not None:
      return renderer
    env = vars(env).get('env')
  return None


class PerEnvModel:
  """Each env's own model fields (domain randomisation) for the unbatched Brax env `env`: `reset(rng [B, 2])`
  draws them per env from its reset key folded with `randomize.KEY_PURPOSE`, resets each env with its own model
  (so its initial kinematics, e.g. the camera pose MJX-Warp's renderer reads from the data, are the drawn ones)
  and keeps them in `state.info[randomize.INFO_KEY]` ([B, ...] each); `step` vmaps the env's step over them (the
  model's fields with in_axes 0, the rest shared). An auto-reset keeps them (Brax's AutoResetWrapper restores the
  physics state only), a `reset` redraws them. Both MJX implementations take per-env model fields this way: MJX-JAX
  as any vmapped array, MJX-Warp by giving each world its row of a field with a leading env axis.

  NOTE: the fields reach Brax's env by swapping `env.unwrapped.sys` while one env's reset or step traces (Brax's
  pipeline reads `self.sys`); a lock keeps two threads tracing the same env from seeing each other's swap. Read
  the model through `model(state)`, never `env.unwrapped.sys`, beside a trace."""

  def __init__(self, env, randomization: config_lib.RandomizationConfig):
    self.env, self.randomization = env, randomization
    self.sys = env.unwrapped.sys  # the model's own values
    self._base = randomize.base_fields(randomization, self.sys)
    self._lock = threading.RLock()

  def draw(self, rng: jax.Array) -> dict:
    """One env's randomised fields from its reset key [2]."""
    key = jax.random.fold_in(rng, randomize.KEY_PURPOSE)
    shapes = randomize.draw_shapes(self.randomization, self._base)
    uniforms = {
        name: jax.random.uniform(jax.random.fold_in(key, i), shape) for i, (name, shape) in enumerate(shapes.items())
    }
    return randomize.apply(self.randomization, self._base, uniforms, xp=jnp)

  @contextlib.contextmanager
  def _swapped(self, fields: dict):
    with self._lock:
      unwrapped = self.env.unwrapped
      unwrapped.sys = self.sys.replace(**fields)  # read by pipeline_init / pipeline_step while this traces
      try:
        yield
      finally:
        unwrapped.sys = self.sys

  def _reset_one(self, rng: jax.Array) -> brax_base.State:
    fields = self.draw(rng)
    with self._swapped(fields):
      state = self.env.reset(rng)
    state.info[randomize.INFO_KEY] = fields
    return state

  def _step_one(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    with self._swapped(state.info[randomize.INFO_KEY]):
      return self.env.step(state, action)

  def reset(self, rng: jax.Array) -> brax_base.State:
    return jax.vmap(self._reset_one)(rng)

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    return jax.vmap(self._step_one)(state, action)

  def model(self, state: brax_base.State):
    """The batched env's System with the randomised fields of `state`'s envs ([B, ...] each, the rest shared):
    what MJX-Warp's renderer reads (it indexes a field with a leading env axis by env)."""
    return self.sys.replace(**state.info[randomize.INFO_KEY])


class RandomizedVmapWrapper(brax_training.VmapWrapper):
  """Brax's VmapWrapper with a model per env (`PerEnvModel`), for MJX's JAX implementation. (MJX-Warp's
  `warp.WarpVmapWrapper` takes a `PerEnvModel` likewise.)"""

  def __init__(self, env, randomization: config_lib.RandomizationConfig):
    super().__init__(env)
    self.per_env_model = PerEnvModel(env, randomization)

  def reset(self, rng: jax.Array) -> brax_base.State:
    return self.per_env_model.reset(rng)

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    return self.per_env_model.step(state, action)


def per_env_model(env) -> Optional[PerEnvModel]:
  """The `PerEnvModel` of a randomised batched env, else None."""
  return vars(_vmap_wrapper(env)).get('per_env_model')


def model_fields(env, state: brax_base.State) -> dict:
  """The randomised model fields ([B, ...] each) the envs of `state` step (and render) with; {} for an env
  without randomisation."""
  if per_env_model(env) is None:
    return {}
  return dict(state.info[randomize.INFO_KEY])


def render_model(env, state: brax_base.State):
  """The System a renderer reads for the envs of `state`: the env's own, with the randomised fields per env."""
  per_env = per_env_model(env)
  return env.unwrapped.sys if per_env is None else per_env.model(state)


def _vmap_wrapper(env):
  while not isinstance(env, brax_training.VmapWrapper) and hasattr(env, 'env'):
    env = env.env
  return env


class WhereAutoResetWrapper(brax_training.AutoResetWrapper):
  """Brax's AutoResetWrapper selecting with `where_envs`, so that leaves without an env axis (MJX-Warp's shared
  contact buffer) are kept rather than broadcast against `done`."""

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    if 'steps' in state.info:
      state.info.update(steps=jnp.where(state.done, jnp.zeros_like(state.info['steps']), state.info['steps']))
    state = state.replace(done=jnp.zeros_like(state.done))
    state = self.env.step(state, action)
    done = state.done > 0
    pipeline_state = where_envs(done, state.info['first_pipeline_state'], state.pipeline_state)
    obs = where_envs(done, state.info['first_obs'], state.obs)
    return state.replace(pipeline_state=pipeline_state, obs=obs)


def _mjx_on_local_devices() -> None:
  """MJX puts a model or data that it is given no device for on `jax.devices()[0]` (mujoco.mjx's io: Brax's
  `mjcf.load` and its pipeline's `make_data` name none). In a process of several joined by `jax.distributed` (a
  trainer rank that steps MJX envs: controller/cells.py) that is process 0's device, which this process cannot
  address: JAX then refuses the env's programs ('Closing over jax.Array that spans non-addressable ... devices').
  There MJX's choice becomes this process's own first device of the same platform; one process is unchanged.
  Idempotent; starts no backend (the device is looked at only when MJX resolves one). A MuJoCo without that
  resolver (another release) is left as it is: one process runs alike, cells of several may meet the error above."""
  resolve = getattr(mjx_io, '_resolve_impl_and_device', None)
  if resolve is None or getattr(resolve, 'local_devices_only', False):
    return

  def local(impl, device=None):
    named = device is not None
    impl, device = resolve(impl, device)
    if not named and device.process_index != jax.process_index():
      device = jax.local_devices(backend=device.platform)[0]
    return impl, device

  local.local_devices_only = True
  mjx_io._resolve_impl_and_device = local  # pylint: disable=protected-access


def _load_brax_mjx_env(brax_name: str, solver: Tuple[int, int]) -> brax_base.Env:
  """Brax's env of a task on MJX (JAX), its solver capped."""
  env = brax_envs.get_environment(brax_name, backend='mjx')
  if caps := registry.cap_fields(solver):
    env.sys = env.sys.tree_replace({f'opt.{k}': v for k, v in caps.items()})
  return env


# One per task and caps in a process, shared by the training and evaluation envs without randomisation: loading
# the model is hundreds of small eager transfers and copies (with tensorboardX's torch import gone in the same
# change, W1's warm env build on the H200 went from 6.9 to 3.3 s: results/startup_notorch_h200.json). Their
# wrappers keep no state in the inner env.
_shared_brax_mjx_env = functools.lru_cache(maxsize=None)(_load_brax_mjx_env)


@functools.lru_cache(maxsize=None)
def _make_mjx_env(task: str, episode_length: int, action_repeat: int, auto_reset: bool, impl: str,
                  randomization: Optional[config_lib.RandomizationConfig], camera: Optional[render.CameraObs],
                  solver: Tuple[int, int]) -> brax_base.Wrapper:
  task_def = None if playground.is_playground(task) else registry.load(task)
  _mjx_on_local_devices()
  if episode_length <= 0 or action_repeat <= 0:
    raise ValueError(f'episode_length={episode_length} and action_repeat={action_repeat} must be > 0.')
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not an MJX implementation; allowed: {', '.join(IMPLS)} "
                     "(--backend=mjx is 'jax', --backend=mjx_warp is 'warp').")
  if camera is not None and impl != 'warp':
    raise ValueError(f'--obs=pixels on --backend=mjx: {config_vision.NO_JAX_RENDERING}; use --backend=mjx_warp '
                     "(CUDA GPU) or --backend=mujoco_cpu (native MuJoCo's renderer).")
  if camera is not None and task_def is None:
    raise ValueError(f'--obs=pixels is not wired for --task={task} (Playground envs render in their own vision '
                     'configs).')
  if task_def is None:  # a Playground env: batched like ours; its config's impl does the physics
    if randomization is not None:
      raise ValueError(f'--randomize is not wired for --task={task} (Playground ships its own randomisers).')
    if registry.cap_fields(solver):
      raise ValueError(f'solver caps {solver} are not wired for --task={task} (its config sets its solver).')
    if impl == 'warp':
      from ebrl_jax.sim import warp as warp_lib  # lazy: imports mujoco.mjx.warp; only --backend=mjx_warp needs it
      warp_lib.check_available()
    env = brax_training.VmapWrapper(playground.PlaygroundEnv(task, impl))
  elif impl == 'warp':
    from ebrl_jax.sim import warp as warp_lib  # lazy: imports mujoco.mjx.warp; only --backend=mjx_warp needs it
    from ebrl_jax.sim import warp_render  # lazy: as above
    env = warp_lib.make_brax_env(task_def.brax_name, opt_overrides=registry.cap_fields(solver))
    renderer = None if camera is None else warp_render.WarpRenderer(warp_lib.pipeline_of(env).mj_model, camera)
    per_env = None if randomization is None else PerEnvModel(env, randomization)
    env = warp_lib.WarpVmapWrapper(env, renderer=renderer, per_env_model=per_env)
    state_size = task_def.obs_dim if camera is None else registry.state_dim(task_def, camera.state)
    if state_size < task_def.obs_dim:
      env = StateSliceWrapper(env, state_size)
  else:
    if randomization is None:
      env = brax_training.VmapWrapper(_shared_brax_mjx_env(task_def.brax_name, solver))
    else:  # its own: PerEnvModel swaps the inner env's model while it traces
      env = RandomizedVmapWrapper(_load_brax_mjx_env(task_def.brax_name, solver), randomization)
  env = brax_training.EpisodeWrapper(NonFiniteEndsEpisodeWrapper(env), episode_length, action_repeat)
  if auto_reset:
    return WhereAutoResetWrapper(env) if impl == 'warp' else brax_training.AutoResetWrapper(env)
  return FreezeWhenDoneWrapper(env)


make_mjx_env.cache_info = _make_mjx_env.cache_info
make_mjx_env.cache_clear = lambda: (_make_mjx_env.cache_clear(), _shared_brax_mjx_env.cache_clear())


def env_impl(env: brax_base.Env) -> str:
  """'warp' if the env's physics runs on MJX-Warp, else 'jax'."""
  unwrapped = env.unwrapped
  if isinstance(unwrapped, playground.PlaygroundEnv):
    return unwrapped.impl
  return 'warp' if type(getattr(unwrapped, '_pipeline', None)).__name__ == 'WarpPipeline' else 'jax'


def is_auto_reset(env: brax_base.Env) -> bool:
  return isinstance(env, brax_training.AutoResetWrapper)
