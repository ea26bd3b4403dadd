"""Child-process entry points of the fault suite's transport trials (experiments/faults.py, kind `channel_lock`):
each gets inside a shared-memory call — holding a lock, or in the middle of a copy — says so on its pipe, and
waits there to be SIGKILLed. A module of its own so that a spawned child imports numpy and the transport only."""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from ebrl_jax import transport


class Item(NamedTuple):
  seq: np.ndarray  # () int32
  payload: np.ndarray  # [4096] float32: a copy long enough to be caught in


ITEM_SPEC = transport.record_spec(Item, {'seq': (), 'payload': (4096,)}, dtypes={'seq': 'int32'})


def item(seq: int) -> Item:
  return Item(np.int32(seq), np.full((4096,), seq, np.float32))


def _hang(conn, *args, **kwargs):
  del args, kwargs
  conn.send('inside')
  time.sleep(600)


def take_lock_and_hang(obj, conn):
  obj._lock.acquire()  # pylint: disable=protected-access
  _hang(conn)


def put_mid_copy(channel, conn):
  np.copyto = lambda *a, **k: _hang(conn)
  channel.put(item(7))


def get_mid_copy(channel, conn):
  transport.RecordSpec.build = lambda *a, **k: _hang(conn)
  channel.get()


def publish_mid_copy(store, conn):
  np.copyto = lambda *a, **k: _hang(conn)
  store.publish(1, {'w': np.ones((4096,), np.float32)})
