"""The project's Brax tasks with the physics run by MJX's Warp implementation (`--backend=mjx_warp`).

Brax 0.14.2 cannot pass `impl='warp'` through: `brax.io.mjcf.load` calls `mjx.put_model(mj)` (the JAX
implementation) and `brax.mjx.pipeline.init` calls `mjx.make_data(sys)`, which for Warp needs the host
`mujoco.MjModel`, and reads `data.contact` / `data.ncon`, which Warp data lacks. So this module keeps Brax's env
(its reset, observations, rewards, terminations) and swaps two things under it:

  * `env.sys`: the same Brax `System` with every `mjx.Model` field replaced by those of
    `mjx.put_model(mj_model, impl='warp')`, where `mj_model` is Brax's own MjModel with the MjOption overrides
    Brax applied for backend='mjx' (copied from the JAX system, so both implementations run one model);
  * `env._pipeline`: `WarpPipeline`, Brax's `mjx` pipeline (init/step, same `brax.mjx.base.State`) on Warp data.

Warp data differs from JAX data in one way that matters to wrappers: the contact buffer is shared by all envs
(`naconmax` contacts in total, fields listed in `mujoco.mjx.warp.types.DATA_NON_VMAP`), so those leaves have no
env axis. `ebrl_jax.sim.mjx_env.where_envs` keeps them as they are (they are scratch that every physics step
rewrites); `WarpAutoResetWrapper` uses it in place of Brax's per-leaf `jnp.where`.

Sizes (per env; read when the env is built, so set them before the first `make_mjx_env`):
  EBRL_WARP_NCONMAX  contacts per env (naconmax = this x num_envs); default MuJoCo Warp's own heuristic for the
                     model (48 for every task here), at least twice what MJX-JAX allocates.
  EBRL_WARP_NJMAX    constraint rows per env; default the same heuristic (64 here), at least twice MJX-JAX's.
Too small and MuJoCo Warp drops contacts / constraints (it prints 'nefc overflow - please increase njmax' or
'narrowphase overflow - please increase nconmax ... or naconmax' from the kernel on every step) and the physics
silently departs from MJX-JAX; see experiments/results/warp_agreement_h200.json.
  EBRL_WARP_GRAPH_MODE  warp (default on GPU: Warp captures a CUDA graph per set of buffer addresses), jax (XLA
                     captures), none.
  EBRL_WARP_ALLOW_CPU=1  lets the backend run on Warp's CPU kernels (slow; for tests on machines without a GPU).

Solver iteration limits: Brax configures ant and humanoid with `opt.iterations=1, ls_iterations=4`, so MuJoCo
Warp's solver prints 'solver iterations limit reached' (and the linesearch its own) from a kernel on every
physics step. Those two prints are compiled out (`opt.warn_overflow` without the ITERATIONS and LS_ITERATIONS
bits; it is a compile-time constant of the kernels, so this costs nothing), while the kernels still set the
bits in `data._impl.overflow` (per env, kept until the env is reset). The batched env reads them through one
`jax.debug.callback` of an int32 (the OR over envs) after each reset (default: Ant's iteration limit already
shows there, humanoid's only once it lands), or after every step with EBRL_WARP_OVERFLOW_CALLBACK=step (it cost
13% of Ant's env steps/s at 4096 envs on the H200), never with =off; each kind is logged once per process.
`report_overflow(state)` does the same on demand: a runtime calls it once per iteration. A JAX_PLATFORMS
without 'cpu' turns the callback off (jax.debug.callback needs the CPU platform).
Capacity overflows (njmax, naconmax, ...) keep MuJoCo Warp's own per-step print: they mean wrong physics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import threading
from typing import Dict, Optional

from brax import base as brax_base
from brax import envs as brax_envs
from brax.envs.wrappers import training as brax_training
from brax.mjx import base as brax_mjx_base
import jax
from jax import numpy as jnp
from mujoco import mjx
from mujoco.mjx import warp as mjxw
import numpy as np

_LOG = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'ebrl_jax[warp]' (the extra pins mujoco-mjx[warp]==3.17.0, which brings "
                'warp-lang)')

# mujoco_warp's OverflowType bits (mujoco/mjx/third_party/mujoco_warp/_src/types.py, MJX 3.17.0), as ints so
# that importing this module needs no warp.
OVERFLOW_BITS = {
    1 << 0: ('NEFC', 'more constraint rows than njmax in an env: rows were dropped; raise EBRL_WARP_NJMAX'),
    1 << 1: ('NJMAX_NNZ', 'constraint Jacobian non-zeros overflow: raise EBRL_WARP_NJMAX'),
    1 << 2: ('BROADPHASE', 'broadphase overflow: raise EBRL_WARP_NCONMAX (naconmax = it x num_envs)'),
    1 << 3: ('NARROWPHASE', 'contacts dropped (more than naconmax): raise EBRL_WARP_NCONMAX'),
    1 << 4: ('CCD', 'CCD contact overflow: raise EBRL_WARP_NCONMAX'),
    1 << 5: ('HFIELD', 'height-field collision overflow'),
    1 << 6: ('CONTACT_MATCH', 'contact sensor match overflow'),
    1 << 7: ('NVMAX', 'nvmax overflow (islands)'),
    1 << 8: ('EPA_HORIZON', 'EPA horizon buffer overflow'),
    1 << 9: ('ITERATIONS', 'the constraint solver reached opt.iterations before converging (expected for tasks '
             'that Brax runs with iterations=1: ant, humanoid); per-step print silenced'),
    1 << 10: ('LS_ITERATIONS', 'the linesearch reached opt.ls_iterations before converging (expected for tasks '
              'that Brax runs with ls_iterations=4: ant, humanoid); per-step print silenced'),
    1 << 11: ('TACTILE', 'tactile sensor collision pair overflow'),
}
SILENCED_BITS = (1 << 9) | (1 << 10)  # ITERATIONS | LS_ITERATIONS

_GRAPH_MODES = ('warp', 'jax', 'none')


class WarpUnavailableError(ValueError):
  """The MJX-Warp backend cannot run here (no CUDA GPU, or warp-lang missing)."""


def _cuda_devices():
  try:
    return jax.local_devices(backend='cuda')  # this process's own (a trainer rank's: not rank 0's)
  except RuntimeError:  # no CUDA backend in this jaxlib, or it failed to initialise
    return []


def _host_device():
  """JAX's CPU device (host arrays for templates), or None (the default device) when JAX_PLATFORMS leaves it out."""
  try:
    return jax.local_devices(backend='cpu')[0]
  except RuntimeError:
    return None


