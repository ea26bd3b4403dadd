"""The transport contract, run against every implementation: the same tests for 'thread' and 'shm'."""
import threading
import time
from typing import NamedTuple

import numpy as np
import pytest

from ebrl_jax import transport
from transport_testlib import ITEM_SPEC, MIXED_SPEC, Item, Mixed, check_params, item, params_filled, params_template


@pytest.fixture(params=['thread', 'shm'])
def make(request):
  """make(spec, capacity) -> channel and make.store(template) for the parametrised kind."""
  registry = transport.ShmRegistry()
  kind = request.param

  class Factory:

    def __call__(self, spec, capacity):
      return transport.make_channel(kind, spec, capacity, registry=registry)

    def store(self, template, history=2):
      return transport.make_param_store(kind, template, registry=registry, history=history)

  yield Factory()
  registry.close()


def _in_thread(fn):
  """Runs fn in a thread; returns a dict that gets 'result' or 'error' and 'elapsed'."""
  out = {}

  def run():
    start = time.monotonic()
    try:
      out['result'] = fn()
    except Exception as e:  # pylint: disable=broad-except
      out['error'] = e
    out['elapsed'] = time.monotonic() - start

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, out


def test_fifo_order(make):
  channel = make(ITEM_SPEC, 8)
  for seq in range(6):
    channel.put(item(0, seq))
  assert channel.qsize() == 6
  assert [int(channel.get(timeout=1).seq) for _ in range(6)] == list(range(6))
  assert channel.qsize() == 0


def test_put_blocks_when_full_and_times_out(make):
  channel = make(ITEM_SPEC, 2)
  channel.put(item(0, 0))
  channel.put(item(0, 1))
  start = time.monotonic()
  with pytest.raises(TimeoutError):
    channel.put(item(0, 2), timeout=0.2)
  assert time.monotonic() - start >= 0.15
  assert int(channel.get(timeout=1).seq) == 0  # the timed-out put left nothing behind
  channel.put(item(0, 3), timeout=1)
  assert [int(channel.get(timeout=1).seq) for _ in range(2)] == [1, 3]
  with pytest.raises(transport.Empty):
    channel.get_nowait()
  assert channel.try_get() is None
  with pytest.raises(TimeoutError):
    channel.get(timeout=0.05)


def test_close_wakes_blocked_get(make):
  channel = make(ITEM_SPEC, 2)
  thread, out = _in_thread(lambda: channel.get(timeout=20))
  time.sleep(0.2)
  channel.close()
  thread.join(5)
  assert isinstance(out.get('error'), transport.ChannelClosed), out
  assert out['elapsed'] < 5
  assert channel.closed


def test_close_wakes_blocked_put(make):
  channel = make(ITEM_SPEC, 1)
  channel.put(item(0, 0))
  thread, out = _in_thread(lambda: channel.put(item(0, 1), timeout=20))
  time.sleep(0.2)
  channel.close()
  thread.join(5)
  assert isinstance(out.get('error'), transport.ChannelClosed), out


def test_close_drains_then_raises(make):
  channel = make(ITEM_SPEC, 4)
  channel.put(item(0, 0))
  channel.put(item(0, 1))
  channel.close()
  channel.close()  # idempotent
  with pytest.raises(transport.ChannelClosed):
    channel.put(item(0, 2))
  assert [int(channel.get(timeout=1).seq) for _ in range(2)] == [0, 1]
  for _ in range(2):  # and stays closed for every later caller
    with pytest.raises(transport.ChannelClosed):
      channel.get(timeout=1)


