"""The controller's stop signals are never lost (runtime/lifecycle.py): a Ctrl-C whose handler ran inside a
garbage-collection callback (JAX's `_xla_gc_callback`, where Python prints 'Exception ignored' and goes on) is
raised again outside it, and one that comes while a worker process spawns is held, then raised once the worker is
started, while the worker itself starts with SIGINT blocked and then ignores it (the controller decides the stop)."""
import gc
import multiprocessing
import os
import signal
import time

import pytest

from ebrl_jax.runtime import lifecycle


def _interrupt_inside_a_gc_callback(sig):
  """Registers a gc callback that, once armed (its list given a True), signals this process and runs a Python call
  inside the callback, where the handler then runs (as it did inside `_xla_gc_callback`); returns (the callback,
  for removal, and its arming list)."""
  armed = []

  def callback(phase, info):
    del info
    if phase == 'start' and armed == [True]:
      armed.append('sent')
      os.kill(os.getpid(), sig)
      (lambda: None)()  # the pending handler runs here, inside the callback

  gc.callbacks.append(callback)
  return callback, armed


def _collect_then_wait(armed):
  armed.append(True)
  gc.collect()
  assert armed == [True, 'sent']
  deadline = time.monotonic() + 1.0
  while time.monotonic() < deadline:  # where the main thread would go on with the run
    pass


@pytest.mark.parametrize('sig,name', [(signal.SIGINT, 'SIGINT'), (signal.SIGTERM, 'SIGTERM')])
def test_an_interrupt_raised_inside_a_gc_callback_is_raised_again_outside_it(sig, name, capsys):
  callback, armed = _interrupt_inside_a_gc_callback(sig)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt) as caught:
      with lifecycle.stop_signals_as_interrupt():
        _collect_then_wait(armed)
  finally:
    gc.callbacks.remove(callback)
    signal.signal(signal.SIGINT, previous)
  assert (caught.value.args[:1] or ('SIGINT',))[0] == name
  assert 'Exception ignored' not in capsys.readouterr().err


@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_without_the_redelivery_the_gc_callback_swallows_the_interrupt():
  """What the run met (the hook's reason to be): outside `stop_signals_as_interrupt` the same interrupt is lost."""
  callback, armed = _interrupt_inside_a_gc_callback(signal.SIGINT)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    _collect_then_wait(armed)  # nothing is raised (pytest's own unraisable hook records it)
  finally:
    gc.callbacks.remove(callback)
    signal.signal(signal.SIGINT, previous)


def _report_sigint(out):
  blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
  out.send((blocked, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))


def test_a_sigint_while_a_worker_spawns_is_raised_once_it_has_started_and_the_worker_ignores_it():
  ctx = multiprocessing.get_context('spawn')
  reader, writer = ctx.Pipe(duplex=False)
  stop = lifecycle.StopFlag(ctx)
  worker = ctx.Process(target=lifecycle.run_worker, args=(stop, _report_sigint, (writer,), {}), daemon=True)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      with lifecycle.spawning():
        worker.start()
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt inside multiprocessing's start
        started = worker.pid  # reached: the interrupt waits for the end of the block
    assert started is not None
    assert reader.poll(60), 'the worker reported nothing'
    assert reader.recv() == (False, True
                            )  # unblocked again, and ignoring SIGINT: a Ctrl-C of the group is the controller's
  finally:
    signal.signal(signal.SIGINT, previous)
    worker.join(30)
  assert worker.exitcode == 0
  assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