def warp_installed() -> bool:
  return importlib.util.find_spec('warp') is not None and bool(mjxw.WARP_INSTALLED)


def check_available() -> None:
  """Raises WarpUnavailableError naming --backend=mjx_warp unless warp-lang is installed and JAX sees a CUDA GPU
  (or EBRL_WARP_ALLOW_CPU=1 allows Warp's CPU kernels)."""
  has_warp = warp_installed()
  has_gpu = bool(_cuda_devices()) or os.environ.get('EBRL_WARP_ALLOW_CPU') == '1'
  if has_warp and has_gpu:
    return
  problems = []
  if not has_gpu:
    platforms = sorted({d.platform for d in jax.devices()})
    problems.append(f'needs a CUDA GPU, and JAX sees none here (platforms: {", ".join(platforms)})')
  if not has_warp:
    problems.append(f'needs warp-lang, which is not installed: {INSTALL_HINT}')
  raise WarpUnavailableError("--backend=mjx_warp (MJX's Warp implementation, make_mjx_env(..., impl='warp')) " +
                             '; it also '.join(problems) +
                             ". Use --backend=mjx (MJX's JAX implementation) or --backend=mujoco_cpu on this machine.")


def _env_int(name: str) -> Optional[int]:
  value = os.environ.get(name)
  if value in (None, ''):
    return None
  if not value.isdigit():
    raise ValueError(f'{name}={value!r} must be a non-negative integer.')
  return int(value)


