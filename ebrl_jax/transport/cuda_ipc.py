"""CUDA IPC buffers for the generation hand-off: observations and actions cross between two processes on the GPU
without a host copy (`--generation_transport=cuda_ipc`).

Each requester (an env slice of an MJX rollout worker) allocates ONE device buffer when it starts (`OwnedSlot`, a
plain cudaMalloc outside CuPy's pool, since an IPC handle names a whole allocation) holding its observations
[B_s, O] and the reply's actions [B_s, K, A], raw actions [B_s, K, A] and log-probs [B_s], all float32. Its
64-byte IPC handle rides on every act request (with the requester's pid); the generation worker opens it once per
(group, slice, owner, handle) (`PeerSlots`) and reads the observations zero-copy into JAX, writes the reply into
the same buffer. Only the small request / reply records cross the host (the shared-memory mailbox, a few hundred
bytes): they are the per-step flag and sequence number. Before a side sends its record it synchronises the
stream that wrote the buffer, so the other side's reads see the writes.

DLPack, both ways (JAX 0.10-0.11, jax/_src/dlpack.py): `jax.dlpack.from_dlpack(cupy_array, copy=False)` is
zero-copy (copy=False makes it raise rather than copy, e.g. for a buffer not aligned as XLA's are: each field
starts ALIGN-aligned); JAX passes the device's `get_stream_for_external_ready_events()` stream to CuPy's
`__dlpack__`, which makes that stream wait for CuPy's current stream. `cupy.from_dlpack(jax_array)` hands CuPy
a view that is safe on CuPy's current stream (JAX makes that stream wait for the array); each copy into a buffer
runs on this process's own non-blocking copy stream, synchronised before the record goes. The JAX views alias
memory the peer overwrites: a requester's actions are consumed by its next simulation step before it sends the
next request, and the generation worker has finished with a slice's observations before it replies (the reply
copy waits on the act that read them). Each JAX view is made once per buffer (a `from_dlpack` per step would cost
more than the copy): JAX's documentation calls mutating a zero-copy buffer under a live array undefined
behaviour, which here means only that no JAX computation may be running on a field while the peer writes it, and
the protocol above orders exactly that; the round-trip contract (experiments/handoff_round_trip.py) checks every
reply's values against its own request's observations.

CuPy is optional (`pip install -e .[ipc]`); `unavailable_reason()` says why the path cannot run here.
"""
from __future__ import annotations

import glob
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np

try:  # optional dependency: the `ipc` extra
  import cupy
except ImportError:  # pragma: no cover - depends on the machine
  cupy = None

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
FIELDS = ('obs', 'actions', 'raw_actions', 'log_probs')
ALIGN = 256  # bytes: cudaMalloc's own alignment


def unavailable_reason() -> Optional[str]:
  """None where CUDA IPC can run in this process (CuPy importable, JAX on a CUDA GPU CuPy sees), else why not."""
  if cupy is None:
    return 'CuPy is not installed (pip install -e .[ipc]: cupy-cuda12x, or the cupy-cuda13x wheel)'
  try:
    backend = jax.default_backend()
  except RuntimeError as e:
    return f'JAX has no backend: {e}'
  if backend != 'gpu':
    return f'JAX runs on {backend!r}, not a CUDA GPU'
  try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
      return 'CuPy sees no CUDA device'
  except Exception as e:  # pylint: disable=broad-except  (CUDARuntimeError: no driver or no device)
    return f'CuPy cannot reach a CUDA device: {e}'
  return None


def host_reason() -> Optional[str]:
  """`unavailable_reason` as the controller can ask it without touching the GPU (it initialises no CUDA): CuPy
  importable and an NVIDIA device node present; the workers check the rest when they allocate or open a slot."""
  if cupy is None:
    return 'CuPy is not installed (pip install -e .[ipc]: cupy-cuda12x, or the cupy-cuda13x wheel)'
  if not glob.glob('/dev/nvidia[0-9]*'):
    return 'no NVIDIA device node (/dev/nvidia*) on this machine'
  return None


