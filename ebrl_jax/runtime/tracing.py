"""Stage spans for a timeline that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Each process records complete events ("ph": "X") with a `Tracer` and writes `<trace_dir>/<role>.trace.json` when
closed; `merge` joins every process's file into `<trace_dir>/trace.json`. A tracer built with an empty
directory records nothing and costs one attribute check per span.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from typing import Dict, List, Optional

from ebrl_jax.runtime import storage


class Tracer:
  """Records spans `with tracer.span('sim/step'):` for one process (thread-safe)."""

  def __init__(self, trace_dir: str, role: str, max_events: int = 200_000):
    self.enabled = bool(trace_dir)
    self._dir, self._role, self._max = trace_dir, role, max_events
    self._events: List[Dict] = []
    self._lock = threading.Lock()
    self._pid = os.getpid()
    if self.enabled:
      os.makedirs(trace_dir, exist_ok=True)

  @contextlib.contextmanager
  def span(self, name: str, **args):
    if not self.enabled:
      yield
      return
    start = time.time_ns() // 1000
    try:
      yield
    finally:
      self.add(name, start, time.time_ns() // 1000 - start, **args)

  def add(self, name: str, start_us: int, duration_us: int, **args) -> None:
    if not self.enabled:
      return
    event = {
        'name': name,
        'cat': name.split('/')[0],
        'ph': 'X',
        'ts': start_us,
        'dur': duration_us,
        'pid': self._pid,
        'tid': threading.get_ident() % 100_000
    }
    if args:
      event['args'] = args
    with self._lock:
      if len(self._events) < self._max:
        self._events.append(event)

  def close(self) -> Optional[str]:
    if not self.enabled:
      return None
    meta = {'name': 'process_name', 'ph': 'M', 'pid': self._pid, 'args': {'name': self._role}}
    path = os.path.join(self._dir, self._role.replace('/', '_') + '.trace.json')
    with self._lock:
      events = [meta] + self._events
    storage.write_json(path, {'traceEvents': events})  # a reader never sees half a file
    return path


def merge(trace_dir: str) -> Optional[str]:
  """Joins the per-process files of `trace_dir` into `trace.json`; returns its path (None if nothing to join)."""
  events = []
  for path in sorted(glob.glob(os.path.join(trace_dir, '*.trace.json'))):
    with open(path) as f:
      events.extend(json.load(f)['traceEvents'])
  if not events:
    return None
  out = os.path.join(trace_dir, 'trace.json')
  with open(out, 'w') as f:
    json.dump({'traceEvents': events, 'displayTimeUnit': 'ms'}, f)
  return out


def summarize(trace_dir: str) -> Dict[str, Dict[str, float]]:
  """Per span name: count, total and mean milliseconds, from the merged trace."""
  path = os.path.join(trace_dir, 'trace.json')
  with open(path) as f:
    events = [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']
  out: Dict[str, Dict[str, float]] = {}
  for e in events:
    s = out.setdefault(e['name'], {'count': 0, 'total_ms': 0.0})
    s['count'] += 1
    s['total_ms'] += e['dur'] / 1000.0
  for s in out.values():
    s['mean_ms'] = s['total_ms'] / s['count']
  return out
