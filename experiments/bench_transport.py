"""Transport hand-off costs between processes on this machine.

  PYTHONPATH=. python experiments/bench_transport.py [--out experiments/results/transport_cpu.json]

(a) One env-group round trip sim -> generation -> sim between two spawned processes: an observation record
    [64, 27] float32 out, an action record [64, 8] float32 back; p50/p99 over 2000 round trips after 200 of
    warm-up. Shared memory (Mailbox over ShmChannels) against multiprocessing.Queue with pickling; the
    in-thread channel as a floor for the Python overhead.
(b) Parameter broadcast: trainer publishes N float32 parameters (4 leaves), a reader process polls `version()`
    and copies with `latest()`; time from the start of `publish` to the reader holding its copy, for
    N = 1M and 100M; multiprocessing.Queue (pickled) as the reference.
(c) An MJX group's generation hand-off (`--generation_transport`): one act round trip through RemoteAct and the
    generation worker's ActServer, host path (device_get / device_put around the mailbox) and CUDA IPC path
    (device buffers, only the flags through the mailbox; needs CuPy and a GPU), at [64, 27] and [1024, 27].
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # (c): two JAX processes share one GPU
# pylint: disable=wrong-import-position
from ebrl_jax import transport
from ebrl_jax.transport import cuda_ipc
from experiments import handoff_round_trip
# pylint: enable=wrong-import-position

NUM_ENVS, OBS_DIM, ACTION_DIM = 64, 27, 8
WARMUP, ROUND_TRIPS = 200, 2000
CTX = multiprocessing.get_context('spawn')


class ObsRequest(NamedTuple):
  obs: np.ndarray  # [B, O] float32
  group: np.ndarray  # () int32


class ActionReply(NamedTuple):
  action: np.ndarray  # [B, A] float32


class Stamp(NamedTuple):
  version: np.ndarray  # () int64
  seen: np.ndarray  # () float64, perf_counter when the new version was noticed
  done: np.ndarray  # () float64, perf_counter when the copy was complete


REQUEST_SPEC = transport.record_spec(ObsRequest, {'obs': (NUM_ENVS, OBS_DIM), 'group': ()}, dtypes={'group': 'int32'})
REPLY_SPEC = transport.record_spec(ActionReply, {'action': (NUM_ENVS, ACTION_DIM)})
STAMP_SPEC = transport.record_spec(Stamp, {
    'version': (),
    'seen': (),
    'done': ()
},
                                   dtypes={
                                       'version': 'int64',
                                       'seen': 'float64',
                                       'done': 'float64'
                                   })


def _policy(obs: np.ndarray) -> ActionReply:
  return ActionReply(np.tanh(obs[:, :ACTION_DIM]))


def serve_mailbox(mailbox: transport.Mailbox) -> None:
  try:
    while True:
      for group, request in mailbox.gather(max_requests=8, timeout=60):
        mailbox.reply(group, _policy(request.obs), timeout=60)
  except transport.ChannelClosed:
    pass


def serve_queue(requests, replies) -> None:
  while True:
    request = requests.get(timeout=60)
    if request is None:
      return
    replies.put(_policy(request.obs))


def _percentiles(seconds) -> dict:
  us = np.asarray(seconds) * 1e6
  return {
      'p50_us': float(np.percentile(us, 50)),
      'p99_us': float(np.percentile(us, 99)),
      'mean_us': float(us.mean()),
      'n': int(us.size)
  }


def _round_trips(send, receive) -> dict:
  rng = np.random.default_rng(0)
  request = ObsRequest(rng.standard_normal((NUM_ENVS, OBS_DIM)).astype(np.float32), np.int32(0))
  times = []
  for i in range(WARMUP + ROUND_TRIPS):
    start = time.perf_counter()
    send(request)
    reply = receive()
    times.append(time.perf_counter() - start)
  np.testing.assert_array_equal(reply.action, _policy(request.obs).action)
  return _percentiles(times[WARMUP:])


def bench_round_trip_mailbox(kind: str) -> dict:
  registry = transport.ShmRegistry()
  mailbox = transport.make_mailbox(kind, REQUEST_SPEC, REPLY_SPEC, num_groups=1, registry=registry)
  if kind == 'shm':
    server = CTX.Process(target=serve_mailbox, args=(mailbox,), daemon=True)
  else:
    server = threading.Thread(target=serve_mailbox, args=(mailbox,), daemon=True)
  server.start()
  result = _round_trips(lambda r: mailbox.ask(r, timeout=60), lambda: mailbox.receive(0, timeout=60))
  mailbox.close()
  server.join(10)
  registry.close()
  return result


def bench_round_trip_mp_queue() -> dict:
  requests, replies = CTX.Queue(), CTX.Queue()
  server = CTX.Process(target=serve_queue, args=(requests, replies), daemon=True)
  server.start()
  result = _round_trips(requests.put, lambda: replies.get(timeout=60))
  requests.put(None)
  server.join(10)
  return result


def _template(n: int) -> dict:
  return {f'leaf{i}': np.zeros((n // 4,), np.float32) for i in range(4)}


def read_params(store, stamps, count: int) -> None:
  last = -1  # the owner publishes version 0 first
  for _ in range(count):
    while store.version() == last:
      pass  # NOTE: spin on purpose; this measures the hand-off, not a polling interval
    seen = time.perf_counter()
    last, params = store.latest()
    stamps.put(Stamp(np.int64(last), np.float64(seen), np.float64(time.perf_counter())), timeout=600)


def read_params_queue(queue, stamps, count: int) -> None:
  for _ in range(count):
    version, _ = queue.get(timeout=600)
    now = time.perf_counter()
    stamps.put((version, now, now))


def bench_broadcast(n: int, reps: int) -> dict:
  registry = transport.ShmRegistry()
  store = transport.ShmParamStore(_template(n), registry=registry)
  stamps = transport.ShmChannel(STAMP_SPEC, 4, registry=registry)
  reader = CTX.Process(target=read_params, args=(store, stamps, reps + 1), daemon=True)
  reader.start()
  rows = []
  for version in range(reps + 1):  # version 0 warms up both sides
    params = {k: np.full(v.shape, version, np.float32) for k, v in _template(n).items()}
    start = time.perf_counter()
    store.publish(version, params)
    published = time.perf_counter()
    stamp = stamps.get(timeout=600)
    assert int(stamp.version) == version
    rows.append((published - start, float(stamp.done) - float(stamp.seen), float(stamp.done) - start))
  reader.join(60)
  registry.close()
  publish, copy, total = (np.asarray(c[1:]) * 1e3 for c in zip(*rows))
  return {
      'num_params': n,
      'reps': reps,
      'publish_ms_median': float(np.median(publish)),
      'latest_copy_ms_median': float(np.median(copy)),
      'publish_to_reader_copy_ms_median': float(np.median(total)),
      'publish_to_reader_copy_ms_max': float(total.max()),
      'gbytes_per_s_end_to_end': float(4 * n / (np.median(total) / 1e3) / 1e9)
  }


def bench_broadcast_mp_queue(n: int, reps: int) -> dict:
  queue, stamps = CTX.Queue(), CTX.Queue()
  reader = CTX.Process(target=read_params_queue, args=(queue, stamps, reps + 1), daemon=True)
  reader.start()
  totals = []
  for version in range(reps + 1):
    params = {k: np.full(v.shape, version, np.float32) for k, v in _template(n).items()}
    start = time.perf_counter()
    queue.put((version, params))
    got_version, _, done = stamps.get(timeout=600)
    assert got_version == version
    totals.append(done - start)
  reader.join(60)
  total = np.asarray(totals[1:]) * 1e3
  return {
      'num_params': n,
      'reps': reps,
      'publish_to_reader_copy_ms_median': float(np.median(total)),
      'publish_to_reader_copy_ms_max': float(total.max())
  }


def generation_handoff() -> dict:
  """(c): an MJX group's act round trip through the generation worker's own pieces (experiments/
  handoff_round_trip.py), host path and CUDA IPC path (skipped with the reason where CuPy or a GPU is absent),
  at this bench's record size and at one W1 env group's."""
  out = {}
  for label, shape in (('64x27', handoff_round_trip.Shape(64, OBS_DIM, 1, ACTION_DIM)),
                       ('1024x27', handoff_round_trip.Shape(1024, OBS_DIM, 1, ACTION_DIM))):
    for kind in ('host', 'cuda_ipc'):
      reason = cuda_ipc.unavailable_reason() if kind == 'cuda_ipc' else None
      out[f'{kind}_{label}'] = ({
          'skipped': reason
      } if reason else handoff_round_trip.round_trips(kind, n=ROUND_TRIPS, warmup=WARMUP, shape=shape))
      print(f'{kind}_{label}', out[f'{kind}_{label}'], flush=True)
  return out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results', 'transport_cpu.json'))
  args = parser.parse_args()
  results = {
      'python': sys.version.split()[0],
      'numpy': np.__version__,
      'platform': platform.platform(),
      'cpu_count': os.cpu_count(),
      'affinity_cpus': len(os.sched_getaffinity(0)),
      'date': time.strftime('%Y-%m-%d %H:%M:%S'),
      'round_trip': {
          'record_shapes': {
              'obs': [NUM_ENVS, OBS_DIM],
              'action': [NUM_ENVS, ACTION_DIM]
          },
          'warmup': WARMUP,
          'round_trips': ROUND_TRIPS
      },
      'broadcast': {},
  }
  for name, fn in (('shm_mailbox', lambda: bench_round_trip_mailbox('shm')),
                   ('mp_queue_pickle', bench_round_trip_mp_queue), ('thread_mailbox_same_process',
                                                                    lambda: bench_round_trip_mailbox('thread'))):
    results['round_trip'][name] = fn()
    print(name, results['round_trip'][name], flush=True)
  results['generation_handoff'] = generation_handoff()
  for n, reps in ((1_000_000, 50), (100_000_000, 5)):
    for name, fn in (('shm_param_store', bench_broadcast), ('mp_queue_pickle', bench_broadcast_mp_queue)):
      key = f'{name}_{n // 1_000_000}M'
      results['broadcast'][key] = fn(n, reps)
      print(key, results['broadcast'][key], flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(results, f, indent=2)
  print('wrote', args.out)


if __name__ == '__main__':
  main()
