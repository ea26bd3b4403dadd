"""Record types and child-process entry points for the transport tests (module level, so spawn can import them)."""
from typing import NamedTuple

import numpy as np

from ebrl_jax import transport


class Item(NamedTuple):
  producer: np.ndarray  # () int32
  seq: np.ndarray  # () int32
  payload: np.ndarray  # [16] float32, filled with seq


class Mixed(NamedTuple):
  f32: np.ndarray
  i32: np.ndarray
  flag: np.ndarray
  u8: np.ndarray
  scalar: np.ndarray
  f64_empty: np.ndarray


ITEM_SPEC = transport.record_spec(Item, {
    'producer': (),
    'seq': (),
    'payload': (16,)
},
                                  dtypes={
                                      'producer': 'int32',
                                      'seq': 'int32'
                                  })
MIXED_SPEC = transport.record_spec(Mixed, {
    'f32': (3, 5),
    'i32': (7,),
    'flag': (2, 2),
    'u8': (4, 1, 3),
    'scalar': (),
    'f64_empty': (0, 2)
},
                                   dtypes={
                                       'i32': 'int32',
                                       'flag': 'bool',
                                       'u8': 'uint8',
                                       'scalar': 'int32',
                                       'f64_empty': 'float64'
                                   })


def item(producer: int, seq: int) -> Item:
  return Item(np.int32(producer), np.int32(seq), np.full((16,), seq, np.float32))


def params_template(n: int = 100_000):
  return {'w': np.zeros((n,), np.float32), 'layers': [np.zeros((10, 10), np.int32), np.zeros((3,), np.uint8)]}


def params_filled(version: int, n: int = 100_000):
  return {
      'w': np.full((n,), version, np.float32),
      'layers': [np.full((10, 10), version, np.int32),
                 np.full((3,), version % 256, np.uint8)]
  }


def check_params(version, params) -> None:
  assert np.all(params['w'] == version), version
  assert np.all(params['layers'][0] == version), version
  assert np.all(params['layers'][1] == version % 256), version


def produce(channel, producer: int, count: int) -> None:
  for seq in range(count):
    channel.put(item(producer, seq), timeout=30)


def produce_forever(channel, producer: int) -> None:
  seq = 0
  while True:
    channel.put(item(producer, seq), timeout=60)
    seq += 1


def consume(channel, results, count: int) -> None:
  """Checks FIFO order of a single producer and reports the total of seq numbers through `results`."""
  total = 0
  for expected in range(count):
    record = channel.get(timeout=30)
    assert int(record.seq) == expected and np.all(record.payload == expected), (int(record.seq), expected)
    total += int(record.seq)
  results.put(item(-1, total), timeout=30)


def publish_versions(store, count: int) -> None:
  for version in range(1, count + 1):
    store.publish(version, params_filled(version))


def attach_and_exit(channel) -> None:
  channel.put(item(7, 7), timeout=10)
