"""Liveness across processes (issue 17): a stop no SIGKILLed process can wedge, workers that notice a dead
controller within a second (getppid first, the parent-death signal), and a SIGKILLed controller that leaves no
process and, once swept, no shared memory."""
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ebrl_jax.runtime import lifecycle

CTX = multiprocessing.get_context('spawn')
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def _wait_until(predicate, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.01)
  return predicate()


def _in_thread(fn):
  """Runs fn in a daemon thread (it may never return); returns a dict that gets 'result' once it does."""
  out = {}
  threading.Thread(target=lambda: out.setdefault('result', fn()), daemon=True).start()
  return out


def hold_every_lock_then_hang(obj, conn):
  """Child: takes every lock-like attribute of `obj` (what a process killed mid-call would still hold), says so,
  then waits to be SIGKILLed."""
  for value in vars(obj).values():
    if hasattr(value, 'acquire'):
      value.acquire(False)
  conn.send('held')
  time.sleep(600)


def set_then_hang(flag, conn):
  flag.set()
  conn.send('set')
  time.sleep(600)


def exit_with_flag(flag):
  sys.exit(7 if flag.is_set() else 3)


def _kill_holder(target, obj):
  reader, writer = CTX.Pipe(duplex=False)
  child = CTX.Process(target=target, args=(obj, writer), daemon=True)
  child.start()
  assert reader.poll(60), 'the child never got going'
  reader.recv()
  os.kill(child.pid, signal.SIGKILL)
  child.join(10)
  assert child.exitcode == -signal.SIGKILL


def test_an_event_whose_lock_a_killed_process_held_wedges_its_readers():
  """What the old run-wide stop did: the controller, the trainer and every worker froze in `is_set`."""
  event = CTX.Event()
  _kill_holder(hold_every_lock_then_hang, event)
  out = _in_thread(event.is_set)
  time.sleep(1.0)
  assert 'result' not in out  # blocked for good (a daemon thread, left behind)


def test_the_stop_flag_has_no_lock_a_killed_process_could_keep():
  flag = lifecycle.make_stop(use_processes=True)
  assert not vars(flag).get('_value').__class__.__name__.startswith('Synchronized')  # a raw value: no lock
  _kill_holder(hold_every_lock_then_hang, flag)
  out = _in_thread(lambda: (flag.is_set(), flag.set(), flag.is_set()))
  assert _wait_until(lambda: 'result' in out, 1.0)
  assert out['result'] == (False, None, True)
  # A setter killed right after setting leaves the flag readable, set, in every process.
  other = lifecycle.make_stop(use_processes=True)
  _kill_holder(set_then_hang, other)
  assert other.is_set()
  reader = CTX.Process(target=exit_with_flag, args=(other,))
  reader.start()
  reader.join(60)
  assert reader.exitcode == 7
  assert isinstance(lifecycle.make_stop(use_processes=False), threading.Event)


def test_a_workers_control_flags_have_no_lock_a_killed_process_could_keep():
  """retire / ready / go (quota swaps) were multiprocessing Events: a standby SIGKILLed inside `ready.set()` would
  have frozen the controller's watch loop. Now each is a lock-free byte; a killed setter leaves it set."""
  from ebrl_jax.runtime import feedback  # pylint: disable=g-import-not-at-top
  control = feedback.make_control(use_processes=True, standby=True)
  for flag in (control.retire, control.ready, control.go):
    assert isinstance(flag, feedback.Flag) and not hasattr(flag, '_cond')
    _kill_holder(hold_every_lock_then_hang, flag)
    assert not flag.is_set() and not flag.wait(timeout=0.05)
  _kill_holder(set_then_hang, control.ready)
  assert control.ready.is_set() and control.ready.wait(timeout=0)
  waiter = _in_thread(lambda: control.go.wait(timeout=5))
  control.go.set()
  assert _wait_until(lambda: waiter.get('result') is True, 1.0)


# A controller stand-in: starts one child (a function of this file) with a StopFlag and waits to be SIGKILLed.
_PARENT = textwrap.dedent('''
    import multiprocessing, os, sys, time
    sys.path[:0] = [{root!r}, {here!r}]
    from ebrl_jax.runtime import lifecycle
    import test_liveness as t
    if __name__ == '__main__':
      ctx = multiprocessing.get_context('spawn')
      stop = lifecycle.StopFlag()
      child = ctx.Process(target=getattr(t, {child!r}), args=(stop, {out!r}), daemon=False)
      child.start()
      while not os.path.exists({out!r} + '.ready'):
        time.sleep(0.01)
      print(child.pid, flush=True)
      time.sleep(600)
''')


def watch_until_orphaned(stop, out):
  """Child: polls a ParentWatch (as every worker loop does) and writes when it saw its parent go. The death signal
  that unpickling `stop` armed is disarmed first, so that the watch alone is tested."""
  assert lifecycle.arm_parent_death_signal(0)
  watch = lifecycle.ParentWatch(stop)
  open(out + '.ready', 'w').close()
  while not watch.is_set():
    time.sleep(0.01)
  with open(out, 'w') as f:
    f.write(repr(time.time()))


