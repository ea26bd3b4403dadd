"""Ctrl-C at any moment of an async run's start-up stops it cleanly: exit code 130, one `STOPPED:` line, no
traceback, no worker and no shared memory left, and summary.json written once a worker had started. Before, a Ctrl-C
whose handler ran inside JAX's garbage-collection callback was printed as 'Exception ignored in
_xla_gc_callback' and lost, and the run trained on (the fault suite counted it a hang).

Each trial sends a real SIGINT to the run's process group, the way a terminal does, from inside a garbage-collection
callback of the controller's main thread (the place that lost it), at the first collection past a given delay after
launch: during imports, the controller's checks, the workers' spawn and their start-up, depending on the machine."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
         '--num_threads=1', '--noprogress_bar', '--telemetry_period_s=0', '--compilation_cache_dir=',
         '--schedule=async', '--num_groups=2', '--num_timesteps=100000000', '--num_evals=100000')
# The command line (`python -m ebrl_jax.main`), with a gc callback that sends the SIGINT once, from the main thread,
# and makes a Python call inside the callback so that the handler runs there; a main thread that collects nothing
# past the delay (the controller idle in its watch while the workers start) gets it from a thread 1 s later.
# Neither sends before ebrl_jax.main's first lines have taken the signals over: until then the interpreter runs no
# gc callback of the run's (JAX is not imported yet) and this wrapper's own would swallow the interrupt (a loaded
# CI machine took longer than 0.5 s to get there).
WRAPPER = r'''
import gc, os, runpy, signal, sys, threading, time
start, delay, marker = time.monotonic(), float(sys.argv[1]), sys.argv[2]
once = threading.Lock()
def send(way):
  if not once.acquire(blocking=False):
    return False
  with open(marker, 'w') as f:
    f.write(f'{way} {time.monotonic() - start:.2f}')
  os.killpg(os.getpgid(0), signal.SIGINT)
  return True
armed = []
def callback(phase, info):
  if not armed and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    armed.append(True)  # ebrl_jax.main's first lines took the signals over
  if (armed and phase == 'start' and threading.current_thread() is threading.main_thread() and
      time.monotonic() - start >= delay):
    if send('gc'):
      (lambda: None)()
def fallback():
  time.sleep(delay + 1.0)
  while not armed:
    time.sleep(0.05)
  send('thread')
gc.callbacks.append(callback)
threading.Thread(target=fallback, daemon=True).start()
sys.argv = ['ebrl_jax/main.py'] + sys.argv[3:]
runpy.run_module('ebrl_jax.main', run_name='__main__', alter_sys=True)
'''


@pytest.mark.parametrize('delay_s', [0.5, 2.0, 3.0, 5.0])
def test_a_ctrl_c_at_any_moment_of_start_up_stops_the_run_cleanly(tmp_path, delay_s):
  run_dir, marker = tmp_path / 'run', tmp_path / 'sent'
  proc = subprocess.Popen(
      [sys.executable, '-c', WRAPPER,
       str(delay_s), str(marker), *FLAGS, f'--run_dir={run_dir}'],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=True)
  try:
    _, err = proc.communicate(timeout=120)  # lost, the run trains on: this times out
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  assert marker.exists(), err[-3000:]
  sent_at = marker.read_text()  # how ('gc', 'thread') and when
  assert proc.returncode == 130, (sent_at, err[-3000:])
  assert 'Traceback' not in err and 'Exception ignored' not in err, err[-3000:]
  lines = [l for l in err.splitlines() if l.startswith(('STOPPED', 'FATAL'))]
  assert len(lines) == 1 and lines[0].startswith('STOPPED: SIGINT'), (sent_at, lines)
  assert not [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{proc.pid}_')]
  if (run_dir / 'workers.json').exists():  # workers had started: none is left, and the run has its summary
    runs_testlib.assert_nothing_left(run_dir)
    summary = json.load(open(run_dir / 'summary.json'))
    assert summary['stopped'] == 'SIGINT', summary