def default_sizes(mj_model, jax_ncon: int = 0, jax_nefc: int = 0) -> tuple:
  """(contacts per env, constraint rows per env): MuJoCo Warp's heuristic, at least twice what MJX-JAX
  allocates (its sizes are exhaustive for its own collision functions; Warp's may emit more points per pair)."""
  try:
    from mujoco.mjx.third_party.mujoco_warp._src import io as mjwp_io  # lazy: private, and absent without warp
    nconmax, njmax = mjwp_io._default_nconmax(mj_model), mjwp_io._default_njmax(mj_model)  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    nconmax, njmax = 48, 64
  return max(int(nconmax), 2 * int(jax_ncon)), max(int(njmax), 2 * int(jax_nefc))


# ---------------------------------------------------------------------------------------------------------------
# Reporting overflow bits once.

_REPORTED = set()
_REPORT_LOCK = threading.Lock()


def _report_bits(bits) -> None:
  bits = int(np.asarray(bits))
  if not bits:
    return
  with _REPORT_LOCK:
    new = [b for b in OVERFLOW_BITS if bits & b and b not in _REPORTED]
    _REPORTED.update(new)
  for b in new:
    name, what = OVERFLOW_BITS[b]
    _LOG.warning('MuJoCo Warp overflow %s in at least one env: %s. (Reported once per process.)', name, what)


def _or_over_envs(overflow: jax.Array) -> jax.Array:
  return jax.lax.reduce(overflow.astype(jnp.int32).reshape(-1), jnp.int32(0), jax.lax.bitwise_or, (0,))


def overflow_bits(state) -> jax.Array:
  """OR of the overflow bits of every env of a batched Brax state (or of a `stages.EnvGroupState`)."""
  state = getattr(state, 'brax_state', state)
  return _or_over_envs(state.pipeline_state._impl.overflow)  # pylint: disable=protected-access


def report_overflow(state) -> int:
  """Host side: logs each kind of overflow in `state` not reported before; returns the bits."""
  bits = int(jax.device_get(overflow_bits(state)))
  _report_bits(bits)
  return bits


def reset_reported() -> None:
  with _REPORT_LOCK:
    _REPORTED.clear()


# ---------------------------------------------------------------------------------------------------------------
# The pipeline.


def _materialise(x):
  """A template leaf as traced code: jnp.full for a uniform array (no large constant in the program)."""
  x = np.asarray(x)
  if x.size and np.all(x == x.flat[0]):
    return jnp.full(x.shape, x.flat[0], x.dtype)
  return jnp.asarray(x)


def _brax_state(sys, data, q, qd):
  x = brax_base.Transform(pos=data.xpos[1:], rot=data.xquat[1:])
  cvel = brax_base.Motion(vel=data.cvel[1:, 3:], ang=data.cvel[1:, :3])
  offset = data.xpos[1:, :] - data.subtree_com[np.asarray(sys.body_rootid)[1:]]
  xd = brax_base.Transform.create(pos=offset).vmap().do(cvel)
  fields = dict(data.__dict__)
  for k in ('q', 'qd', 'x', 'xd', 'contact'):
    fields.pop(k, None)
  return brax_mjx_base.State(q=q, qd=qd, x=x, xd=xd, contact=None, **fields)