class Layout(NamedTuple):
  """Shapes of one slot's arrays: B_s envs, O observation dims, K action chunk, A action dims."""
  envs: int
  obs_dim: int
  chunk: int
  action_dim: int

  def shapes(self) -> Dict[str, Tuple[int, ...]]:
    m, k, a = self.envs, self.chunk, self.action_dim
    return {'obs': (m, self.obs_dim), 'actions': (m, k, a), 'raw_actions': (m, k, a), 'log_probs': (m,)}

  def offsets(self) -> Dict[str, int]:
    """Each field's byte offset in the slot's buffer, ALIGN-aligned (JAX refuses a zero-copy view of a buffer
    that is not aligned to what XLA allocates)."""
    out, offset = {}, 0
    for name, shape in self.shapes().items():
      out[name] = offset
      offset += -(-4 * int(np.prod(shape)) // ALIGN) * ALIGN
    return out

  @property
  def nbytes(self) -> int:
    last = FIELDS[-1]
    return self.offsets()[last] + -(-4 * int(np.prod(self.shapes()[last])) // ALIGN) * ALIGN


def _views(memptr, layout: Layout) -> Dict[str, object]:
  """CuPy float32 views of each field of one allocation."""
  offsets = layout.offsets()
  return {name: cupy.ndarray(shape, cupy.float32, memptr + offsets[name]) for name, shape in layout.shapes().items()}


class _Stream:
  """This process's copy stream (non-blocking: it never waits on the legacy default stream, nor it on it)."""
  stream = None

  @classmethod
  def get(cls):
    if cls.stream is None:
      cls.stream = cupy.cuda.Stream(non_blocking=True)
    return cls.stream


def _copy_in(view, array: jax.Array) -> None:
  """view[...] = array on the copy stream (which CuPy's from_dlpack makes wait for the JAX array)."""
  with _Stream.get():
    view[...] = cupy.from_dlpack(array)


def _synchronize() -> None:
  _Stream.get().synchronize()


def _to_jax(view) -> jax.Array:
  return jax.dlpack.from_dlpack(view, copy=False)


class OwnedSlot:
  """The requester's side: allocates the slot's buffer; `handle` ([64] uint8) is what the peer opens."""

  def __init__(self, layout: Layout):
    reason = unavailable_reason()
    if reason is not None:
      raise RuntimeError(f'--generation_transport=cuda_ipc cannot run here: {reason}.')
    self.layout = layout
    self._memory = cupy.cuda.Memory(layout.nbytes)  # its own cudaMalloc: the handle names exactly this buffer
    self._views = _views(cupy.cuda.MemoryPointer(self._memory, 0), layout)
    self.handle = np.frombuffer(cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr), np.uint8).copy()
    # Made once: only the peer writes these fields, and it synchronised before its reply record came.
    self._reply = tuple(_to_jax(self._views[n]) for n in FIELDS[1:])

  def put_obs(self, obs: jax.Array) -> None:
    """Copies the observations [B_s, O] into the buffer (device to device) and waits for the copy."""
    _copy_in(self._views['obs'], obs)
    _synchronize()

  def reply(self) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """(actions, raw_actions, log_probs) as zero-copy JAX views of the buffer (valid until the next request).

    The same arrays every step: read them only through a device computation (a jitted step, `jnp.copy`), never
    `np.asarray` / `jax.device_get`, since a jax.Array keeps the host copy of its first such read (the first
    H200 round-trip check compared 2197 of 2200 replies with that first host copy)."""
    return self._reply

  def close(self) -> None:
    self._views, self._reply, self._memory = {}, (), None


class _Opened:

  def __init__(self, handle: np.ndarray, layout: Layout):
    self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes(np.asarray(handle, np.uint8)))
    memory = cupy.cuda.UnownedMemory(self.ptr, layout.nbytes, self)
    self.views = _views(cupy.cuda.MemoryPointer(memory, 0), layout)
    self.obs = _to_jax(self.views['obs'])  # made once: the requester writes it, synchronised before its record

  def close(self) -> None:
    self.views, self.obs = {}, None
    cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


class PeerSlots:
  """The generation worker's side: every requester's buffer, opened the first time its handle is seen (again when
  a restarted requester sends a new one)."""

  def __init__(self, layout: Layout):
    reason = unavailable_reason()
    if reason is not None:
      raise RuntimeError(f'--generation_transport=cuda_ipc cannot run here: {reason}.')
    self.layout = layout
    self._open: Dict[Tuple[int, int], Tuple[Tuple[int, bytes], _Opened]] = {}
    self.opened = 0

  def _slot(self, group: int, env_slice: int, request) -> _Opened:
    ident = (int(request.owner), bytes(np.asarray(request.handle, np.uint8)))
    known = self._open.get((group, env_slice))
    if known is not None and known[0] == ident:
      return known[1]
    if known is not None:
      known[1].close()  # the requester was replaced: its old buffer is gone with it
    slot = _Opened(np.asarray(request.handle), self.layout)
    self._open[(group, env_slice)] = (ident, slot)
    self.opened += 1
    return slot

  def pack(self, requests: Sequence[Tuple[int, int, object]], rows: int) -> jax.Array:
    """The observations of [(group, slice, request)] in order, zero-padded to `rows` rows, on the device."""
    parts = [self._slot(g, s, r).obs for g, s, r in requests]
    pad = rows - len(parts) * self.layout.envs
    if pad:
      parts.append(jnp.zeros((pad, self.layout.obs_dim), jnp.float32))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def write(self, group: int, env_slice: int, request, actions, raw_actions, log_probs) -> None:
    """Copies one request's reply into its buffer and waits for the copies (then its reply record may go)."""
    views = self._slot(group, env_slice, request).views
    for name, array in zip(FIELDS[1:], (actions, raw_actions, log_probs)):
      _copy_in(views[name], array)
    _synchronize()

  def close(self) -> None:
    for _, slot in self._open.values():
      slot.close()
    self._open = {}
