"""Stand-in for NVML's Python bindings (tests put this folder first on sys.path or PYTHONPATH): one GPU of
$EBRL_FAKE_GPU_MIB MiB (16384 by default), index 0 or UUID 'GPU-fake'. No GPM: telemetry reports it absent."""
import os

calls = []


class NVMLError(Exception):
  pass


class _Memory:

  def __init__(self, total: int):
    self.total, self.free, self.used = total, total, 0


def nvmlInit():
  calls.append('init')


def nvmlShutdown():
  calls.append('shutdown')


def nvmlDeviceGetHandleByIndex(index):
  if int(index) != 0:
    raise NVMLError(f'no GPU with index {index}')
  return 'GPU-fake'


def nvmlDeviceGetHandleByUUID(uuid):
  if uuid != 'GPU-fake':
    raise NVMLError(f'no GPU {uuid}')
  return uuid


def nvmlDeviceGetMemoryInfo(handle):
  del handle
  return _Memory(int(os.environ.get('EBRL_FAKE_GPU_MIB', '16384')) * 2**20)
