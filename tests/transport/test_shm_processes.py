"""ShmChannel / ShmParamStore across spawned processes: data flow, a SIGKILLed peer, segment lifetime and mode."""
import gc
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ebrl_jax import transport
import transport_testlib as lib

CTX = multiprocessing.get_context('spawn')
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shm_entries(owner_pid=None):
  """This test's shared-memory segments: named `ebrl_<owner pid>_...`. Scoped to the owner because tests run in
  parallel (pytest -n) create and remove their own segments meanwhile; multiprocessing's `sem.mp-*` semaphores
  are the standard library's to clean up and cannot be told apart between workers, so they are not counted."""
  prefix = f'ebrl_{owner_pid or os.getpid()}_'
  return {n for n in os.listdir('/dev/shm') if n.startswith(prefix)}


def _start(target, *args):
  process = CTX.Process(target=target, args=args, daemon=True)
  process.start()
  return process


def test_child_producer_to_child_consumer():
  before = _shm_entries()
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 4, registry=registry)
    results = transport.ShmChannel(lib.ITEM_SPEC, 1, registry=registry)
    count = 500
    consumer = _start(lib.consume, channel, results, count)
    producer = _start(lib.produce, channel, 0, count)
    total = int(results.get(timeout=60).seq)
    producer.join(30)
    consumer.join(30)
    assert producer.exitcode == 0 and consumer.exitcode == 0
    assert total == count * (count - 1) // 2  # every seq once, in order (checked in the child)
    for name in registry.names:
      path = os.path.join('/dev/shm', name)
      assert os.path.exists(path), 'segment vanished while the owner still uses it'
      assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  del channel, results
  gc.collect()
  assert _shm_entries() - before == set()


def test_many_child_producers_one_owner_consumer():
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 8, registry=registry)
    num_producers, count = 3, 200
    producers = [_start(lib.produce, channel, p, count) for p in range(num_producers)]
    keys = [(int(r.producer), int(r.seq)) for r in (channel.get(timeout=60) for _ in range(num_producers * count))]
    for process in producers:
      process.join(30)
      assert process.exitcode == 0
    assert sorted(keys) == [(p, s) for p in range(num_producers) for s in range(count)]
    for p in range(num_producers):
      assert [s for q, s in keys if q == p] == list(range(count))
    assert channel.try_get() is None


