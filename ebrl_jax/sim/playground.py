"""MuJoCo Playground envs by name: `--task=playground:CartpoleBalance` (the `playground` extra, PyPI
`playground==0.2.0`, imported as `mujoco_playground`).

    env = playground.make_env('playground:CartpoleBalance', impl='jax')   # a Brax `Env` (one env, unbatched)
    spec = playground.env_spec('playground:CartpoleBalance', episode_length=1000)

The env comes from Playground's own registry (`mujoco_playground.registry.load`) with its config's `impl` set
from our backend (--backend=mjx: 'jax', --backend=mjx_warp: 'warp'), and is adapted to Brax's `Env` API, so
`mjx_env.make_mjx_env` batches and wraps it exactly as it does the project's own tasks (VmapWrapper ->
EpisodeWrapper -> auto-reset or freeze), and every schedule runs it. The adapter maps Playground's `State`
(data, obs, reward, done, metrics, info) to Brax's (`pipeline_state` is Playground's `mjx.Data`).

Observations: an array observation is used as it is. A dict observation (Playground's 'state' /
'privileged_state' pairs, say) becomes one vector: its entries in sorted-key order, each flattened, concatenated
(as float32); `step` splits it back into the dict before calling Playground's step, so nothing is lost.
Episode length is ours (--episode_length; `default_episode_length` reads Playground's config).

Assets: the dm_control-suite envs ship in the wheel and run offline. The locomotion and manipulation envs need
the robot models of mujoco_menagerie, which Playground clones from the network into its package directory
(`mujoco_playground/external_deps/mujoco_menagerie`) the first time one loads. Here a missing copy is a
`PlaygroundAssetsError` naming that path and `EBRL_MENAGERIE_PATH`, which points Playground at a local clone
instead (its `mjx_env.MENAGERIE_PATH`, read whenever an env loads its assets).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Tuple

import jax
from jax import numpy as jnp
import numpy as np

from brax.envs import base as brax_base

from ebrl_jax import config as config_lib
from ebrl_jax import types

PREFIX = config_lib.PLAYGROUND_PREFIX
MENAGERIE_ENV = 'EBRL_MENAGERIE_PATH'
INSTALL_HINT = "pip install -e '.[playground]' (PyPI playground==0.2.0)"


class PlaygroundUnavailableError(ValueError):
  """`mujoco_playground` is not installed (a usage error: one FATAL line naming the flag and the extra)."""


class PlaygroundAssetsError(ValueError):
  """A Playground env needs mujoco_menagerie and there is no local copy."""


def is_playground(task: str) -> bool:
  return task.startswith(PREFIX)


def env_name(task: str) -> str:
  """'playground:CartpoleBalance' -> 'CartpoleBalance'."""
  if not is_playground(task) or not task[len(PREFIX):]:
    raise ValueError(f'--task={task} is not a Playground task; write --task={PREFIX}NAME.')
  return task[len(PREFIX):]


def _modules() -> Tuple[Any, Any]:
  """(mujoco_playground, its mjx_env module), or a PlaygroundUnavailableError."""
  try:
    import mujoco_playground  # lazy: the optional `playground` extra, needed only for a playground: task
    from mujoco_playground._src import mjx_env as pg_mjx_env  # lazy: the same package (MENAGERIE_PATH)
  except ImportError as err:
    raise PlaygroundUnavailableError(f'--task={PREFIX}... needs MuJoCo Playground: {INSTALL_HINT}; '
                                     f'importing it failed: {err}') from err
  return mujoco_playground, pg_mjx_env


def names() -> Tuple[str, ...]:
  """Every env name of Playground's registry."""
  pg, _ = _modules()
  return tuple(pg.registry.ALL_ENVS)


def needs_menagerie(name: str) -> bool:
  """True for the locomotion and manipulation envs (robot models from mujoco_menagerie)."""
  pg, _ = _modules()
  return name in pg.locomotion.ALL_ENVS or name in pg.manipulation.ALL_ENVS


def check_assets(task: str) -> None:
  """Points Playground at $EBRL_MENAGERIE_PATH if set; raises PlaygroundAssetsError (one line) if the env needs
  mujoco_menagerie and no copy is there, before Playground would try to clone it."""
  name = env_name(task)
  pg, pg_mjx_env = _modules()
  if name not in pg.registry.ALL_ENVS:
    raise ValueError(f'--task={task}: Playground has no env {name!r}; its envs: {", ".join(pg.registry.ALL_ENVS)}.')
  if not needs_menagerie(name):
    return
  local = os.environ.get(MENAGERIE_ENV, '')
  if local:
    if not os.path.isdir(local):
      raise PlaygroundAssetsError(f'--task={task} needs mujoco_menagerie; {MENAGERIE_ENV}={local} is not a '
                                  'directory.')
    pg_mjx_env.MENAGERIE_PATH = type(pg_mjx_env.MENAGERIE_PATH)(os.path.abspath(local))
    return
  path = pg_mjx_env.MENAGERIE_PATH
  if not path.exists():
    raise PlaygroundAssetsError(
        f'--task={task} needs the robot models of mujoco_menagerie at {path}, which is missing (Playground clones '
        f'it from the network on first use); set {MENAGERIE_ENV} to a local clone of mujoco_menagerie (commit '
        f'{pg_mjx_env.MENAGERIE_COMMIT_SHA}).')


