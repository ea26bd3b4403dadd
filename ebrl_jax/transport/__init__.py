"""Transport between stage processes: fixed-shape records through channels, parameters through a store.

`kind='thread'` runs in one process (tests, notebooks); `kind='shm'` crosses processes through shared memory.
The same program runs on either: the topology picks the kind.

  spec = transport.record_spec(Obs, {'obs': (64, 27), 'group': ()}, dtypes={'group': 'int32'})
  channel = transport.make_channel('shm', spec, capacity=8)
  store = transport.make_param_store('shm', template=params)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ebrl_jax.transport.base import Channel, ChannelClosed, Empty, Mailbox, ParamStore
from ebrl_jax.transport.inthread import ThreadChannel, ThreadParamStore
from ebrl_jax.transport.shm import ShmChannel, ShmRegistry, attach, default_registry
from ebrl_jax.transport.shm_params import ShmParamStore
from ebrl_jax.transport.specs import ArraySpec, RecordSpec, record_spec, spec_of

_CHANNELS: Dict[str, Callable[..., Channel]] = {
    'thread': lambda spec, capacity, **kw: ThreadChannel(spec, capacity),
    'shm': lambda spec, capacity, **kw: ShmChannel(spec, capacity, **kw),
}
_PARAM_STORES: Dict[str, Callable[..., ParamStore]] = {
    'thread': lambda template, **kw: ThreadParamStore(template, kw.get('history', 2)),
    'shm': lambda template, **kw: ShmParamStore(template, **kw),
}
KINDS = tuple(_CHANNELS)


def _check_kind(kind: str, registry: dict) -> None:
  if kind not in registry:
    raise ValueError(f'transport kind {kind!r} is not valid; valid kinds: {", ".join(sorted(registry))}.')


def register(kind: str, channel_factory: Callable[..., Channel], param_store_factory: Callable[..., ParamStore]):
  """Adds a transport kind (e.g. a CUDA-IPC one) to the factories below."""
  _CHANNELS[kind], _PARAM_STORES[kind] = channel_factory, param_store_factory


def make_channel(kind: str, spec: RecordSpec, capacity: int, registry: Optional[ShmRegistry] = None) -> Channel:
  """A channel of `kind` ('thread' or 'shm'). For 'shm', `registry` owns the segment (default: process-wide)."""
  _check_kind(kind, _CHANNELS)
  return _CHANNELS[kind](spec, capacity, **({'registry': registry} if registry is not None else {}))


def make_param_store(kind: str, template: Any, registry: Optional[ShmRegistry] = None, history: int = 2) -> ParamStore:
  """A parameter store of `kind` for pytrees shaped like `template` (arrays or ShapeDtypeStructs), holding the
  newest `history` versions (`ParamStore.get`)."""
  _check_kind(kind, _PARAM_STORES)
  return _PARAM_STORES[kind](template, history=history, **({'registry': registry} if registry is not None else {}))


def make_mailbox(kind: str,
                 request_spec: RecordSpec,
                 reply_spec: RecordSpec,
                 num_groups: int,
                 capacity: Optional[int] = None,
                 registry: Optional[ShmRegistry] = None,
                 group_field: str = 'group',
                 num_slices: int = 1,
                 slice_field: Optional[str] = None) -> Mailbox:
  """One request channel (capacity defaults to one request per requester, `num_groups * num_slices`) and one
  reply channel of capacity 1 per requester (group, or (group, slice) when `num_slices` > 1)."""
  requesters = num_groups * num_slices
  requests = make_channel(kind, request_spec, capacity or requesters, registry)
  replies = [make_channel(kind, reply_spec, 1, registry) for _ in range(requesters)]
  return Mailbox(requests, replies, group_field, num_slices, slice_field)


__all__ = [
    'ArraySpec', 'Channel', 'ChannelClosed', 'Empty', 'KINDS', 'Mailbox', 'ParamStore', 'RecordSpec', 'ShmChannel',
    'ShmParamStore', 'ShmRegistry', 'ThreadChannel', 'ThreadParamStore', 'attach', 'default_registry', 'make_channel',
    'make_mailbox', 'make_param_store', 'record_spec', 'register', 'spec_of'
]