def test_sigkilled_producer_leaves_owner_working_and_nothing_behind():
  before = _shm_entries()
  registry = transport.ShmRegistry()
  channel = transport.ShmChannel(lib.ITEM_SPEC, 4, registry=registry)
  producer = _start(lib.produce_forever, channel, 0)
  first = [int(channel.get(timeout=60).seq) for _ in range(50)]
  assert first == list(range(50))
  os.kill(producer.pid, signal.SIGKILL)
  producer.join(10)
  assert producer.exitcode == -signal.SIGKILL
  # Whatever it finished putting is still readable; then the channel is empty, not hung.
  drained = 0
  while channel.try_get() is not None:
    drained += 1
  assert drained <= 4
  with pytest.raises(TimeoutError):
    channel.get(timeout=0.1)
  # The segment is still there and usable by the owner.
  path = os.path.join('/dev/shm', channel.name)
  assert os.path.exists(path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
  channel.put(lib.item(9, 9), timeout=1)
  assert int(channel.get(timeout=1).seq) == 9
  registry.close()
  registry.close()  # safe twice
  assert channel.closed
  del channel
  gc.collect()
  assert _shm_entries() - before == set()


def test_param_store_never_torn_across_processes():
  with transport.ShmRegistry() as registry:
    store = transport.ShmParamStore(lib.params_template(), registry=registry)
    writer = _start(lib.publish_versions, store, 3000)
    version, seen, reads = store.wait_for_version(1, timeout=60)[0], set(), 0
    while writer.is_alive() or reads == 0:
      version, params = store.latest()
      lib.check_params(version, params)
      seen.add(version)
      reads += 1
    writer.join(10)
    assert writer.exitcode == 0
    assert store.latest()[0] == 3000
    assert len(seen) > 5, seen


_RESOURCE_TRACKER_SCRIPT = textwrap.dedent('''
    import multiprocessing, os, subprocess, sys
    sys.path.insert(0, {testdir!r})
    from ebrl_jax import transport
    import transport_testlib as lib
    if __name__ == '__main__':
      registry = transport.ShmRegistry()
      channel = transport.ShmChannel(lib.ITEM_SPEC, 2, registry=registry)
      store = transport.ShmParamStore(lib.params_template(10), registry=registry)
      # A spawned child (shares our resource tracker) attaches, puts, exits.
      child = multiprocessing.get_context('spawn').Process(target=lib.attach_and_exit, args=(channel,))
      child.start(); child.join(60)
      assert child.exitcode == 0
      # An unrelated process (its own resource tracker) attaches by name and exits.
      code = ('import sys; from ebrl_jax.transport import shm; s = shm.attach(sys.argv[1]); s.close()')
      for name in registry.names:
        subprocess.run([sys.executable, '-c', code, name], check=True, env=dict(os.environ, PYTHONPATH={root!r}))
      for name in registry.names:
        assert os.path.exists('/dev/shm/' + name), 'segment vanished early: ' + name
      assert int(channel.get(timeout=5).seq) == 7
      store.publish(1, lib.params_filled(1, 10))
      print('NAMES', ' '.join(registry.names))
      # Exit without calling close: atexit must unlink.
''')


def test_segments_outlive_attachers_and_are_unlinked_at_exit_without_tracker_noise():
  before = _shm_entries()
  script = _RESOURCE_TRACKER_SCRIPT.format(testdir=os.path.dirname(os.path.abspath(__file__)), root=ROOT)
  result = subprocess.run([sys.executable, '-c', script],
                          capture_output=True,
                          text=True,
                          timeout=120,
                          cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 0, result.stderr
  names = result.stdout.split('NAMES', 1)[1].split()
  assert len(names) == 2
  time.sleep(0.5)  # the resource tracker exits after its last client
  for name in names:
    assert not os.path.exists('/dev/shm/' + name)
  assert 'Traceback' not in result.stderr and 'leaked' not in result.stderr, result.stderr
  script_pid = int(names[0].split('_')[1])
  assert _shm_entries(script_pid) == set()
  assert _shm_entries() - before == set()


def test_sweep_stale_removes_segments_of_dead_owners():
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
  name = f'ebrl_{int(dead.stdout)}_deadbeef0000'
  with open(os.path.join('/dev/shm', name), 'wb') as f:
    f.write(b'x')
  assert name in transport.ShmRegistry.sweep().names
  assert not os.path.exists(os.path.join('/dev/shm', name))


# Liveness (issue 17): a peer SIGKILLed mid-call leaves no lock taken and no slot lost; what it recovered is
# counted; a waiter whose channel's creator died is told so.
def _hang(conn, *args, **kwargs):
  del args, kwargs
  conn.send('inside')
  time.sleep(600)


def put_and_die_mid_copy(channel, conn):
  """Child: a put that stops inside its copy (numpy.copyto, the copy step, hangs) until it is SIGKILLed."""
  import functools  # pylint: disable=g-import-not-at-top
  import numpy  # pylint: disable=g-import-not-at-top
  numpy.copyto = functools.partial(_hang, conn)
  channel.put(lib.item(5, 5))


def get_and_die_mid_copy(channel, conn):
  """Child: a get that stops while it builds the record it copied out, until it is SIGKILLed."""
  import functools  # pylint: disable=g-import-not-at-top
  from ebrl_jax.transport import specs  # pylint: disable=g-import-not-at-top
  specs.RecordSpec.build = functools.partial(_hang, conn)
  channel.get()


def publish_and_die_mid_copy(store, conn):
  import functools  # pylint: disable=g-import-not-at-top
  import numpy  # pylint: disable=g-import-not-at-top
  numpy.copyto = functools.partial(_hang, conn)
  store.publish(1, lib.params_filled(1))


def take_the_lock_and_die(obj, conn):
  obj._lock.acquire()  # pylint: disable=protected-access
  _hang(conn)


def _killed_inside(target, obj):
  reader, writer = CTX.Pipe(duplex=False)
  child = _start(target, obj, writer)
  assert reader.poll(60), 'the child never got inside the call'
  reader.recv()
  os.kill(child.pid, signal.SIGKILL)
  child.join(10)
  assert child.exitcode == -signal.SIGKILL


def test_a_writer_killed_mid_copy_gives_its_slot_back_and_it_is_counted():
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 2, registry=registry)
    _killed_inside(put_and_die_mid_copy, channel)
    for seq in range(2):  # the whole capacity: the dead writer's slot is free again
      channel.put(lib.item(0, seq), timeout=3)
    assert [int(channel.get(timeout=1).seq) for _ in range(2)] == [0, 1]  # its half-copied record never appears
    assert channel.try_get() is None
    assert channel.recovered() == (1, 0)


def test_a_reader_killed_mid_copy_leaves_its_record_to_the_next_reader():
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 2, registry=registry)
    channel.put(lib.item(0, 0))
    channel.put(lib.item(0, 1))
    _killed_inside(get_and_die_mid_copy, channel)  # it took record 0
    assert sorted(int(channel.get(timeout=3).seq) for _ in range(2)) == [0, 1]  # 0 delivered again, 1 once
    assert channel.try_get() is None
    for seq in (2, 3):
      channel.put(lib.item(0, seq), timeout=1)
    assert channel.recovered() == (1, 0)