@functools.lru_cache(maxsize=None)
def load(task: str, impl: str = 'jax'):
  """Playground's env for `task` with MJX implementation `impl` (memoised)."""
  check_assets(task)
  pg, _ = _modules()
  name = env_name(task)
  cfg = pg.registry.get_default_config(name)
  overrides = {'impl': impl} if 'impl' in cfg else None
  return pg.registry.load(name, config=cfg, config_overrides=overrides)


class _ObsLayout:
  """How a Playground observation (an array or a dict of arrays) maps to one float32 vector and back."""

  def __init__(self, example):
    self.is_dict = isinstance(example, dict)
    items = sorted(example.items()) if self.is_dict else [('', example)]
    self.keys = tuple(k for k, _ in items)
    self.shapes = tuple(tuple(v.shape) for _, v in items)
    self.dtypes = tuple(v.dtype for _, v in items)
    self.size = int(sum(np.prod(s, dtype=int) for s in self.shapes))

  def flatten(self, obs) -> jax.Array:
    if not self.is_dict:
      return jnp.reshape(obs, (-1,)).astype(jnp.float32)
    return jnp.concatenate([jnp.reshape(obs[k], (-1,)).astype(jnp.float32) for k in self.keys])

  def unflatten(self, flat: jax.Array):
    if not self.is_dict:
      return jnp.reshape(flat, self.shapes[0]).astype(self.dtypes[0])
    out, start = {}, 0
    for k, shape, dtype in zip(self.keys, self.shapes, self.dtypes):
      n = int(np.prod(shape, dtype=int))
      out[k] = jnp.reshape(flat[start:start + n], shape).astype(dtype)
      start += n
    return out


class PlaygroundEnv(brax_base.Env):
  """A Playground `MjxEnv` behind Brax's `Env` API (one env; Brax's VmapWrapper batches it)."""

  def __init__(self, task: str, impl: str = 'jax'):
    self.task, self.impl = task, impl
    self._env = load(task, impl)
    example = jax.eval_shape(self._env.reset, jax.random.PRNGKey(0)).obs
    self._layout = _ObsLayout(example)

  @property
  def playground_env(self):
    return self._env

  @property
  def observation_size(self) -> int:
    return self._layout.size

  @property
  def action_size(self) -> int:
    return int(self._env.action_size)

  @property
  def backend(self) -> str:
    return 'mjx'

  @property
  def dt(self) -> float:
    return float(self._env.dt)

  def _to_brax(self, state) -> brax_base.State:
    return brax_base.State(pipeline_state=state.data,
                           obs=self._layout.flatten(state.obs),
                           reward=jnp.asarray(state.reward, jnp.float32),
                           done=jnp.asarray(state.done, jnp.float32),
                           metrics=dict(state.metrics),
                           info=dict(state.info))

  def reset(self, rng: jax.Array) -> brax_base.State:
    return self._to_brax(self._env.reset(rng))

  def step(self, state: brax_base.State, action: jax.Array) -> brax_base.State:
    pg, _ = _modules()
    pg_state = pg.State(data=state.pipeline_state,
                        obs=self._layout.unflatten(state.obs),
                        reward=state.reward,
                        done=state.done,
                        metrics=dict(state.metrics),
                        info=dict(state.info))
    return self._to_brax(self._env.step(pg_state, action))


def default_episode_length(task: str) -> int:
  """Playground's own episode length for the env (its config's `episode_length`, else 1000)."""
  pg, _ = _modules()
  return int(pg.registry.get_default_config(env_name(task)).get('episode_length', 1000))


def env_spec(task: str, episode_length: int, action_repeat: int = 1) -> types.EnvSpec:
  """EnvSpec of the wrapped Playground env: obs_dim of the flattened observation, dt its control step x
  action_repeat. Builds the env with impl='jax' (sizes do not depend on the implementation)."""
  if episode_length <= 0 or action_repeat <= 0:
    raise ValueError(f'episode_length={episode_length} and action_repeat={action_repeat} must be > 0.')
  env = PlaygroundEnv(task, 'jax')
  return types.EnvSpec(task=task,
                       obs_dim=env.observation_size,
                       action_dim=env.action_size,
                       episode_length=episode_length,
                       dt=env.dt * action_repeat)
