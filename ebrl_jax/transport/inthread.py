"""In-process transport for threads (tests, notebooks, co-located stages): a deque under a Condition, and a
parameter store under a Lock. Same contract as the shared-memory versions (see base.py)."""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from ebrl_jax.transport import base
from ebrl_jax.transport.specs import ArraySpec, RecordSpec, check_array


class ThreadChannel(base.Channel):
  """Bounded FIFO for threads of one process. `put` copies the arrays in; `get` hands that copy out."""

  def __init__(self, spec: RecordSpec, capacity: int):
    if capacity < 1:
      raise ValueError(f'capacity={capacity} must be >= 1.')
    self.spec = spec
    self.capacity = capacity
    self._items = collections.deque()
    self._cond = threading.Condition()
    self._closed = False

  def _wait(self, ready, timeout: Optional[float]) -> None:
    """Waits under self._cond until ready() or closed; raises TimeoutError. Caller holds the condition."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready() and not self._closed:
      remaining = None if deadline is None else deadline - time.monotonic()
      if remaining is not None and remaining <= 0:
        raise TimeoutError(f'channel wait timed out after {timeout} s.')
      self._cond.wait(remaining)

  def put(self, record: Any, timeout: Optional[float] = None) -> None:
    arrays = [np.array(a, copy=True) for a in self.spec.check(record)]
    with self._cond:
      self._wait(lambda: len(self._items) < self.capacity, timeout)
      if self._closed:
        raise base.ChannelClosed('put on a closed channel.')
      self._items.append(self.spec.build(arrays))
      self._cond.notify_all()

  def get(self, timeout: Optional[float] = None) -> Any:
    with self._cond:
      self._wait(lambda: bool(self._items), timeout)
      if not self._items:
        raise base.ChannelClosed('get on a closed, empty channel.')
      record = self._items.popleft()
      self._cond.notify_all()
      return record

  def qsize(self) -> int:
    return len(self._items)

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    return self._closed


def template_specs(template: Any) -> Any:
  """Pytree of ArraySpec with the structure of `template` (arrays, ShapeDtypeStructs or ArraySpecs)."""
  return jax.tree_util.tree_map(lambda x: x if isinstance(x, ArraySpec) else ArraySpec.of(x), template)


def leaf_path_names(specs: Any) -> list:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(specs)[0]]


def check_params(specs: Any, params: Any) -> list:
  """Flattens `params` against the template `specs`; ValueError naming the leaf on any mismatch."""
  spec_leaves, treedef = jax.tree_util.tree_flatten(specs)
  leaves, given_def = jax.tree_util.tree_flatten(params)
  if given_def != treedef:
    raise ValueError(f'params structure {given_def} does not match the template {treedef}.')
  names = leaf_path_names(specs)
  return [check_array(n, s, x) for n, s, x in zip(names, spec_leaves, leaves)]


class ThreadParamStore(base.ParamStore):
  """Parameter store for threads. `publish` copies; `latest` returns that copy read-only, without copying."""

  def __init__(self, template: Any, history: int = 2):
    if history < 2:
      raise ValueError(f'a parameter store holds at least 2 versions (double buffering); got history={history}.')
    self.specs, self.history = template_specs(template), int(history)
    self._treedef = jax.tree_util.tree_structure(self.specs)
    self._lock = threading.Lock()
    self._version = -1
    self._params = None
    self._held: Dict[int, Any] = {}  # the newest `history` versions

  def publish(self, version: int, params: Any) -> None:
    leaves = [np.array(x, copy=True) for x in check_params(self.specs, params)]
    for leaf in leaves:
      leaf.setflags(write=False)
    with self._lock:
      if version <= self._version:
        raise ValueError(f'version {version} must be greater than the latest published {self._version}.')
      self._version, self._params = int(version), jax.tree_util.tree_unflatten(self._treedef, leaves)
      self._held[self._version] = self._params
      for old in sorted(self._held)[:-self.history]:
        del self._held[old]

  def latest(self) -> Tuple[int, Any]:
    with self._lock:
      if self._version < 0:
        raise LookupError('no parameters published yet.')
      return self._version, self._params

  def get(self, version: int) -> Any:
    with self._lock:
      if version not in self._held:
        raise LookupError(f'parameter version {version} is not held (the store keeps the newest '
                          f'{self.history}: {sorted(self._held)}).')
      return self._held[version]

  def version(self) -> int:
    return self._version