class WarpPipeline:
  """Brax's `brax.mjx.pipeline` (init, step) on MJX-Warp data.

  Warp data must be made from the host `mujoco.MjModel`, with the contact buffer sized for all envs
  (naconmax = nconmax x num_envs), so `init` builds it from a per-batch-size template; the batched wrapper
  says the batch size (`with pipeline.batch(n)`) while `reset` is traced. Brax contacts are not kept
  (`state.contact` is None; none of the tasks here reads them).
  """

  def __init__(self, mj_model, nconmax: int, njmax: int):
    self.mj_model, self.nconmax, self.njmax = mj_model, int(nconmax), int(njmax)
    self._templates: Dict[int, object] = {}
    self._local = threading.local()

  @contextlib.contextmanager
  def batch(self, num_envs: int):
    prev = getattr(self._local, 'num_envs', None)
    self._local.num_envs = int(num_envs)
    try:
      yield
    finally:
      self._local.num_envs = prev

  def template(self, num_envs: Optional[int] = None):
    n = num_envs or getattr(self._local, 'num_envs', None) or 1
    if n not in self._templates:
      with jax.ensure_compile_time_eval():  # host arrays even while reset is being traced
        self._templates[n] = mjx.make_data(self.mj_model,
                                           device=_host_device(),
                                           impl='warp',
                                           naconmax=n * self.nconmax,
                                           njmax=self.njmax)
    return self._templates[n]

  def init(self, sys, q, qd, act=None, ctrl=None, unused_debug: bool = False):
    data = jax.tree.map(_materialise, self.template())
    data = data.replace(qpos=q, qvel=qd)
    if act is not None:
      data = data.replace(act=act)
    if ctrl is not None:
      data = data.replace(ctrl=ctrl)
    data = mjx.forward(sys, data)
    return _brax_state(sys, data, data.qpos, data.qvel)

  def step(self, sys, state, act, unused_debug: bool = False):
    data = mjx.step(sys, state.replace(ctrl=act))
    return _brax_state(sys, data, data.qpos, data.qvel)


def _graph_mode(name: Optional[str]):
  name = (name or os.environ.get('EBRL_WARP_GRAPH_MODE') or 'warp').lower()
  if name not in _GRAPH_MODES:
    raise ValueError(f'EBRL_WARP_GRAPH_MODE={name!r} must be one of {", ".join(_GRAPH_MODES)}.')
  return getattr(mjxw.types.GraphMode, name.upper())


def warp_model(jax_sys, graph_mode: Optional[str] = None, warn_overflow_mask: int = ~SILENCED_BITS):
  """(mj_model, mjx Model with impl='warp') for a Brax System built on MJX-JAX: Brax's MjModel with the MjOption
  fields copied from the JAX system (Brax's overrides for backend='mjx')."""
  mj = jax_sys.mj_model.__copy__()  # a deep copy (mj_copyModel)
  for field in ('timestep', 'impratio', 'tolerance', 'ls_tolerance', 'integrator', 'cone', 'jacobian', 'solver',
                'iterations', 'ls_iterations', 'disableflags', 'enableflags'):
    value = getattr(jax_sys.opt, field, None)
    if value is None:
      continue
    current = getattr(mj.opt, field)
    setattr(mj.opt, field, type(current)(np.asarray(value).item()))
  if jax.devices()[0].platform == 'cpu' or not _cuda_devices():
    device = _host_device()
    mode = _graph_mode(graph_mode or 'jax')  # Warp's CPU path: no CUDA graphs
  else:
    device, mode = None, _graph_mode(graph_mode)
  mw = mjx.put_model(mj, device=device, impl='warp', graph_mode=mode)
  opt_impl = mw.opt._impl  # pylint: disable=protected-access
  mw = mw.replace(opt=mw.opt.replace(_impl=opt_impl.replace(warn_overflow=int(opt_impl.warn_overflow) &
                                                            int(warn_overflow_mask))))
  return mj, mw


