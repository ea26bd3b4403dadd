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
  assert name in transport.ShmRegistry.sweep_stale()
  assert not os.path.exists(os.path.join('/dev/shm', name))