def busy_without_polling(stop, out):
  """Child: a worker in a long import or compile, which asks nothing."""
  del stop
  open(out + '.ready', 'w').close()
  time.sleep(120)
  open(out, 'w').close()


def _start_parent(tmp_path, child):
  out = str(tmp_path / 'noticed')
  script = _PARENT.format(root=ROOT, here=HERE, child=child, out=out)
  parent = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
  child_pid = int(parent.stdout.readline())
  return parent, child_pid, out


def test_parent_watch_fires_within_a_second_of_the_parents_death(tmp_path):
  parent, child_pid, out = _start_parent(tmp_path, 'watch_until_orphaned')
  killed = time.time()
  parent.kill()
  parent.wait()
  try:
    assert _wait_until(lambda: os.path.exists(out) and open(out).read(), 5.0), 'the child never noticed'
    assert float(open(out).read()) - killed < 1.0
  finally:
    if lifecycle.pid_alive(child_pid):
      os.kill(child_pid, signal.SIGKILL)


def test_a_worker_busy_in_start_up_is_ended_within_a_second_of_its_controllers_death(tmp_path):
  parent, child_pid, out = _start_parent(tmp_path, 'busy_without_polling')
  parent.kill()
  parent.wait()
  try:
    assert _wait_until(lambda: not lifecycle.pid_alive(child_pid), 1.0), 'the worker outlived its controller'
  finally:
    if lifecycle.pid_alive(child_pid):
      os.kill(child_pid, signal.SIGKILL)
  assert not os.path.exists(out)


def test_a_watch_made_after_the_creator_died_fires_at_once():
  flag = lifecycle.StopFlag()
  flag.creator = _dead_pid()  # the controller died before this worker built its watch (getppid moved already)
  assert lifecycle.ParentWatch(flag).is_set()
  flag.creator = os.getpid()  # a live creator that is not our parent: only the parent's death counts
  watch = lifecycle.ParentWatch(flag)
  assert not watch.is_set()
  watch.set()
  assert watch.is_set() and flag.is_set()


def _dead_pid():
  return int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True).stdout)


def test_a_child_whose_creator_died_before_it_armed_the_signal_ends_itself():
  code = 'import sys; from ebrl_jax.runtime import lifecycle; lifecycle.end_with_creator(int(sys.argv[1])); print(1)'
  ended = subprocess.run([sys.executable, '-c', code, str(_dead_pid())], capture_output=True, text=True, cwd=ROOT)
  assert ended.returncode == -lifecycle.PARENT_DEATH_SIGNAL and not ended.stdout
  # A live creator that is not its parent (a grandchild's view): nothing happens.
  kept = subprocess.run([sys.executable, '-c', code, str(os.getppid())], capture_output=True, text=True, cwd=ROOT)
  assert kept.returncode == 0 and kept.stdout.strip() == '1'


def test_the_next_run_sweeps_a_dead_controllers_segments_and_says_how_much_it_freed(caplog):
  from ebrl_jax.controller import pipeline  # pylint: disable=g-import-not-at-top
  pid = _dead_pid()
  names = [f'ebrl_{pid}_feed0000000{i}' for i in range(2)]
  for name in names:
    with open(os.path.join('/dev/shm', name), 'wb') as f:
      f.write(b'x' * 4096)
  mine = f'ebrl_{os.getpid()}_feed00000009'
  with open(os.path.join('/dev/shm', mine), 'wb') as f:
    f.write(b'x')
  try:
    with caplog.at_level(logging.INFO):
      swept = pipeline.sweep_stale_segments()
    assert set(names) <= set(swept.names) and pid in swept.owners and swept.nbytes >= 2 * 4096
    assert not any(os.path.exists(os.path.join('/dev/shm', n)) for n in names)
    assert os.path.exists(os.path.join('/dev/shm', mine))  # a live owner's segment stays
    assert any(f'freed {swept.nbytes} bytes of shared memory' in r.getMessage() for r in caplog.records)
  finally:
    os.unlink(os.path.join('/dev/shm', mine))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_sigkilled_controller_leaves_no_process_and_once_swept_no_shared_memory(tmp_path):
  """Three tiny `async` runs (2 groups, shared memory), each controller SIGKILLed at another moment of start-up:
its own imports, its workers just spawned (still unpickling their arguments), compiling."""
  sys.path.insert(0, ROOT)
  from experiments import faults_kill_controller as faults  # pylint: disable=g-import-not-at-top
  moments = [(0.3, 'launch'), (0.0, 'workers'), (5.0, 'workers')]  # 20 more: experiments/results/faults_cpu.json
  records = [faults.trial(str(tmp_path / f'trial{i}'), delay, anchor) for i, (delay, anchor) in enumerate(moments)]
  for record in records:
    assert not record['processes_left'], record
    assert record['processes_gone_s'] < 3.0, record
    assert not record['segments_after_the_sweep'], record
  assert all(r['workers_started'] for r in records[1:]), records
