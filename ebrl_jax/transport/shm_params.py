"""`ShmParamStore`: policy parameters in shared memory, double-buffered under a seqlock.

Layout: a header (latest buffer index, and per buffer a sequence counter and the version it holds), then two
buffers, each holding every leaf of the template at a 64-byte aligned offset.

Writer (`publish`, serialised by the segment's lock so several publishers are safe): picks the buffer that is not
the latest, makes its sequence odd, copies the leaves in, records the version, makes the sequence even again,
then points `latest` at it. Readers (`latest`) never take the lock on the common path: read `latest`, read its
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

# Header words (int64): _SEQ + b and _VERSION + b for buffer b in {0, 1}; the lock's two words; torn buffers seen.
_LATEST, _SEQ, _VERSION, _HOLDER, _TORN = 0, 1, 3, 5, 7
_HEADER_BYTES = 64
_OPTIMISTIC_TRIES = 3


class ShmParamStore(base.ParamStore):
  """Latest parameters shared between processes; construct in the owner, pass to children at spawn."""

  def __init__(self, template: Any, registry: Optional[shm_lib.ShmRegistry] = None, ctx=None):
    del ctx  # accepted as before; the store needs no multiprocessing primitive any more
    self.specs = template_specs(template)
    shm = (registry or shm_lib.default_registry()).create(_HEADER_BYTES + 2 * self._buffer_bytes())
    self._map(shm)
    self._hdr[_LATEST] = -1
    self._hdr[_VERSION:_VERSION + 2] = -1
    self.owner = True
    (registry or shm_lib.default_registry()).on_close(self.detach)

  def _buffer_bytes(self) -> int:
    offset = 0
    for spec in jax.tree_util.tree_leaves(self.specs):
      offset = align_up(offset + spec.nbytes)
    return max(offset, 64)

  def _map(self, shm) -> None:
    self._shm, self.name = shm, shm.name
    self._treedef = jax.tree_util.tree_structure(self.specs)
    leaves = jax.tree_util.tree_leaves(self.specs)
    size = self._buffer_bytes()
    self._hdr = np.ndarray((8,), np.int64, buffer=shm.buf)
    self._lock = shm_lib.SegmentLock(shm.name, self._hdr[_HOLDER:_HOLDER + 2])
    self._views = []
    for b in range(2):
      views, offset = [], _HEADER_BYTES + b * size
      for spec in leaves:
        views.append(np.ndarray(spec.shape, spec.dtype, buffer=shm.buf, offset=offset))
        offset = align_up(offset + spec.nbytes)
      self._views.append(views)

  def __getstate__(self):
    return dict(name=self.name, specs=self.specs)

  def __setstate__(self, state):
    self.specs, self.owner = state['specs'], False
    self._map(shm_lib.attach(state['name']))

  def publish(self, version: int, params: Any) -> None:
    leaves = check_params(self.specs, params)
    with self._lock:
      if version <= self.version():
        raise ValueError(f'version {version} must be greater than the latest published {self.version()}.')
      b = 1 - int(self._hdr[_LATEST]) if self._hdr[_LATEST] >= 0 else 0
      seq = int(self._hdr[_SEQ + b])
      if seq % 2:  # a publisher died copying into this buffer (it never became the latest): write over it
        self._hdr[_TORN] += 1
        seq += 1
      self._hdr[_SEQ + b] = seq + 1  # odd: being written
      for view, leaf in zip(self._views[b], leaves):
        np.copyto(view, leaf)
      self._hdr[_VERSION + b] = version
      self._hdr[_SEQ + b] = seq + 2  # even: whole
      self._hdr[_LATEST] = b

  def _try_copy(self) -> Optional[Tuple[int, list]]:
    b = int(self._hdr[_LATEST])
    if b < 0:
      raise LookupError('no parameters published yet.')
    seq = int(self._hdr[_SEQ + b])
    if seq % 2:
      return None
    leaves = [view.copy() for view in self._views[b]]
    version = int(self._hdr[_VERSION + b])
    if int(self._hdr[_SEQ + b]) != seq:
      return None
    return version, leaves

  def latest(self) -> Tuple[int, Any]:
    for _ in range(_OPTIMISTIC_TRIES):
      result = self._try_copy()
      if result is not None:
        break
    else:
      with self._lock:  # the writer cannot move while we hold it
        result = self._try_copy()
      if result is None:
        raise RuntimeError(f'parameter store {self.name}: the latest buffer is marked as being written while '
                           'no publisher holds the lock (the segment was written by something else).')
    version, leaves = result
    return version, jax.tree_util.tree_unflatten(self._treedef, leaves)

  def version(self) -> int:
    b = int(self._hdr[_LATEST])
    return -1 if b < 0 else int(self._hdr[_VERSION + b])

  def recovered(self) -> base.Recovered:
    """Half-written buffers and locks left by dead publishers so far (read from the segment)."""
    return base.Recovered(int(self._hdr[_TORN]), int(self._hdr[_HOLDER + 1]))

  def detach(self) -> None:
    """Unmaps this process's view (the owner's registry unlinks the segment)."""
    self._lock.close()
    self._views = [[], []]
    self._hdr = np.full((8,), -1, np.int64)
    self._hdr[_HOLDER:] = 0
    shm_lib.close_mapping(self._shm)
