"""`ShmParamStore`: policy parameters in shared memory, in a ring of buffers (two by default) under a seqlock.

Layout: a header (latest buffer index, the lock's words, torn buffers seen, and per buffer a sequence counter and
the version it holds), then `history` buffers, each holding every leaf of the template at a 64-byte aligned
offset. The store holds the newest `history` versions: `latest()` returns the newest, `get(v)` an older one still
held (`--deterministic` gives each rollout group exactly the version its iteration is due, which can be
`--max_staleness` versions behind the newest; the topology sizes the ring for that).

Writer (`publish`, serialised by the segment's lock so several publishers are safe): picks the buffer after the
latest in the ring (the oldest), makes its sequence odd, copies the leaves in, records the version, makes the
sequence even again, then points `latest` at it. Readers (`latest`) never take the lock on the common path: read `latest`, read its
sequence (retry if odd), copy the leaves out, re-read the sequence; equal means the copy is whole. A reader
only retries if the writer published twice during one copy; after a few retries it takes the lock, which
bounds its wait.

Liveness: the lock is a `shm.SegmentLock` (an flock the kernel releases when its holder dies). A publisher killed
mid-copy leaves its buffer's sequence odd; that buffer never became the latest, so readers never see it, and the
next publish writes over it (counted in `recovered()`).

NOTE: correctness relies on stores to the segment becoming visible in program order, true on x86-64 (TSO),
where the H200 hosts run. On weakly ordered CPUs (aarch64) fences would be needed around the counters.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import numpy as np

from ebrl_jax.transport import base
from ebrl_jax.transport import shm as shm_lib
from ebrl_jax.transport.inthread import check_params, template_specs
from ebrl_jax.transport.specs import align_up

# Header words (int64): the latest buffer, the lock's two words, torn buffers seen, then _SEQ + b and
# _SEQ + history + b (its version) for buffer b of the ring.
_LATEST, _HOLDER, _TORN, _SEQ = 0, 1, 3, 4
_OPTIMISTIC_TRIES = 3


def _header_words(history: int) -> int:
  return _SEQ + 2 * history


class ShmParamStore(base.ParamStore):
  """Latest parameters shared between processes; construct in the owner, pass to children at spawn."""

  def __init__(self, template: Any, registry: Optional[shm_lib.ShmRegistry] = None, ctx=None, history: int = 2):
    del ctx  # accepted as before; the store needs no multiprocessing primitive any more
    if history < 2:
      raise ValueError(f'a parameter store holds at least 2 versions (double buffering); got history={history}.')
    self.specs, self.history = template_specs(template), int(history)
    shm = (registry or shm_lib.default_registry()).create(self._header_bytes() + self.history * self._buffer_bytes())
    self._map(shm)
    self._hdr[_LATEST] = -1
    self._versions[:] = -1
    self.owner = True
    (registry or shm_lib.default_registry()).on_close(self.detach)

  def _buffer_bytes(self) -> int:
    offset = 0
    for spec in jax.tree_util.tree_leaves(self.specs):
      offset = align_up(offset + spec.nbytes)
    return max(offset, 64)

  def _header_bytes(self) -> int:
    return align_up(8 * _header_words(self.history))

  def _map(self, shm) -> None:
    self._shm, self.name = shm, shm.name
    self._treedef = jax.tree_util.tree_structure(self.specs)
    leaves = jax.tree_util.tree_leaves(self.specs)
    size = self._buffer_bytes()
    self._hdr = np.ndarray((_header_words(self.history),), np.int64, buffer=shm.buf)
    self._seqs = self._hdr[_SEQ:_SEQ + self.history]
    self._versions = self._hdr[_SEQ + self.history:]
    self._lock = shm_lib.SegmentLock(shm.name, self._hdr[_HOLDER:_HOLDER + 2])
    self._views = []
    for b in range(self.history):
      views, offset = [], self._header_bytes() + b * size
      for spec in leaves:
        views.append(np.ndarray(spec.shape, spec.dtype, buffer=shm.buf, offset=offset))
        offset = align_up(offset + spec.nbytes)
      self._views.append(views)

  def __getstate__(self):
    return dict(name=self.name, specs=self.specs, history=self.history)

  def __setstate__(self, state):
    self.specs, self.history, self.owner = state['specs'], state['history'], False
    self._map(shm_lib.attach(state['name']))

  def publish(self, version: int, params: Any) -> None:
    leaves = check_params(self.specs, params)
    with self._lock:
      if version <= self.version():
        raise ValueError(f'version {version} must be greater than the latest published {self.version()}.')
      b = (int(self._hdr[_LATEST]) + 1) % self.history if self._hdr[_LATEST] >= 0 else 0
      seq = int(self._seqs[b])
      if seq % 2:  # a publisher died copying into this buffer (it never became the latest): write over it
        self._hdr[_TORN] += 1
        seq += 1
      self._seqs[b] = seq + 1  # odd: being written
      for view, leaf in zip(self._views[b], leaves):
        np.copyto(view, leaf)
      self._versions[b] = version
      self._seqs[b] = seq + 2  # even: whole
      self._hdr[_LATEST] = b

  def _copy_buffer(self, b: int, want: Optional[int]) -> Optional[Tuple[int, list]]:
    """Buffer b's (version, leaves) if whole (and holding `want`, when given); None if a writer moved meanwhile."""
    seq = int(self._seqs[b])
    if seq % 2:
      return None
    version = int(self._versions[b])
    if want is not None and version != want:
      return None
    leaves = [view.copy() for view in self._views[b]]
    if int(self._seqs[b]) != seq:
      return None
    return version, leaves

  def _try_copy(self, want: Optional[int] = None) -> Optional[Tuple[int, list]]:
    b = int(self._hdr[_LATEST])
    if b < 0:
      raise LookupError('no parameters published yet.')
    if want is None:
      return self._copy_buffer(b, None)
    for b in range(self.history):
      if int(self._versions[b]) == want:
        return self._copy_buffer(b, want)
    raise LookupError(f'parameter version {want} is not held (the store keeps the newest {self.history}: '
                      f'{sorted(int(v) for v in self._versions if v >= 0)}).')

  def _read(self, want: Optional[int]) -> Tuple[int, Any]:
    for _ in range(_OPTIMISTIC_TRIES):
      result = self._try_copy(want)
      if result is not None:
        break
    else:
      with self._lock:  # the writer cannot move while we hold it
        result = self._try_copy(want)
      if result is None and want is not None:
        raise LookupError(f'parameter version {want} was being overwritten by a publisher that died.')
      if result is None:
        raise RuntimeError(f'parameter store {self.name}: a buffer is marked as being written while no '
                           'publisher holds the lock (the segment was written by something else).')
    version, leaves = result
    return version, jax.tree_util.tree_unflatten(self._treedef, leaves)

  def latest(self) -> Tuple[int, Any]:
    return self._read(None)

  def get(self, version: int) -> Any:
    return self._read(int(version))[1]

  def version(self) -> int:
    b = int(self._hdr[_LATEST])
    return -1 if b < 0 else int(self._versions[b])

  def recovered(self) -> base.Recovered:
    """Half-written buffers and locks left by dead publishers so far (read from the segment)."""
    return base.Recovered(int(self._hdr[_TORN]), int(self._hdr[_HOLDER + 1]))

  def detach(self) -> None:
    """Unmaps this process's view (the owner's registry unlinks the segment)."""
    self._lock.close()
    self._views = [[] for _ in range(self.history)]
    self._hdr = np.full((_header_words(self.history),), -1, np.int64)
    self._hdr[_HOLDER:] = 0
    self._seqs = self._hdr[_SEQ:_SEQ + self.history]
    self._versions = self._hdr[_SEQ + self.history:]
    shm_lib.close_mapping(self._shm)
