"""Camera observations for the native-MuJoCo pool: `mujoco.Renderer` frames of a fixed MJCF camera, stacked.

    camera = render.CameraObs(camera='fixed', height=64, width=64, frame_stack=3)
    pool = cpu_env.CpuEnvPool('push_cube', 8, 250, camera=camera)
    pixels = pool.pixels()                         # [8, 64, 64, 3 * 3] uint8, the newest frame last

A frame is RGB uint8 [H, W, 3], plus one uint8 depth channel with `depth=True` (metres * 255 / depth_max,
clipped). The stack of an env holds its last `frame_stack` frames along the channel axis, oldest first; a
reset fills it with the reset frame. The pool renders one frame per env each time it returns an observation
(after `reset`/`set_state` and after each `step`, so a chunk of K actions adds one frame, not K).

OpenGL: MuJoCo picks its GL backend from MUJOCO_GL when `mujoco` is first imported. Headless, set
MUJOCO_GL=egl (Mesa's libEGL on a CPU machine: apt libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0; the
NVIDIA driver's on a GPU machine) or MUJOCO_GL=osmesa (apt libosmesa6) before Python imports mujoco, or call
`select_gl_backend` before the first renderer. Unset, MuJoCo uses GLFW, which needs a display: `PixelRenderer`
then fails with a message that says so.

Threads: a GL context is current to one thread at a time, and `mujoco.Renderer` makes its context current in
the thread that calls it (its `close` frees GL objects in whatever context is current there). So each
renderer here lives in a render thread of its own (a one-worker executor) that creates, uses and closes it;
callers in any thread (the pool's env slices may step concurrently) hand work to those threads. One renderer
shared by callers would need a lock and a context switch per call, and could not render in parallel.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import os
from typing import List, Optional, Sequence, Tuple

import mujoco
import numpy as np


@dataclasses.dataclass(frozen=True)
class CameraObs:
  """Pixel observations from the MJCF camera `camera`: [H, W, channels * frame_stack] uint8 per env."""
  camera: str = 'fixed'
  height: int = 64
  width: int = 64
  frame_stack: int = 1
  depth: bool = False  # add a depth channel (uint8, 0..depth_max metres) to each frame
  depth_max: float = 2.0
  num_threads: int = 1  # render threads, each owning one mujoco.Renderer
  state: str = 'full'  # the state beside the frames: the task's whole observation or its proprio prefix (--pixel_state)

  def __post_init__(self):
    for field in ('height', 'width', 'frame_stack', 'num_threads'):
      if getattr(self, field) <= 0:
        raise ValueError(f'CameraObs: {field}={getattr(self, field)} must be > 0.')
    if not self.depth_max > 0:
      raise ValueError(f'CameraObs: depth_max={self.depth_max} must be > 0.')

  @property
  def channels(self) -> int:
    """Channels of one frame: RGB, and depth if asked for."""
    return 3 + int(self.depth)

  @property
  def shape(self) -> Tuple[int, int, int]:
    """[H, W, C * frame_stack] of one env's stacked observation."""
    return (self.height, self.width, self.channels * self.frame_stack)


def camera_of(sim) -> Optional[CameraObs]:
  """The camera of a run's `config.SimConfig` with --obs=pixels: square frames of --image_size, --frame_stack of
  them, with a depth channel under --pixel_depth; None with --obs=state. Both pixel backends build it here."""
  if sim.obs != 'pixels':
    return None
  return CameraObs(height=sim.image_size,
                   width=sim.image_size,
                   frame_stack=sim.frame_stack,
                   depth=sim.pixel_depth,
                   state=sim.pixel_state)


def stack_frames(stack, frame, xp=np):
  """The stack [..., H, W, C * S] with its oldest frame dropped and `frame` [..., H, W, C] appended last (`xp`:
  numpy here, `jax.numpy` in the MJX-Warp simulation stage)."""
  channels = frame.shape[-1]
  if stack.shape[-1] % channels or stack.shape[:-1] != frame.shape[:-1]:
    raise ValueError(f'stack {stack.shape} must be frames {frame.shape} stacked on the last axis.')
  return xp.concatenate([stack[..., channels:], frame], axis=-1)


def fill_stack(frame, frame_stack: int, xp=np):
  """A stack [..., H, W, C * frame_stack] of copies of `frame` [..., H, W, C] (what a reset starts from)."""
  return xp.concatenate([frame] * frame_stack, axis=-1)