def test_a_lock_whose_holder_was_killed_blocks_nobody():
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 2, registry=registry)
    store = transport.ShmParamStore(lib.params_template(10), registry=registry)
    _killed_inside(take_the_lock_and_die, channel)
    _killed_inside(take_the_lock_and_die, store)
    start = time.monotonic()
    channel.put(lib.item(0, 1), timeout=1)
    assert int(channel.get(timeout=1).seq) == 1
    store.publish(1, lib.params_filled(1, 10))
    assert store.latest()[0] == 1
    assert time.monotonic() - start < 1.0
    assert channel.recovered() == (0, 1) and store.recovered() == (0, 1)


def test_a_publisher_killed_mid_copy_leaves_the_store_whole():
  with transport.ShmRegistry() as registry:
    store = transport.ShmParamStore(lib.params_template(), registry=registry)
    _killed_inside(publish_and_die_mid_copy, store)  # it held the lock, its buffer half written
    with pytest.raises(LookupError):
      store.latest()  # its version never became the latest
    for version in (2, 3, 4):
      store.publish(version, lib.params_filled(version))
      version_read, params = store.latest()
      assert version_read == version
      lib.check_params(version, params)
    assert store.recovered() == (1, 1)


def wait_for_a_record(channel, out):
  """Grandchild: waits for a record; writes which exception ended the wait, and when."""
  from ebrl_jax.transport import base  # pylint: disable=g-import-not-at-top
  with open(out + '.ready', 'w'):
    pass
  try:
    channel.get(timeout=30)
    outcome = 'record'
  except base.PeerDied:
    outcome = 'PeerDied'
  except TimeoutError:
    outcome = 'TimeoutError'
  with open(out, 'w') as f:
    f.write(f'{outcome} {time.time()!r}')


