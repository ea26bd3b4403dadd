"""Joining the trainer ranks (runtime/distributed.py) before JAX is asked to: a coordinator address that is not
host:port is refused naming where it came from (JAX crashes on it, and every later message names that source too),
rank 0 refuses a port another process holds (an IPv4 holder with net.ipv6.bindv6only=1 as well) or one that needs
privileges, rank k > 0 waits for the coordinator's port in Python (a real socket on localhost: one that listens,
one that nobody does, a SIGTERM or the trainer's stop during the wait, a host name that resolves only later), and
JAX's own errors come back naming the coordinator, with what is left of the join's timeout passed to it."""
import errno
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
from ebrl_jax.trainer import worker


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


def _listening():
  listening = socket.socket()
  listening.bind(('127.0.0.1', 0))
  listening.listen()
  return listening, f'127.0.0.1:{listening.getsockname()[1]}'


def test_a_coordinator_host_that_resolves_only_later_is_asked_again_until_the_timeout(monkeypatch):
  real, failures = socket.create_connection, [socket.EAI_NONAME, socket.EAI_AGAIN]

  def create_connection(address, *args, **kwargs):  # rank 0's DNS name appears once its pod is up (Kubernetes)
    if failures:
      raise socket.gaierror(failures.pop(0), 'Name or service not known')
    return real(('127.0.0.1', address[1]), *args, **kwargs)

  monkeypatch.setattr(distributed.socket, 'create_connection', create_connection)
  listening, address = _listening()
  with listening:
    port = address.rpartition(':')[2]
    assert distributed.wait_for_coordinator(f'rank0.cells:{port}', 5, rank=1, poll_s=0.01) < 5
    assert not failures
    failures.extend([socket.EAI_NONAME] * 1000)  # a name that never resolves: the timeout's message says so
    with pytest.raises(distributed.JoinFailed,
                       match=re.escape(f"trainer rank 1: unknown host: the coordinator's host in "
                                       f'--coordinator_address=rank0.cells:{port} did not resolve here within 0.2 s')):
      distributed.wait_for_coordinator(f'rank0.cells:{port}', 0.2, rank=1, poll_s=0.01)


def test_the_trainers_stop_ends_the_join_and_jax_gets_what_is_left_of_the_timeout(monkeypatch, capsys):
  with socket.socket() as bound:  # nobody accepts on this port
    bound.bind(('127.0.0.1', 0))
    address = f'127.0.0.1:{bound.getsockname()[1]}'
    asked = []

    def should_stop():  # the trainer's SIGINT flag, set before the third poll
      asked.append(1)
      return 'SIGINT' if len(asked) >= 3 else None

    with pytest.raises(KeyboardInterrupt, match='SIGINT'):
      distributed.initialize(distributed.DistributedSpec(address, 2, 1, init_timeout_s=60), should_stop)
    assert len(asked) == 3
  assert f'trainer rank 1: stopped (SIGINT) while waiting for the coordinator at {address}.' in capsys.readouterr().err
  # the trainer worker's stop for the wait: its SIGINT flag, else the run's stop
  channels = worker.TrainerChannels(None, None, threading.Event(), interrupt=threading.Event())
  assert worker._stop_reason(channels) is None  # pylint: disable=protected-access
  channels.stop.set()
  assert worker._stop_reason(channels) == 'stopped by the controller'  # pylint: disable=protected-access
  channels.interrupt.set()
  assert worker._stop_reason(channels) == 'SIGINT'  # pylint: disable=protected-access
  # JAX waits only what the Python wait left of --init_timeout_s (at least MIN_JAX_WAIT_S)
  calls = []
  monkeypatch.setattr(distributed, 'wait_for_coordinator', lambda *a, **k: 6.2)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: calls.append(k['initialization_timeout']))
  monkeypatch.setattr(distributed, '_JOINED', [])
  monkeypatch.setattr(distributed, '_client', lambda: None)
  recoverable = jax.config.jax_enable_recoverability
  try:
    for init_timeout_s in (20, 10):
      distributed.initialize(distributed.DistributedSpec(address, 2, 1, init_timeout_s=init_timeout_s))
  finally:
    jax.config.update('jax_enable_recoverability', recoverable)
  assert calls == [14, distributed.MIN_JAX_WAIT_S]  # 20 - 6.2 -> 14 (rounded up); 10 - 6.2 -> 4, raised to 5


def test_the_messages_name_where_the_address_came_from_and_a_privileged_port(monkeypatch):
  listening, address = _listening()
  with listening:
    spec = distributed.resolve('',
                               0,
                               -1,
                               environ={
                                   'JAX_COORDINATOR_ADDRESS': address,
                                   'JAX_NUM_PROCESSES': '2',
                                   'JAX_PROCESS_ID': '0'
                               })
    assert spec.address_source == 'JAX_COORDINATOR_ADDRESS'
    assert distributed.resolve(address, 2, 0).address_source == '--coordinator_address'
    with pytest.raises(distributed.JoinFailed, match=re.escape(f'at {address} (JAX_COORDINATOR_ADDRESS): port')):
      distributed.initialize(spec)
  with socket.socket() as bound:
    bound.bind(('127.0.0.1', 0))
    address = f'127.0.0.1:{bound.getsockname()[1]}'
    with pytest.raises(distributed.JoinFailed, match=re.escape('(rank 0, JAX_COORDINATOR_ADDRESS) accepted no')):
      distributed.wait_for_coordinator(address, 0.1, rank=1, poll_s=0.05, source='JAX_COORDINATOR_ADDRESS')

  class Unprivileged(socket.socket):  # root may bind port 80 here: a process without the privilege may not

    def bind(self, address):
      raise PermissionError(errno.EACCES, 'Permission denied')

  monkeypatch.setattr(distributed.socket, 'socket', Unprivileged)
  with pytest.raises(distributed.JoinFailed,
                     match=re.escape('trainer rank 0 cannot open its coordinator at host0:80 (--coordinator_address): '
                                     'port 80 needs privileges on this host (Permission denied; ports below 1024')):
    distributed.check_port_free('host0:80')


@pytest.mark.skipif(not socket.has_ipv6, reason='no IPv6 on this host')
def test_rank_0_sees_an_ipv4_holder_where_ipv6_sockets_are_v6_only(monkeypatch):
  set_v6only = []

  class V6Only(socket.socket):  # net.ipv6.bindv6only=1: an IPv6 socket ignores IPv4 unless told otherwise

    def __init__(self, family=socket.AF_INET, *args, **kwargs):
      super().__init__(family, *args, **kwargs)
      if family == socket.AF_INET6:
        super().setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)

  class NoDualStack(V6Only):  # a host where IPV6_V6ONLY cannot be changed: IPv4 is probed as well

    def setsockopt(self, level, option, value):
      if level == socket.IPPROTO_IPV6 and option == socket.IPV6_V6ONLY:
        set_v6only.append(value)
        raise OSError(errno.ENOPROTOOPT, 'Protocol not available')
      super().setsockopt(level, option, value)

  holder, address = _listening()  # IPv4 only
  with holder:
    for kind in (V6Only, NoDualStack):
      monkeypatch.setattr(distributed.socket, 'socket', kind)
      with pytest.raises(distributed.JoinFailed, match='is not free on this host'):
        distributed.check_port_free(address)
  assert set_v6only == [0]
