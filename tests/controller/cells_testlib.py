"""The launcher of several cells started as a child process for the cell tests (test_cells, test_cells_stop): its
output read on a thread, and the wait until rank 0 committed its first checkpoint (it trained past iteration 1)."""
import json
import os
import re
import subprocess
import threading
import time

from ebrl_jax.trainer import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Launched:
  """`argv` (a `python -m ebrl_jax.main ...` command line) started on the CPU with stdout and stderr in `lines`;
  returns once `run_dir`'s rank 0 committed a checkpoint (within `timeout_s`), else asserts with the output's tail
  after stopping the launcher."""

  def __init__(self, argv, run_dir, timeout_s=240.0):
    self.process = subprocess.Popen(argv,
                                    cwd=ROOT,
                                    env=dict(os.environ, JAX_PLATFORMS='cpu'),
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT,
                                    text=True)
    self.lines = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
    self._reader.start()
    deadline = time.monotonic() + timeout_s
    try:
      while not checkpoint.committed_steps(str(run_dir / 'checkpoints')):
        assert self.process.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
        time.sleep(0.2)
    except BaseException:
      self.process.terminate()  # the launcher passes SIGTERM on to its cells
      self.process.wait(timeout=60)
      raise

  def output(self):
    return ''.join(self.lines)

  def cell_pids(self):
    """The cells' pids, as the launcher printed them: [rank 0, rank 1]."""
    return cell_pids(self.output())

  def wait(self, timeout_s):
    """The launcher's exit code, once it and the reader of its output ended."""
    self.process.wait(timeout=timeout_s)
    self._reader.join(timeout=10)
    return self.process.returncode


def cell_pids(out):
  found = re.search(r'pids rank 0: (\d+), rank 1: (\d+)', out)
  assert found, out[-3000:]
  return [int(found.group(1)), int(found.group(2))]


def workers(run_dir):
  """Every process of a cell's run: its controller and its workers (workers.json)."""
  with open(os.path.join(run_dir, 'workers.json')) as f:
    record = json.load(f)
  return [record['controller'], *record['workers'].values()]