_OWNER_SCRIPT = textwrap.dedent('''
    import multiprocessing, os, signal, sys, time
    sys.path[:0] = [{root!r}, {testdir!r}]
    from ebrl_jax import transport
    import transport_testlib as lib
    import test_shm_processes as t
    if __name__ == '__main__':
      registry = transport.ShmRegistry()
      channel = transport.ShmChannel(lib.ITEM_SPEC, 2, registry=registry)
      store = transport.ShmParamStore(lib.params_template(10), registry=registry)
      child = multiprocessing.get_context('spawn').Process(target=t.wait_for_a_record, args=(channel, {out!r}))
      child.start()
      while not os.path.exists({out!r} + '.ready'):
        time.sleep(0.01)
      print(' '.join(registry.names), flush=True)
      if {suicide!r}:
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(600)
''')


def _owner(tmp_path, suicide):
  out = str(tmp_path / 'outcome')
  script = _OWNER_SCRIPT.format(root=ROOT, testdir=os.path.dirname(os.path.abspath(__file__)), out=out, suicide=suicide)
  owner = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
  return owner, owner.stdout.readline().split(), out


def _wait_until(predicate, timeout):
  deadline = time.monotonic() + timeout
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.01)
  return predicate()


def test_a_waiter_whose_channel_creator_died_is_told_within_a_second(tmp_path):
  owner, _, out = _owner(tmp_path, suicide=False)
  killed = time.time()
  owner.kill()
  owner.wait()
  assert _wait_until(lambda: os.path.exists(out) and open(out).read(), 10), 'the waiter never returned'
  outcome, when = open(out).read().split()
  assert outcome == 'PeerDied' and float(when) - killed < 1.0


def test_a_sigkilled_owners_segments_go_with_its_last_attached_child(tmp_path):
  """The attachers leave the owner's registration with the resource tracker they share, which unlinks the
  segments once the last of them has exited; nothing needs a sweep."""
  owner, names, out = _owner(tmp_path, suicide=True)
  owner.wait()
  assert len(names) == 2 and all(n.startswith(f'ebrl_{owner.pid}_') for n in names)
  assert _wait_until(lambda: os.path.exists(out), 10)  # the child saw its channel's creator die, and exited
  assert _wait_until(lambda: not _shm_entries(owner.pid), 10), _shm_entries(owner.pid)


def test_sweep_frees_dead_and_zombie_owners_segments_and_leaves_live_ones(tmp_path):
  dead = int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True).stdout)
  zombie = subprocess.Popen(['true'])  # exited, not reaped until wait(): its pid still exists
  assert _wait_until(lambda: open(f'/proc/{zombie.pid}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z', 10)
  files = {
      f'ebrl_{dead}_aaaa': 100,
      f'ebrl_{zombie.pid}_bbbb': 50,
      f'ebrl_{os.getpid()}_cccc': 10,
      'ebrl_notapid_dddd': 1,
      f'other_{dead}_eeee': 1
  }
  for name, size in files.items():
    (tmp_path / name).write_bytes(b'x' * size)
  swept = transport.ShmRegistry.sweep(shm_dir=str(tmp_path))
  zombie.wait()
  assert sorted(swept.names) == sorted([f'ebrl_{dead}_aaaa', f'ebrl_{zombie.pid}_bbbb'])
  assert swept.nbytes == 150 and swept.owners == sorted([dead, zombie.pid])
  assert sorted(os.listdir(tmp_path)) == sorted([f'ebrl_{os.getpid()}_cccc', 'ebrl_notapid_dddd', f'other_{dead}_eeee'])


def test_a_put_interrupted_mid_copy_gives_its_slot_back(monkeypatch):
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(lib.ITEM_SPEC, 1, registry=registry)

    def interrupted(*args, **kwargs):
      raise KeyboardInterrupt('Ctrl-C mid-copy')

    with monkeypatch.context() as patch:
      patch.setattr(np, 'copyto', interrupted)
      with pytest.raises(KeyboardInterrupt):
        channel.put(lib.item(0, 0))
    channel.put(lib.item(0, 1), timeout=1)
    assert int(channel.get(timeout=1).seq) == 1 and channel.try_get() is None