def test_round_trip_is_bit_exact(make):
  rng = np.random.default_rng(0)
  f32 = rng.standard_normal((3, 5)).astype(np.float32)
  f32[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
  record = Mixed(f32=f32,
                 i32=np.array([np.iinfo(np.int32).min, -1, 0, 1, 2, 3,
                               np.iinfo(np.int32).max], np.int32),
                 flag=np.array([[True, False], [False, True]]),
                 u8=rng.integers(0, 256, (4, 1, 3), dtype=np.uint8),
                 scalar=np.int32(-42),
                 f64_empty=np.zeros((0, 2)))
  expected = [np.array(a, copy=True) for a in record]
  channel = make(MIXED_SPEC, 3)
  channel.put(record)
  record.f32[:] = 0  # put copied: the caller may reuse its buffers at once
  out = channel.get(timeout=1)
  assert type(out) is Mixed
  for name, given, want in zip(Mixed._fields, out, expected):
    assert given.shape == MIXED_SPEC[name].shape and given.dtype == np.dtype(MIXED_SPEC[name].dtype), name
    assert given.tobytes() == want.tobytes(), name


def test_round_trip_float_bits(make):
  bits = np.arange(0, 2**32, 2**32 // 255 + 1, dtype=np.uint64).astype(np.uint32)[:15]
  f32 = bits.view(np.float32).reshape(3, 5)  # arbitrary bit patterns, NaN payloads included
  record = MIXED_SPEC.zeros()._replace(f32=f32)
  channel = make(MIXED_SPEC, 1)
  channel.put(record)
  assert channel.get(timeout=1).f32.view(np.uint32).tobytes() == bits.tobytes()


def test_many_producers_lose_and_duplicate_nothing(make):
  channel = make(ITEM_SPEC, 4)
  num_producers, count = 4, 300
  threads = [
      threading.Thread(
          target=lambda p=p: [channel.put(item(p, s), timeout=10) for s in range(count)]) for p in range(num_producers)
  ]
  for thread in threads:
    thread.start()
  seen = [channel.get(timeout=10) for _ in range(num_producers * count)]
  for thread in threads:
    thread.join(10)
  keys = [(int(r.producer), int(r.seq)) for r in seen]
  assert sorted(keys) == [(p, s) for p in range(num_producers) for s in range(count)]
  for p in range(num_producers):  # FIFO per producer
    assert [s for q, s in keys if q == p] == list(range(count))
  assert channel.try_get() is None


def test_bad_records_name_the_field(make):
  channel = make(ITEM_SPEC, 2)
  with pytest.raises(ValueError, match=r"'payload'.*expected shape \(16,\) dtype float32.*given shape \(15,\)"):
    channel.put(item(0, 0)._replace(payload=np.zeros((15,), np.float32)))
  with pytest.raises(ValueError, match=r"'seq'.*expected shape \(\) dtype int32.*given shape \(\) dtype int64"):
    channel.put(item(0, 0)._replace(seq=np.int64(3)))
  with pytest.raises(ValueError, match=r'missing \[.*producer.*\]'):
    channel.put(Mixed(*([np.zeros(1)] * 6)))
  assert channel.qsize() == 0


def test_param_store_latest_version(make):
  store = make.store(params_template(1000))
  assert store.version() == -1
  with pytest.raises(LookupError):
    store.latest()
  store.publish(1, params_filled(1, 1000))
  store.publish(5, params_filled(5, 1000))
  version, params = store.latest()
  assert version == store.version() == 5
  check_params(5, params)
  with pytest.raises(ValueError, match='must be greater'):
    store.publish(5, params_filled(5, 1000))
  bad = params_filled(6, 1000)
  bad['layers'][0] = np.zeros((10, 9), np.int32)
  with pytest.raises(ValueError, match=r"\['layers'\]\[0\].*expected shape \(10, 10\)"):
    store.publish(6, bad)
  assert store.wait_for_version(5, timeout=1)[0] == 5
  with pytest.raises(TimeoutError):
    store.wait_for_version(6, timeout=0.05)


def test_param_store_holds_the_newest_history_versions(make):
  """`get(v)`: an older version while the store still holds it (--deterministic's groups act with one), a
  LookupError naming the versions held once it is overwritten; `latest()` is unchanged by the ring."""
  store = make.store(params_template(100), history=3)
  with pytest.raises(LookupError):
    store.get(0)
  for version in range(6):
    store.publish(version, params_filled(version, 100))
    assert store.latest()[0] == version
    for held in range(max(0, version - 2), version + 1):
      check_params(held, store.get(held))
  with pytest.raises(LookupError, match=r'version 2 is not held .*newest 3: \[3, 4, 5\]'):
    store.get(2)
  with pytest.raises(ValueError, match='at least 2 versions'):
    make.store(params_template(100), history=1)


def test_param_store_get_is_never_torn(make):
  """A reader of an older version while the writer laps the ring: a whole set of that version or a
  LookupError, never a mix."""
  store = make.store(params_template(), history=3)
  store.publish(0, params_filled(0))
  stop = threading.Event()

  def write():
    version = 0
    while not stop.is_set():
      version += 1
      store.publish(version, params_filled(version))

  thread, out = _in_thread(write)
  whole = lost = 0
  deadline = time.monotonic() + 1.0
  while time.monotonic() < deadline:
    want = max(0, store.version() - 1)
    try:
      check_params(want, store.get(want))
      whole += 1
    except LookupError:
      lost += 1
  stop.set()
  thread.join(5)
  assert 'error' not in out, out
  assert whole > 0


def test_param_store_never_torn(make):
  store = make.store(params_template())
  stop = threading.Event()

  def write():
    version = 0
    while not stop.is_set():
      version += 1
      store.publish(version, params_filled(version))
    return version

  thread, out = _in_thread(write)
  reads, last = 0, 0
  deadline = time.monotonic() + 1.0
  while time.monotonic() < deadline:
    if store.version() < 1:
      continue
    version, params = store.latest()
    check_params(version, params)
    assert version >= last
    last, reads = version, reads + 1
  stop.set()
  thread.join(5)
  assert 'error' not in out, out
  assert reads > 10 and out['result'] > 10


class _Request(NamedTuple):
  obs: np.ndarray
  group: np.ndarray


class _Reply(NamedTuple):
  action: np.ndarray


def test_mailbox_round_trip(make):
  requests = make(transport.record_spec(_Request, {'obs': (4, 3), 'group': ()}, dtypes={'group': 'int32'}), 3)
  replies = [make(transport.record_spec(_Reply, {'action': (4, 2)}), 1) for _ in range(3)]
  mailbox = transport.Mailbox(requests, replies)
  for g in range(3):
    mailbox.ask(_Request(np.full((4, 3), g, np.float32), np.int32(g)))
  batch = mailbox.gather(max_requests=8, timeout=1)
  assert [g for g, _ in batch] == [0, 1, 2]
  for g, request in batch:
    mailbox.reply(g, _Reply(request.obs[:, :2] * 2))
  for g in (2, 0, 1):
    assert np.all(mailbox.receive(g, timeout=1).action == 2 * g)
  with pytest.raises(ValueError, match='outside'):
    mailbox.ask(_Request(np.zeros((4, 3), np.float32), np.int32(3)))
  mailbox.close()
  with pytest.raises(transport.ChannelClosed):
    mailbox.receive(0, timeout=1)


class _SliceRequest(NamedTuple):
  group: np.ndarray
  part: np.ndarray
  obs: np.ndarray


def test_mailbox_routes_replies_to_group_slices(make):
  spec = transport.record_spec(_SliceRequest, {
      'group': (),
      'part': (),
      'obs': (2, 3)
  },
                               dtypes={
                                   'group': 'int32',
                                   'part': 'int32'
                               })
  requests = make(spec, 6)
  replies = [make(transport.record_spec(_Reply, {'action': (2, 2)}), 1) for _ in range(6)]  # 2 groups x 3 slices
  mailbox = transport.Mailbox(requests, replies, num_slices=3, slice_field='part')
  assert mailbox.num_groups == 2
  ready = [(1, 2), (0, 0), (1, 0)]
  for g, s in ready:
    mailbox.ask(_SliceRequest(np.int32(g), np.int32(s), np.full((2, 3), 10 * g + s, np.float32)))
  batch = mailbox.gather(max_requests=6, timeout=1)
  assert [(g, mailbox.slice_of(r)) for g, r in batch] == ready
  for g, request in batch:
    mailbox.reply(g, _Reply(request.obs[:, :2]), env_slice=mailbox.slice_of(request))
  for g, s in sorted(ready):
    assert np.all(mailbox.receive(g, timeout=1, env_slice=s).action == 10 * g + s)
  with pytest.raises(TimeoutError):
    mailbox.receive(0, timeout=0.01, env_slice=1)  # nothing was sent to (0, 1)
  with pytest.raises(ValueError, match='part=3 is outside'):
    mailbox.ask(_SliceRequest(np.int32(0), np.int32(3), np.zeros((2, 3), np.float32)))
  with pytest.raises(ValueError, match='needs a slice_field'):
    transport.Mailbox(requests, replies, num_slices=3)
  mailbox.close()


def test_unknown_kind_lists_valid_ones():
  with pytest.raises(ValueError, match='valid kinds: shm, thread'):
    transport.make_channel('cuda', ITEM_SPEC, 2)
  with pytest.raises(ValueError, match='valid kinds: shm, thread'):
    transport.make_param_store('nccl', params_template(3))


def test_spec_helpers():
  spec = transport.spec_of(item(1, 2))
  assert spec == ITEM_SPEC and list(spec) == ['producer', 'seq', 'payload']
  assert spec.nbytes % 64 == 0 and all(offset % 64 == 0 for offset in spec.offsets.values())
  with pytest.raises(ValueError, match=r"missing shapes for \['payload'\]"):
    transport.record_spec(Item, {'producer': (), 'seq': ()})
  assert isinstance(Item(*ITEM_SPEC.zeros()), Item)


def test_a_nested_record_round_trips_with_its_classes_and_names_a_bad_leaf_by_path(make):
  # The segment record nests a Transition (9 leaves) and an EpisodeStats (3) beside 3 indices: one spec of 15
  # leaves, built back as the classes.
  from ebrl_jax import types  # pylint: disable=g-import-not-at-top
  template = types.segment_template(t=3, s=4, obs_dim=5, action_chunk=2, action_dim=1)
  spec = transport.spec_of(template)
  assert list(spec)[:2] == ['transition.obs', 'transition.raw_action'] and len(spec) == 15
  assert spec['transition.raw_action'].shape == (3, 4, 2, 1) and spec['transition.policy_version'].dtype == 'int32'
  assert spec['episode_stats.count'].shape == () and spec == transport.spec_of(spec.zeros())
  record = spec.zeros()._replace(group=np.array([7], np.int32))
  record = record._replace(transition=record.transition._replace(reward=np.full((3, 4), 2.5, np.float32)))
  channel = make(spec, 2)
  channel.put(record)
  out = channel.get(timeout=1)
  assert isinstance(out, types.SegmentRecord) and isinstance(out.transition, types.Transition)
  assert isinstance(out.episode_stats, types.EpisodeStats)
  assert int(out.group[0]) == 7 and float(out.transition.reward.sum()) == 2.5 * 12
  bad = record._replace(transition=record.transition._replace(obs=np.zeros((3, 4, 6), np.float32)))
  with pytest.raises(ValueError, match=r"field 'transition.obs': expected shape \(3, 4, 5\)"):
    channel.put(bad)
  with pytest.raises(ValueError, match="at 'transition' has fields"):
    channel.put(record._replace(transition=record.episode_stats))


def test_a_get_without_timeout_takes_a_record_put_later(make):
  channel = make(ITEM_SPEC, 1)
  thread, out = _in_thread(lambda: int(channel.get().seq))
  time.sleep(0.3)
  channel.put(item(0, 4))
  thread.join(5)
  assert out.get('result') == 4 and out['elapsed'] < 2.0


def test_no_dead_peer_no_recovery(make):
  channel, store = make(ITEM_SPEC, 2), make.store(params_template(10))
  for seq in range(20):
    channel.put(item(0, seq), timeout=1)
    channel.get(timeout=1)
    store.publish(seq, params_filled(seq, 10))
  assert channel.recovered() == (0, 0) and store.recovered() == (0, 0)


def test_a_dead_peer_is_a_closed_channel_and_not_a_timeout():
  assert issubclass(transport.base.PeerDied, transport.ChannelClosed)
  assert not issubclass(transport.base.PeerDied, TimeoutError)  # no `except TimeoutError: retry` swallows it
  assert not issubclass(transport.base.PeerStuck, TimeoutError)
