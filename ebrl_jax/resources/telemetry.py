"""Run telemetry: device-wide SM activity and occupancy (NVML GPM), GPU memory per process (NVML) and CPU use
per worker process (/proc), sampled every `period` seconds by a thread of the controller.

Samples go to `<run_dir>/telemetry.jsonl`; with a trace directory they also become counter tracks of the
Perfetto timeline (`telemetry.trace.json`, merged with the workers' spans). Without a GPU or NVML the GPU
fields are absent and `gpu_reason` says why; CPU use is sampled on any Linux machine.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Dict, List, Optional

from absl import logging
import pynvml

from ebrl_jax.runtime import storage

_CLOCK_TICKS = os.sysconf('SC_CLK_TCK') if hasattr(os, 'sysconf') else 100


def cpu_seconds(pid: int) -> Optional[float]:
  """User + system CPU seconds of `pid` so far (None if it is gone)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None
  return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)


def visible_gpu(environ=None) -> str:
  """The GPU a process with this environment computes on: the first entry of CUDA_VISIBLE_DEVICES (an index in
  PCI-bus order, or a 'GPU-...' UUID), '0' when unset."""
  environ = os.environ if environ is None else environ
  first = environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0].strip()
  return first or '0'


def nvml_handle(pynvml, device: str):
  """NVML's handle of `device`: an index in PCI-bus order, or a 'GPU-...'/'MIG-...' UUID (see `visible_gpu`)."""
  if device.startswith(('GPU-', 'MIG-')):
    return pynvml.nvmlDeviceGetHandleByUUID(device)
  return pynvml.nvmlDeviceGetHandleByIndex(int(device))


def gpu_absent_reason() -> Optional[str]:
  """Why this machine has no NVIDIA GPU a process could compute on (NVML cannot start, or counts no device), or
  None where NVML sees at least one."""
  try:
    pynvml.nvmlInit()
  except pynvml.NVMLError as e:
    return f'NVML cannot start: {e}'
  try:
    count = pynvml.nvmlDeviceGetCount()
  except pynvml.NVMLError as e:
    return f'NVML cannot count its devices: {e}'
  finally:
    pynvml.nvmlShutdown()
  return None if count > 0 else 'NVML counts no GPU'


class _Gpm:
  """NVML GPM SM activity/occupancy between consecutive samples, plus per-process GPU memory, of one GPU."""

  def __init__(self, device: str):
    pynvml.nvmlInit()
    self._n = pynvml
    self._handle = nvml_handle(pynvml, device)
    self._samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    pynvml.nvmlGpmSampleGet(self._handle, self._samples[0])

  def read(self) -> Dict[str, float]:
    n = self._n
    n.nvmlGpmSampleGet(self._handle, self._samples[1])
    ids = (n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_SM_OCCUPANCY)
    mg = n.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics = n.NVML_GPM_METRICS_GET_VERSION, len(ids)
    mg.sample1, mg.sample2 = self._samples
    for i, m in enumerate(ids):
      mg.metrics[i].metricId = m
    n.nvmlGpmMetricsGet(mg)
    self._samples.reverse()
    out = {'sm_activity_pct': float(mg.metrics[0].value), 'sm_occupancy_pct': float(mg.metrics[1].value)}
    for proc in n.nvmlDeviceGetComputeRunningProcesses(self._handle):
      if proc.usedGpuMemory is not None:
        out[f'gpu_mem_mib/{proc.pid}'] = proc.usedGpuMemory / 2**20
    return out


def _close_quietly(f) -> None:
  """Closes a samples file whose last flush may fail (a full disk) without raising: the samples stay in memory."""
  try:
    f.close()
  except OSError:
    pass


