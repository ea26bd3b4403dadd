"""Joining the trainer ranks (runtime/distributed.py) before JAX is asked to: a coordinator address that is not
host:port is refused naming where it came from (JAX crashes on it), rank 0 refuses a port another process holds,
rank k > 0 waits for the coordinator's port in Python (a real socket on localhost: one that listens, one that
nobody does, a SIGTERM during the wait), and JAX's own errors come back naming the coordinator, with the join's
timeout passed to it."""
import os
import re
import signal
import socket
import threading

import jax
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import lifecycle


def test_a_coordinator_address_that_is_not_host_port_is_refused_naming_the_flag():
  for bad in ('localhost', 'localhost:', 'localhost:http', 'localhost:0', 'localhost:70000', ':1234', '::1:1234'):
    with pytest.raises(ValueError, match=re.escape(f'--coordinator_address={bad!r} is not host:port')):
      distributed.resolve(bad, 2, 1)
  with pytest.raises(ValueError, match=re.escape("JAX_COORDINATOR_ADDRESS='host0' is not host:port")):
    distributed.resolve('',
                        0,
                        -1,
                        environ={
                            'JAX_COORDINATOR_ADDRESS': 'host0',
                            'JAX_NUM_PROCESSES': '2',
                            'JAX_PROCESS_ID': '0'
                        })
  assert distributed.split_address('[::1]:12345') == ('::1', 12345)
  spec = distributed.resolve('host0:12345', 2, 1, init_timeout_s=7)
  assert (spec.coordinator_address, spec.process_id, spec.init_timeout_s) == ('host0:12345', 1, 7)
  cfg = config_lib.Config(cells=config_lib.CellConfig(num_processes=2, coordinator_address='host0', process_id=0))
  with pytest.raises(ValueError, match=re.escape("--coordinator_address='host0' is not host:port")):
    cells_lib.resolve(cfg)  # where the flags are read
  with pytest.raises(ValueError, match='init_timeout_s'):
    config_lib.CellConfig(init_timeout_s=0)


def test_rank_k_waits_for_the_coordinators_port_in_python_within_the_timeout(capsys):
  with socket.socket() as listening:
    listening.bind(('127.0.0.1', 0))
    listening.listen()
    distributed.wait_for_coordinator(f'127.0.0.1:{listening.getsockname()[1]}', 5, rank=1)  # returns at once
  with socket.socket() as bound:  # held, never listening: nobody accepts on this port
    bound.bind(('127.0.0.1', 0))
    address = f'127.0.0.1:{bound.getsockname()[1]}'
    with pytest.raises(distributed.JoinFailed,
                       match=re.escape(f'trainer rank 1: the coordinator at {address} (rank 0, '
                                       '--coordinator_address) accepted no connection within 0.3 s (--init_timeout_s')):
      distributed.wait_for_coordinator(address, 0.3, rank=1, poll_s=0.05)
    # a SIGTERM during the wait ends it (the handler's interrupt), where JAX's wait in C++ held it 300 s
    with lifecycle.stop_signals_as_interrupt():
      threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
      with pytest.raises(KeyboardInterrupt, match='SIGTERM'):
        distributed.wait_for_coordinator(address, 60, rank=1, poll_s=0.05)
  assert f'trainer rank 1: stopped (SIGTERM) while waiting for the coordinator at {address}.' in capsys.readouterr().err


def test_joining_refuses_a_busy_port_on_rank_0_and_names_the_coordinator_in_jaxs_errors(monkeypatch):
  calls = []

  def initialize(*args, **kwargs):
    calls.append((args, kwargs))
    raise RuntimeError('DEADLINE_EXCEEDED: Barrier timed out\nmore lines')

  monkeypatch.setattr(jax.distributed, 'initialize', initialize)
  monkeypatch.setattr(distributed, '_JOINED', [])
  recoverable = jax.config.jax_enable_recoverability
  try:
    with socket.socket() as listening:
      listening.bind(('127.0.0.1', 0))
      listening.listen()
      address = f'127.0.0.1:{listening.getsockname()[1]}'
      with pytest.raises(distributed.JoinFailed,
                         match=rf'trainer rank 0 cannot open its coordinator at {address} '
                         r'\(--coordinator_address\): port \d+ is not free on this host'):
        distributed.initialize(distributed.DistributedSpec(address, 2, 0))
      assert not calls  # refused before JAX (whose gRPC server crashes the process on a busy port)
      with pytest.raises(distributed.JoinFailed,
                         match=re.escape(f'trainer rank 1 of 2 could not join the others through the coordinator at '
                                         f'{address} (--coordinator_address), --init_timeout_s=7: RuntimeError: '
                                         'DEADLINE_EXCEEDED: Barrier timed out')):
        distributed.initialize(distributed.DistributedSpec(address, 2, 1, init_timeout_s=7))
  finally:
    jax.config.update('jax_enable_recoverability', recoverable)
  assert calls == [((address, 2, 1), {
      'initialization_timeout': 7,
      'heartbeat_timeout_seconds': 10,
      'shutdown_timeout_seconds': 30
  })]
  assert not distributed.joined()
