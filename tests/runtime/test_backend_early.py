"""startup.start_backend_early: JAX's backend started on a thread, ready for the main thread; a backend that cannot
start leaves its error to the main thread's first use."""
import subprocess
import sys
import textwrap

from ebrl_jax.runtime import startup


def _python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_backend_started_on_the_thread_serves_the_main_thread():
  out = _python('''
      import threading
      from ebrl_jax.runtime import startup
      startup.configure_jax('cpu', '')
      thread = startup.start_backend_early()
      assert thread.daemon and thread.name == 'jax-backend-start'
      thread.join(60)
      from jax._src import xla_bridge
      assert xla_bridge._backends, 'the thread started no backend'
      import jax, jax.numpy as jnp
      print(jax.devices()[0].platform, int(jnp.arange(4).sum()))
  ''')
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ['cpu', '6']


def test_a_backend_that_cannot_start_fails_on_the_main_thread():
  out = _python('''
      from ebrl_jax.runtime import startup
      startup.configure_jax('no_such_platform', '')
      startup.start_backend_early().join(60)
      print('thread done')
      import jax
      jax.devices()
  ''')
  assert 'thread done' in out.stdout
  assert out.returncode != 0
  assert 'no_such_platform' in out.stderr
  assert 'Exception in thread' not in out.stderr


def test_thread_is_returned_started():
  thread = startup.start_backend_early()
  thread.join(60)
  assert not thread.is_alive()