class Telemetry:
  """Samples in a daemon thread from `start()` to `stop()`; `pids()` names the processes to watch by role."""

  def __init__(self,
               run_dir: str,
               pids: Callable[[], Dict[str, int]],
               period: float = 0.1,
               trace_dir: str = '',
               gpu: bool = True,
               device: Optional[str] = None,
               name: str = 'telemetry'):
    self._path = os.path.join(run_dir, f'{name}.jsonl')
    self.device = visible_gpu() if device is None else device
    self._pids, self._period, self._trace_dir = pids, period, trace_dir
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self.records: List[Dict[str, float]] = []
    self._gpm, self.gpu_reason = None, None
    if gpu:
      try:
        self._gpm = _Gpm(self.device)
      except Exception as e:  # pylint: disable=broad-except  (no NVML, no GPU, GPM unsupported, ...)
        self.gpu_reason = f'{type(e).__name__}: {e}'
    else:
      self.gpu_reason = 'disabled'

  def _sample(self, last_cpu: Dict[int, float], last_t: float) -> Dict[str, float]:
    now = time.time()
    record: Dict[str, float] = {'t': now}
    for role, pid in self._pids().items():
      cpu = cpu_seconds(pid)
      if cpu is None:
        continue
      if pid in last_cpu:
        record[f'cpu_pct/{role}'] = 100.0 * (cpu - last_cpu[pid]) / max(now - last_t, 1e-6)
      last_cpu[pid] = cpu
    if self._gpm is not None:
      try:
        gpu = self._gpm.read()
      except Exception as e:  # pylint: disable=broad-except
        self._gpm, self.gpu_reason = None, f'GPM read failed: {e}'
      else:
        roles = {pid: role for role, pid in self._pids().items()}
        for key, value in gpu.items():
          if key.startswith('gpu_mem_mib/'):
            pid = int(key.split('/')[1])
            key = f'gpu_mem_mib/{roles.get(pid, pid)}'
          record[key] = value
    return record

  def _loop(self) -> None:
    last_cpu: Dict[int, float] = {}
    last_t = time.time()
    try:
      f = open(self._path, 'a', buffering=1)
    except OSError as e:
      logging.warning('telemetry: cannot write %s (%s); sampling on, in memory only.', self._path, e)
      f = None
    try:
      while not self._stop.wait(self._period):
        record = self._sample(last_cpu, last_t)
        last_t = record['t']
        self.records.append(record)
        if f is not None:
          try:
            f.write(json.dumps(record) + '\n')
          except OSError as e:  # e.g. a full disk: the run's own writers report it; the samples stay in memory
            logging.warning('telemetry: writing %s failed (%s); sampling on, in memory only.', self._path, e)
            _close_quietly(f)
            f = None
    finally:
      if f is not None:
        _close_quietly(f)

  def start(self) -> 'Telemetry':
    self._thread = threading.Thread(target=self._loop, name='telemetry', daemon=True)
    self._thread.start()
    return self

  def stop(self) -> Dict[str, float]:
    """Stops sampling; writes the counter tracks for the timeline; returns the run's means."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    if self._trace_dir and self.records:
      try:
        self._write_trace()
      except OSError as e:  # best effort, like the samples file
        logging.warning('telemetry: could not write the counter tracks to %s: %s', self._trace_dir, e)
    return self.means()

  def means(self) -> Dict[str, float]:
    keys = sorted({k for r in self.records for k in r if k != 't'})
    out = {k: sum(r[k] for r in self.records if k in r) / sum(1 for r in self.records if k in r) for k in keys}
    out['samples'] = len(self.records)
    if self.gpu_reason:
      out['gpu_reason'] = self.gpu_reason
    return out

  def _write_trace(self) -> None:
    os.makedirs(self._trace_dir, exist_ok=True)
    pid = os.getpid()
    events = [{'name': 'process_name', 'ph': 'M', 'pid': pid, 'args': {'name': 'telemetry'}}]
    for r in self.records:
      for key, value in r.items():
        if key != 't':
          events.append({'name': key, 'ph': 'C', 'ts': int(r['t'] * 1e6), 'pid': pid, 'args': {'value': value}})
    path = os.path.join(self._trace_dir, 'telemetry.trace.json')
    storage.write_json(path, {'traceEvents': events})