def next_stacks(stack, frame, keep, refill, xp=np):
  """The stacks [B, H, W, C * S] after one observation of B envs, as `PixelRenderer` updates them: env b keeps
  its stack where keep[b] (it was already frozen and did not step), is refilled with `frame` [B, H, W, C] where
  refill[b] (an auto-reset restarted it: its reset frame), else gets `frame` appended (oldest dropped)."""

  def per_env(mask):
    return xp.reshape(xp.asarray(mask, bool), (-1,) + (1,) * (stack.ndim - 1))

  fresh = xp.where(per_env(refill), fill_stack(frame, stack.shape[-1] // frame.shape[-1], xp),
                   stack_frames(stack, frame, xp))
  return xp.where(per_env(keep), stack, fresh)


def depth_to_uint8(depth, depth_max: float, xp=np):
  """Depth in metres [..., H, W] -> uint8 [..., H, W, 1]: round(255 * depth / depth_max), clipped to 0..255."""
  return xp.round(xp.clip(depth / depth_max, 0.0, 1.0) * 255.0).astype(xp.uint8)[..., None]


def gl_backend() -> str:
  """The GL backend mujoco loaded: 'egl', 'osmesa', 'glfw', ... ('' if rendering is disabled)."""
  context = getattr(mujoco, 'GLContext', None)
  return context.__module__.rsplit('.', 1)[-1] if context is not None else ''


# Headless backends: the shared libraries PyOpenGL loads for each, and the Debian packages that ship them.
GL_LIBRARIES = {
    'egl': ('libEGL.so.1 and libOpenGL.so.0', 'apt libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0, '
            'or the NVIDIA driver'),
    'osmesa': ('libOSMesa.so', 'apt libosmesa6')
}


def needs_headless_gl() -> bool:
  """True where mujoco loaded GLFW (MUJOCO_GL unset at its import) but there is no display to open."""
  return gl_backend() == 'glfw' and not (os.environ.get('DISPLAY') or os.environ.get('WAYLAND_DISPLAY'))


def select_gl_backend(name: str) -> None:
  """Makes `mujoco.Renderer` create its contexts with backend `name` ('egl' or 'osmesa') from now on in this
  process, also where mujoco was imported before MUJOCO_GL could be set.

  NOTE: this replaces `mujoco.rendering.classic.gl_context.GLContext`, the class `mujoco.Renderer` (mujoco 3.17)
  makes its contexts from, for the whole process; renderers already made keep theirs. PyOpenGL must not have
  been set up for another platform yet (mujoco's own egl/osmesa modules raise ImportError if it was).
  """
  if name not in GL_LIBRARIES:
    raise ValueError(f'select_gl_backend: {name!r} is not a headless backend; use egl or osmesa.')
  libraries, packages = GL_LIBRARIES[name]
  from mujoco.rendering.classic import gl_context  # pylint: disable=g-import-not-at-top
  platform = os.environ.get('PYOPENGL_PLATFORM')
  try:
    context = importlib.import_module(f'mujoco.{name}').GLContext
  except Exception as err:  # pylint: disable=broad-except
    # A missing library surfaces from deep inside PyOpenGL (e.g. an AttributeError on a None handle).
    if platform is None:
      os.environ.pop('PYOPENGL_PLATFORM', None)  # mujoco's module set it before it failed
    raise RuntimeError(f'GL backend {name} failed to load; is {libraries} installed ({packages})? {err!r}') from err
  gl_context.GLContext = mujoco.GLContext = context
  os.environ['MUJOCO_GL'] = name  # what child processes will load


def ensure_headless_gl() -> str:
  """Where mujoco loaded GLFW without a display (MUJOCO_GL unset on a headless machine, as in CI), switches this
  process (and, through MUJOCO_GL, the processes it starts) to EGL, else to OSMesa; returns the backend in use.
  Raises RuntimeError naming what to install when neither loads. A backend chosen by MUJOCO_GL is kept."""
  if not needs_headless_gl():
    return gl_backend()
  failures = []
  for name in ('egl', 'osmesa'):
    try:
      select_gl_backend(name)
      return name
    except RuntimeError as err:
      failures.append(str(err))
  raise RuntimeError('no headless OpenGL for mujoco.Renderer: ' + '; '.join(failures))


def _check_gl() -> None:
  hint = ('set MUJOCO_GL=egl (apt libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0, or the NVIDIA driver) or '
          'MUJOCO_GL=osmesa (apt libosmesa6) in the environment before Python imports mujoco, or call '
          'ebrl_jax.sim.render.select_gl_backend first')
  if not gl_backend():
    raise RuntimeError(f'MuJoCo rendering is disabled (MUJOCO_GL={os.environ.get("MUJOCO_GL")!r}); {hint}.')
  if needs_headless_gl():
    raise RuntimeError('MuJoCo loaded its GLFW backend (MUJOCO_GL was unset when mujoco was first imported) and '
                       f'there is no display; {hint}.')


class PixelRenderer:
  """Renders `num_envs` envs of one model into stacked uint8 observations [num_envs, *camera.shape].

  NOTE: `reset` and `push` may be called concurrently from several threads for disjoint env ids; each writes
  only its envs' rows of the stack, and each render thread runs one job at a time on its own renderer.

  models: one MjModel per env (domain randomisation: its camera pose and colours); None renders every env with
  `model`. They must be copies of `model` (the renderers' GL assets are made from `model`).
  """

  def __init__(self,
               model: mujoco.MjModel,
               camera: CameraObs,
               num_envs: int,
               models: Optional[Sequence[mujoco.MjModel]] = None):
    _check_gl()
    self.camera = camera
    self._model = model
    if models is not None and len(models) != num_envs:
      raise ValueError(f'PixelRenderer: {len(models)} models for {num_envs} envs.')
    self._models = models
    self._scene_option = mujoco.MjvOption()
    self._camera_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera.camera)
    if self._camera_id < 0:
      cameras = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
      raise ValueError(f'CameraObs: the model has no camera {camera.camera!r}; its cameras: {cameras}.')
    self._stack = np.zeros((num_envs,) + camera.shape, np.uint8)
    self._threads: List[concurrent.futures.ThreadPoolExecutor] = []
    self._renderers: List[mujoco.Renderer] = []
    for k in range(camera.num_threads):
      self._threads.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f'mj_render{k}'))
      try:
        self._renderers.append(self._threads[k].submit(self._make_renderer).result())
      except Exception as err:  # pylint: disable=broad-except  # GL errors come in many types
        self.close()
        raise RuntimeError(f'mujoco.Renderer could not start on GL backend {gl_backend()!r} '
                           f'(MUJOCO_GL={os.environ.get("MUJOCO_GL", "")!r}): {err}') from err

  def _make_renderer(self) -> mujoco.Renderer:
    renderer = mujoco.Renderer(self._model, self.camera.height, self.camera.width)
    # Pixels for a policy: no shadows or reflections (each costs a render pass, most of a software frame).
    renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
    renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
    return renderer

  def _render_into(self, renderer: mujoco.Renderer, datas: Sequence[mujoco.MjData], out: np.ndarray,
                   models: Optional[Sequence[mujoco.MjModel]]) -> None:
    """Runs in the renderer's thread: frames of `datas` into out [len(datas), H, W, C]."""
    for j, data in enumerate(datas):
      if models is None:
        renderer.update_scene(data, self._camera_id)
      else:  # the env's own model: its camera pose (in data, from its cam_pos/cam_quat) and geom colours
        camera = mujoco.MjvCamera()
        camera.type, camera.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, self._camera_id
        mujoco.mjv_updateScene(models[j], data, self._scene_option, None, camera, mujoco.mjtCatBit.mjCAT_ALL.value,
                               renderer.scene)
      out[j, ..., :3] = renderer.render()
      if self.camera.depth:
        renderer.enable_depth_rendering()
        out[j, ..., 3:] = depth_to_uint8(renderer.render(), self.camera.depth_max)
        renderer.disable_depth_rendering()

  def render(self, datas: Sequence[mujoco.MjData], models: Optional[Sequence[mujoco.MjModel]] = None) -> np.ndarray:
    """One frame per data (each with its model in `models`, else with `model`): [len(datas), H, W, C] uint8,
    split over the render threads."""
    out = np.empty((len(datas), self.camera.height, self.camera.width, self.camera.channels), np.uint8)
    bounds = np.linspace(0, len(datas), len(self._renderers) + 1).astype(int)
    futures = [
        thread.submit(self._render_into, renderer, datas[lo:hi], out[lo:hi], None if models is None else models[lo:hi])
        for thread, renderer, lo, hi in zip(self._threads, self._renderers, bounds[:-1], bounds[1:])
        if hi > lo
    ]
    for fut in futures:
      fut.result()  # re-raises a render thread's exception
    return out

  def reset(self, ids: np.ndarray, datas: Sequence[mujoco.MjData]) -> None:
    """Fills the stacks of envs `ids` with their current frame."""
    if len(ids):
      self._stack[ids] = fill_stack(self.render([datas[i] for i in ids], self._models_of(ids)), self.camera.frame_stack)

  def push(self, ids: np.ndarray, datas: Sequence[mujoco.MjData]) -> None:
    """Appends the current frame of envs `ids` to their stacks (dropping the oldest)."""
    if len(ids):
      self._stack[ids] = stack_frames(self._stack[ids], self.render([datas[i] for i in ids], self._models_of(ids)))

  def _models_of(self, ids: np.ndarray) -> Optional[List[mujoco.MjModel]]:
    return None if self._models is None else [self._models[i] for i in ids]

  def frames(self, ids: Optional[np.ndarray] = None) -> np.ndarray:
    """A copy of the stacks of envs `ids` (all by default): [n, H, W, C * frame_stack] uint8."""
    return self._stack.copy() if ids is None else self._stack[ids]

  def close(self) -> None:
    """Closes each renderer in its own thread (where its context is current), then the threads."""
    for thread, renderer in zip(self._threads, self._renderers):
      thread.submit(renderer.close).result()
    for thread in self._threads:
      thread.shutdown(wait=True)
    self._threads, self._renderers = [], []
