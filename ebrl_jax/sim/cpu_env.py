"""Native MuJoCo backend: a pool of independent envs on one `MjModel`, stepped by a thread pool.

The model is the one Brax's MJX backend steps: the same xml loaded through Brax's loader (which fuses
jointless bodies into their parents), the same MjOption overrides and the same frame skip. Observations,
rewards and terminations are the numpy functions of `ebrl_jax.sim.tasks`, evaluated over the batch.

Episode semantics (shared with `ebrl_jax.sim.stages`):
  * An env step is `action_repeat` Brax env steps with the same action; each is `n_frames` physics steps.
    As in Brax's EpisodeWrapper the rewards of the repeats are summed and `done` is that of the last repeat.
  * An episode is cut when its step count (which advances by `action_repeat` per env step) reaches
    `episode_length`: done=1 and truncation=1 unless it also failed on that step.
  * A chunk of K actions (`actions` [N, K, A]) executes up to K env steps per env; an env stops at its first
    done within the chunk. reward sums the executed steps, truncation/episode_* are those of that done.
  * auto_reset=True: an env that is done starts a fresh episode from a new random initial state (drawn
    individually, so groups are not kept); the returned obs is that reset observation.
    auto_reset=False: a finished env is frozen until `reset()`: it is not stepped and returns its final obs,
    reward 0, done 1, the truncation and episode_return/episode_length of its finished episode.
  * episode_length counts Brax env steps (so it includes action_repeat), like Brax's episode metrics.

NOTE: the pool is not thread-safe in general: call it from one thread, except that `step` calls with disjoint
`env_ids` may run concurrently from several threads (a rollout worker's env slices do): every array they touch
is indexed by env, and auto-reset draws from a `np.random.Generator`, which serialises its draws (their order,
and so which initial state an env gets, then depends on timing). Its own worker threads each step a disjoint
slice of envs and write disjoint rows of the preallocated buffers.
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Dict, Optional, Sequence, Tuple

import mujoco
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types
from ebrl_jax.sim import randomize
from ebrl_jax.sim import registry
from ebrl_jax.sim import render
from ebrl_jax.sim import tasks


def load_model(task: registry.TaskDef, solver: Tuple[int, int] = (0, 0)) -> mujoco.MjModel:
  """The task's MjModel as Brax builds it for backend='mjx' (fused bodies, option overrides), with the solver caps
  `solver` = (iterations, ls_iterations) (0: the task's; `registry.solver_caps`)."""
  from brax.io import mjcf  # pylint: disable=g-import-not-at-top  # Brax's loader fuses jointless bodies
  model = mjcf.load_mjmodel(task.xml_path)
  for field, value in registry.solver_caps(task, solver):
    setattr(model.opt, field, value)
  return model


_MEMORY_SAMPLE = 64  # envs made to measure one env's resident footprint


def _resident_bytes() -> int:
  """This process's resident memory (/proc/self/statm), 0 where it cannot be read."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return 0


def available_host_bytes() -> Optional[int]:
  """MemAvailable of /proc/meminfo (Linux): what can be allocated without swapping; None where unknown."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def check_host_memory(task: str, model: mujoco.MjModel, num_envs: int, per_env_model: bool, counted: str = '') -> None:
  """Refuses (ValueError naming --num_envs) a pool whose envs would not fit the host's available memory, measured
  on the first `_MEMORY_SAMPLE` envs (an MjData each, and a model copy each with `per_env_model`): far too many
  envs otherwise grow the process until the kernel's OOM killer ends it, and maybe others, without a word. An env
  counts at least its MjData's buffer (`nbuffer`): in a process that freed memory before, the sample may reuse it.
  `counted` says what the `num_envs` are when they are more than one pool's (the message's parenthesis)."""
  available, first = available_host_bytes(), min(num_envs, _MEMORY_SAMPLE)
  if available is None:
    return
  before = _resident_bytes()
  sample = [(mujoco.MjData(model), model.__copy__() if per_env_model else None) for _ in range(first)]
  per_env = max((_resident_bytes() - before) / first, model.nbuffer)
  del sample
  if per_env * num_envs > available:
    raise ValueError(f'--num_envs: {num_envs:,} native MuJoCo envs of {task}{counted} would take about '
                     f'{per_env * num_envs / 2**30:,.1f} GiB of host memory ({per_env / 1024:,.0f} KiB each, measured '
                     f'on {first}), more than the {available / 2**30:.1f} GiB this machine has available; lower '
                     '--num_envs (or --num_eval_envs, for the evaluation envs).')


# MuJoCo's warnings for a state it found NaN, infinite or huge, after which its step resets the env's data itself.
_BAD_STATE = (mujoco.mjtWarning.mjWARN_BADQPOS, mujoco.mjtWarning.mjWARN_BADQVEL, mujoco.mjtWarning.mjWARN_BADQACC)


def _step_slice(models, datas, ids, ctrl, nstep, frame, fields, unstable) -> None:
  """Steps envs `ids` (ctrl [len(ids), A]), gathers their data fields into `frame` rows and marks in `unstable`
  those whose simulation blew up on the way (MuJoCo reset their data: the frame is not the episode's)."""
  for j, i in enumerate(ids):
    d = datas[i]
    d.ctrl[:] = ctrl[j]
    for w in _BAD_STATE:  # a reset clears them; counted from 0 each step
      d.warning[w].number = 0
    mujoco.mj_step(models[i], d, nstep)  # releases the GIL
    unstable[i] = any(d.warning[w].number for w in _BAD_STATE)
    for f in fields:
      frame[f][i] = getattr(d, f)


class CpuEnvPool:
  """`num_envs` native-MuJoCo envs of one task; numpy in, numpy out (obs float32).

  With `camera`, each env also renders stacked camera frames after every reset and step: `pixels()`
  (see `ebrl_jax.sim.render`). With `randomization` enabled, each env steps (and renders) its own copy of the
  model, whose fields `reset` redraws (`ebrl_jax.sim.randomize`); `env_model(i)` is env i's model.
  """

  def __init__(self,
               task: str,
               num_envs: int,
               episode_length: int,
               action_repeat: int = 1,
               num_threads: int = 0,
               seed: int = 0,
               group_size: int = 1,
               auto_reset: bool = True,
               camera: Optional[render.CameraObs] = None,
               randomization: Optional[config_lib.RandomizationConfig] = None,
               solver: Tuple[int, int] = (0, 0)):
    for field, value in (('num_envs', num_envs), ('episode_length', episode_length), ('action_repeat', action_repeat),
                         ('group_size', group_size)):
      if value <= 0:
        raise ValueError(f'CpuEnvPool: {field}={value} must be > 0.')
    if num_envs % group_size:
      raise ValueError(f'CpuEnvPool: num_envs={num_envs} must be a multiple of group_size={group_size}.')
    if num_threads < 0:
      raise ValueError(f'CpuEnvPool: num_threads={num_threads} must be >= 0 (0: one per available core).')
    if not isinstance(seed, (int, np.integer)) or seed < 0:  # numpy's generators take no negative seed
      raise ValueError(f'CpuEnvPool: seed={seed!r} must be an integer >= 0.')
    self._task = registry.load(task)
    self._spec = (registry.env_spec(task, episode_length, action_repeat) if camera is None else registry.env_spec(
        task, episode_length, action_repeat, camera.shape, camera.state))
    self.num_envs, self.episode_length, self.action_repeat = num_envs, episode_length, action_repeat
    self.group_size, self.auto_reset = group_size, auto_reset
    self.model = load_model(self._task, solver)
    self._consts = tasks.make_consts(self.model, self._task.n_frames, self._task.params)
    self.randomization = randomization if randomization is not None and randomization.enabled else None
    check_host_memory(task, self.model, num_envs, self.randomization is not None)
    if self.randomization is None:
      self._models = [self.model] * num_envs
    else:
      self._models = [self.model.__copy__() for _ in range(num_envs)]  # deep copies (mj_copyModel)
      self._base_fields = {f: v.copy() for f, v in randomize.base_fields(self.randomization, self.model).items()}
      self._randomize_rng = np.random.default_rng(np.random.SeedSequence((seed, randomize.KEY_PURPOSE)))
    self._datas = [mujoco.MjData(self.model) for _ in range(num_envs)]
    self._fields = self._task.data_fields
    self._frame: Dict[str, np.ndarray] = {
        f: np.zeros((num_envs,) + getattr(self._datas[0], f).shape) for f in self._fields
    }
    self._steps = np.zeros(num_envs, np.int64)
    self._unstable = np.zeros(num_envs, bool)  # the last physics step blew up (`_step_slice`)
    self._return = np.zeros(num_envs, np.float64)
    self._length = np.zeros(num_envs, np.int64)
    self._finished = np.zeros(num_envs, bool)  # auto_reset=False only
    self._final_truncation = np.zeros(num_envs, bool)
    self._rng = np.random.default_rng(seed)
    self.num_threads = min(num_threads or len(os.sched_getaffinity(0)), num_envs)
    self._executor = (concurrent.futures.ThreadPoolExecutor(self.num_threads, thread_name_prefix='mj_step')
                      if self.num_threads > 1 else None)
    models = self._models if self.randomization is not None else None
    self._pixels = render.PixelRenderer(self.model, camera, num_envs, models) if camera is not None else None
    self.reset()

  # -------------------------------------------------------------------------------------------- properties
  @property
  def spec(self) -> types.EnvSpec:
    return self._spec

  @property
  def task(self) -> registry.TaskDef:
    return self._task

  def env_model(self, env_id: int) -> mujoco.MjModel:
    """The MjModel env `env_id` steps with (the shared `model` unless randomised)."""
    return self._models[int(self._ids([env_id])[0])]

  def model_fields(self, env_ids: Optional[Sequence[int]] = None) -> Dict[str, np.ndarray]:
    """The randomised model fields of envs `env_ids` (all by default), [n, ...] each, as the envs step and render
    with them (`mjx_env.model_fields` is the MJX twin); {} without randomisation."""
    if self.randomization is None:
      return {}
    ids = self._ids(env_ids)
    return {
        f: np.stack([getattr(self._models[i], f).copy() for i in ids]) for f in randomize.fields_of(self.randomization)
    }

  # ------------------------------------------------------------------------------------------------ state
  def _ids(self, env_ids) -> np.ndarray:
    if env_ids is None:
      return np.arange(self.num_envs)
    ids = np.asarray(env_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.num_envs):
      raise ValueError(f'env_ids must lie in [0, {self.num_envs}); got {ids.tolist()}.')
    if np.unique(ids).size != ids.size:
      raise ValueError(f'env_ids must not repeat; got {ids.tolist()}.')
    return ids

  def _set(self, ids: np.ndarray, qpos: np.ndarray, qvel: np.ndarray) -> None:
    """Puts envs `ids` at (qpos, qvel) as a fresh episode; data fields are recomputed with mj_forward."""
    for j, i in enumerate(ids):
      d = self._datas[i]
      mujoco.mj_resetData(self._models[i], d)  # zero ctrl, time and solver warm start, like mjx.make_data
      d.qpos[:] = qpos[j]
      d.qvel[:] = qvel[j]
      mujoco.mj_forward(self._models[i], d)
      for f in self._fields:
        self._frame[f][i] = getattr(d, f)
    self._steps[ids] = 0
    self._return[ids] = 0.0
    self._length[ids] = 0
    self._finished[ids] = False
    self._final_truncation[ids] = False
    if self._pixels is not None:
      self._pixels.reset(ids, self._datas)

  def _draw(self, ids: np.ndarray, grouped: bool) -> None:
    groups = ids // self.group_size if grouped else ids
    uniq, inverse = np.unique(groups, return_inverse=True)
    qpos, qvel = self._task.reset_fn(self._rng, uniq.size, self._consts)
    if grouped and self.randomization is not None:
      self._randomize(ids, uniq.size, inverse)
    self._set(ids, qpos[inverse], qvel[inverse])

  def _randomize(self, ids: np.ndarray, num_draws: int, inverse: np.ndarray) -> None:
    """New model fields for envs `ids`: `num_draws` draws, env ids[j] taking draw inverse[j] (a group's envs
    share one)."""
    cfg, base = self.randomization, self._base_fields
    draws = [randomize.apply(cfg, base, randomize.draw_numpy(cfg, base, self._randomize_rng)) for _ in range(num_draws)]
    for j, i in enumerate(ids):
      for field, value in draws[inverse[j]].items():
        getattr(self._models[i], field)[:] = value

  def _obs(self, ids: np.ndarray) -> np.ndarray:
    frame = {f: v[ids] for f, v in self._frame.items()}
    obs = self._task.obs_fn(frame, self._consts).astype(np.float32)
    if obs.shape[-1] != self._spec.obs_dim:  # --pixel_state=proprio: the task's proprioceptive prefix
      obs = np.ascontiguousarray(obs[:, :self._spec.obs_dim])
    return obs

  def reset(self, env_ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """New episodes for `env_ids` (all by default); envs of one group (env_id // group_size) share their
    initial state. Returns obs [len(env_ids), O]."""
    ids = self._ids(env_ids)
    self._draw(ids, grouped=True)
    return self._obs(ids)

  def set_state(self, env_ids: Sequence[int], qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
    """Starts a fresh episode of envs `env_ids` at qpos [n, nq], qvel [n, nv]; returns their obs [n, O]."""
    ids = self._ids(env_ids)
    qpos, qvel = np.asarray(qpos, np.float64), np.asarray(qvel, np.float64)
    for name, x, width in (('qpos', qpos, self.model.nq), ('qvel', qvel, self.model.nv)):
      if x.shape != (ids.size, width):  # a reshape would take a transposed or flat array without a word
        raise ValueError(f'CpuEnvPool.set_state: {name} must be [len(env_ids), {"nq" if name == "qpos" else "nv"}] '
                         f'= ({ids.size}, {width}); got shape {x.shape}.')
    self._set(ids, qpos, qvel)
    return self._obs(ids)

  def get_state(self, env_ids: Optional[Sequence[int]] = None) -> Tuple[np.ndarray, np.ndarray]:
    ids = self._ids(env_ids)
    qpos = np.stack([self._datas[i].qpos.copy() for i in ids]) if ids.size else np.zeros((0, self.model.nq))
    qvel = np.stack([self._datas[i].qvel.copy() for i in ids]) if ids.size else np.zeros((0, self.model.nv))
    return qpos, qvel

  # ------------------------------------------------------------------------------------------------- step
  def _physics(self, ids: np.ndarray, ctrl: np.ndarray) -> None:
    args = (self._models, self._datas)
    tail = (self._task.n_frames, self._frame, self._fields, self._unstable)
    if self._executor is None or ids.size < 2:
      _step_slice(*args, ids, ctrl, *tail)
      return
    bounds = np.linspace(0, ids.size, min(self.num_threads, ids.size) + 1).astype(int)
    futures = [
        self._executor.submit(_step_slice, *args, ids[lo:hi], ctrl[lo:hi], *tail)
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    for fut in futures:
      fut.result()  # re-raises a worker's exception

  def _env_step(self, ids: np.ndarray, action: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One (action-repeated) env step of envs `ids`; returns reward [n] and failure [n] of the last repeat. An env
    whose simulation blew up (MuJoCo reset its data) fails, its rewards from that repeat on 0: MJX's envs end the
    same way (`mjx_env.NonFiniteEndsEpisodeWrapper`), and a reward measured across MuJoCo's reset is not one."""
    ctrl = tasks.scale_to_ctrl_range(action, self._consts) if self._task.scale_actions else action
    reward, unstable = np.zeros(ids.size), np.zeros(ids.size, bool)
    for _ in range(self.action_repeat):
      before = {f: v[ids] for f, v in self._frame.items()}
      self._physics(ids, ctrl)
      after = {f: v[ids] for f, v in self._frame.items()}
      r, failed = self._task.reward_fn(before, after, ctrl, self._consts)
      unstable |= self._unstable[ids]
      reward += np.where(unstable, 0.0, r)
    return reward, failed | unstable

  def step(self, actions: np.ndarray, env_ids: Optional[Sequence[int]] = None) -> types.StepResult:
    """Steps envs `env_ids` (all by default) with actions [n, A] or a chunk [n, K, A].

    Returns a StepResult of numpy arrays over those envs: obs [n, O] float32; reward, done, truncation,
    episode_return [n] float32; episode_length [n] int32 (see the module docstring for the semantics).
    """
    ids = self._ids(env_ids)
    n, a = ids.size, self._spec.action_dim
    actions = np.asarray(actions, np.float64)
    if actions.ndim not in (2, 3) or actions.shape[0] != n or actions.shape[-1] != a or 0 in actions.shape[1:-1]:
      raise ValueError(f'CpuEnvPool.step: actions must be [num_envs, action_size] = ({n}, {a}) or a chunk '
                       f'[num_envs, K, action_size] = ({n}, K, {a}), K >= 1 ({n} envs stepped); got shape '
                       f'{actions.shape}.')
    if actions.ndim == 2:
      actions = actions[:, None]
    running = ~self._finished[ids]
    stepped = running.copy()
    reward, done = np.zeros(n), self._finished[ids].copy()
    truncation = self._final_truncation[ids].copy()
    ep_return, ep_length = np.zeros(n), np.zeros(n, np.int64)
    for k in range(actions.shape[1]):
      pos = np.flatnonzero(running)
      if not pos.size:
        break
      sub = ids[pos]
      r, failed = self._env_step(sub, actions[pos, k])
      self._steps[sub] += self.action_repeat
      self._return[sub] += r
      self._length[sub] += self.action_repeat
      reward[pos] += r
      timeout = self._steps[sub] >= self.episode_length
      ended = failed | timeout
      fin_pos, fin_ids = pos[ended], sub[ended]
      done[fin_pos] = True
      truncation[fin_pos] = timeout[ended] & ~failed[ended]
      ep_return[fin_pos], ep_length[fin_pos] = self._return[fin_ids], self._length[fin_ids]
      running[fin_pos] = False
      if self.auto_reset:
        self._draw(fin_ids, grouped=False)
      else:
        self._finished[fin_ids] = True
        self._final_truncation[fin_ids] = truncation[fin_pos]
    # Frozen (auto_reset=False) and still-running envs report their current totals.
    keep = ~done | self._finished[ids]
    ep_return[keep], ep_length[keep] = self._return[ids[keep]], self._length[ids[keep]]
    if self._pixels is not None:  # a frame for each env stepped here; an auto-reset one holds its reset stack
      self._pixels.push(ids[stepped & ~(done & self.auto_reset)], self._datas)
    return types.StepResult(obs=self._obs(ids),
                            reward=reward.astype(np.float32),
                            done=done.astype(np.float32),
                            truncation=truncation.astype(np.float32),
                            episode_return=ep_return.astype(np.float32),
                            episode_length=ep_length.astype(np.int32))

  def pixels(self, env_ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """Camera frames of envs `env_ids` as of their last reset or step: [n, H, W, C * frame_stack] uint8."""
    if self._pixels is None:
      raise ValueError('CpuEnvPool.pixels needs a pool built with camera=render.CameraObs(...).')
    return self._pixels.frames(self._ids(env_ids))

  # -------------------------------------------------------------------------------------------- lifecycle
  def close(self) -> None:
    if getattr(self, '_pixels', None) is not None:
      self._pixels.close()
      self._pixels = None
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None

  def __enter__(self) -> 'CpuEnvPool':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # interpreter shutdown
      pass