def make_brax_env(brax_name: str,
                  nconmax: Optional[int] = None,
                  njmax: Optional[int] = None,
                  graph_mode: Optional[str] = None,
                  warn_overflow_mask: int = ~SILENCED_BITS,
                  opt_overrides: Optional[Dict[str, float]] = None):
  """Brax's env `brax_name` (backend='mjx') with its physics on MJX-Warp; not batched (wrap it in
  `WarpVmapWrapper`). opt_overrides: MjOption fields set on top of Brax's (e.g. {'iterations': 50}; experiments)."""
  check_available()
  env = brax_envs.get_environment(brax_name, backend='mjx')
  if opt_overrides:
    env.sys = env.sys.tree_replace({f'opt.{k}': v for k, v in opt_overrides.items()})
  mj, mw = warp_model(env.sys, graph_mode, warn_overflow_mask)
  jax_data = mjx.make_data(mj, device=_host_device(), impl='jax')
  ncon0, njmax0 = default_sizes(mj, jax_data._impl.contact.dist.shape[0], jax_data._impl.efc_J.shape[0])  # pylint: disable=protected-access
  nconmax = nconmax if nconmax is not None else (_env_int('EBRL_WARP_NCONMAX') or ncon0)
  njmax = njmax if njmax is not None else (_env_int('EBRL_WARP_NJMAX') or njmax0)
  model_fields = {f.name: getattr(mw, f.name) for f in dataclasses.fields(mjx.Model)}
  env.sys = env.sys.replace(**model_fields)
  env._pipeline = WarpPipeline(mj, nconmax, njmax)  # pylint: disable=protected-access
  return env


def pipeline_of(env) -> WarpPipeline:
  pipeline = getattr(env.unwrapped, '_pipeline', None)
  if not isinstance(pipeline, WarpPipeline):
    raise TypeError(f'{env} does not run on MJX-Warp.')
  return pipeline


_REPORT_MODES = ('reset', 'step', 'off')


def _report_mode(value=None) -> str:
  """When the batched env reads the overflow bits: 'reset' (default: after each reset, no per-step cost), 'step'
  (after every env step: one jax.debug.callback each, measured at -13% env steps/s for Ant at 4096 envs on the
  H200), 'off'. From EBRL_WARP_OVERFLOW_CALLBACK unless given (True means 'step', False 'off')."""
  if value is True or value is False:
    return 'step' if value else 'off'
  value = value or os.environ.get('EBRL_WARP_OVERFLOW_CALLBACK') or 'reset'
  value = {'0': 'off', '1': 'step'}.get(value, value)
  if value not in _REPORT_MODES:
    raise ValueError(f'EBRL_WARP_OVERFLOW_CALLBACK={value!r} must be one of {", ".join(_REPORT_MODES)} (or 0/1).')
  return value


class WarpVmapWrapper(brax_training.VmapWrapper):
  """Brax's VmapWrapper that tells the pipeline the batch size at reset (to size the shared contact buffer) and
  reports overflow bits once per kind (`jax.debug.callback` of one int32; see `_report_mode`). `renderer`: the
  `warp_render.WarpRenderer` that the simulation stage renders camera frames with (`--obs=pixels`), or None.
  `per_env_model`: an `mjx_env.PerEnvModel` (`--randomize`) that resets and steps each env with its own model
  fields (MuJoCo Warp reads a model field with a leading env axis per world), or None."""

  def __init__(self, env, report_overflow=None, renderer=None, per_env_model=None):
    super().__init__(env)
    self.renderer, self.per_env_model = renderer, per_env_model
    mode = _report_mode(report_overflow)
    if mode != 'off' and _host_device() is None:  # jax.debug.callback needs JAX's CPU platform
      _LOG.warning("JAX_PLATFORMS leaves out 'cpu', so MJX-Warp overflows are not reported (call "
                   'ebrl_jax.sim.warp.report_overflow(state), or use JAX_PLATFORMS=cuda,cpu).')
      mode = 'off'
    self.report_overflow = mode

  def _report(self, state):
    jax.debug.callback(_report_bits, _or_over_envs(state.pipeline_state._impl.overflow))  # pylint: disable=protected-access

  def reset(self, rng):
    with pipeline_of(self.env).batch(rng.shape[0]):
      state = jax.vmap(self.env.reset)(rng) if self.per_env_model is None else self.per_env_model.reset(rng)
    if self.report_overflow != 'off':
      self._report(state)
    return state

  def step(self, state, action):
    if self.per_env_model is None:
      state = jax.vmap(self.env.step)(state, action)
    else:
      state = self.per_env_model.step(state, action)
    if self.report_overflow == 'step':
      self._report(state)
    return state
