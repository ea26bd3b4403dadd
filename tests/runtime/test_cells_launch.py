"""The cells' launchers (runtime/launch.py, shared by --launcher=ray): the GPUs a host gives its cells where JAX or
CUDA is told to see none (an explicit --platform over JAX_PLATFORMS), and a cell that ends on a stop's exit code
without the stop its ranks agreed on in its summary (it stopped alone: a failure of that cell, named), against one
that recorded the agreed stop, or whose summary the launcher cannot see while rank 0's records it."""
import json
import re
import subprocess
import time

from ebrl_jax.runtime import launch
from tests import launch_testlib

SMI = 'GPU 0: NVIDIA H200 (UUID: GPU-1a2b-3c)\nGPU 1: NVIDIA H200 (UUID: GPU-4d5e-6f)\n'
AGREED = {'stopped': 'SIGTERM', 'iterations': 3, 'extra': {'cells': {'stop': {'reason': 'SIGTERM', 'iteration': 3}}}}


def test_jax_or_cuda_told_to_see_no_gpu_gives_the_cells_none(monkeypatch):
  monkeypatch.setattr(launch.shutil, 'which', lambda name: '/usr/bin/' + name)
  monkeypatch.setattr(launch.subprocess, 'run', lambda *a, **k: subprocess.CompletedProcess(a, 0, SMI, ''))
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')  # the cells then run on the CPU, whatever nvidia-smi lists
  assert launch.gpu_ids('') == []
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda,cpu')
  assert launch.gpu_ids('') == ['GPU-1a2b-3c', 'GPU-4d5e-6f']
  monkeypatch.delenv('JAX_PLATFORMS')
  for visible, gpus in (('-1', []), ('', []), (' ', []), ('0,-1,1', ['0']), ('1,0', ['1', '0'])):
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', visible)  # CUDA sees none past an entry of -1
    assert launch.gpu_ids('') == gpus, visible


def test_an_explicit_platform_overrides_jax_platforms_as_each_cell_does(monkeypatch):
  monkeypatch.setattr(launch.shutil, 'which', lambda name: '/usr/bin/' + name)
  monkeypatch.setattr(launch.subprocess, 'run', lambda *a, **k: subprocess.CompletedProcess(a, 0, SMI, ''))
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')  # each cell's configure_jax sets jax_platforms from --platform
  assert launch.gpu_ids('gpu') == launch.gpu_ids('cuda') == ['GPU-1a2b-3c', 'GPU-4d5e-6f']
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda')
  assert launch.gpu_ids('cpu') == []


def _Cell(pid, code, after_s, summary=None):  # pylint: disable=invalid-name  (reads as the class it makes)
  """A stand-in cell that ends with `code` `after_s` from now, first writing `summary` (path, dict) where given."""
  return launch_testlib.StandInCell(pid, code, time.monotonic() + after_s, summary)


def test_a_cell_that_ends_on_sigterm_without_the_agreed_stop_in_its_summary_fails_the_run(
    tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(launch, 'SUMMARY_WAIT_S', 0.2, raising=False)
  stale = tmp_path / 'rank1' / 'summary.json'  # an earlier run's, with its agreed stop: not this cell's
  stale.parent.mkdir()
  stale.write_text(json.dumps(AGREED))
  # rank 1 was SIGTERMed alone before it had a summary (e.g. in start-up); rank 0 then finds it gone and exits 3
  cells = [_Cell(11, 3, 0.3), _Cell(12, 143, 0.05)]
  code = launch.watch(cells, ['h0', 'h1'], str(tmp_path), 3, lambda: None, 0.02)
  err = capsys.readouterr().err
  assert code == 3, err
  assert re.search(
      r'FATAL: cell rank 1 \(pid 12 on h1\) died \(exit code 143: SIGTERM, but \S+rank1/summary.json records no '
      r'stop the ranks agreed on, so it stopped alone\); the other cells stopped: rank 0 after [\d.]+ s \(exit code '
      r'3\)', err), err
  # a summary of its own without the agreed stop (a second signal stopped it alone) is a failure too
  lone = dict(AGREED, extra={'cells': {'stop': None}})
  cells = [_Cell(11, 3, 0.3), _Cell(12, 130, 0.05, (str(stale), lone))]
  assert launch.watch(cells, ['h0', 'h1'], str(tmp_path), 3, lambda: None, 0.02) == 3
  assert 'died (exit code 130: SIGINT, but' in capsys.readouterr().err


def test_cells_that_recorded_the_agreed_stop_stop_the_run_together(tmp_path, capsys):
  cells = [
      _Cell(11, 143, 0.2, (str(tmp_path / 'summary.json'), AGREED)),
      _Cell(12, 143, 0.05, (str(tmp_path / 'rank1' / 'summary.json'), AGREED))
  ]
  assert launch.watch(cells, ['h0', 'h1'], str(tmp_path), 3, lambda: None, 0.02) == 143
  err = capsys.readouterr().err
  assert 'STOPPED: the cells stopped together on SIGTERM' in err and 'FATAL' not in err, err


def test_rank_ks_unseen_summary_waits_for_rank_0s_record_of_the_agreed_stop(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(launch, 'SUMMARY_WAIT_S', 0.2, raising=False)
  # rank 1 leaves the end barrier first; its summary is on its own host (--launcher=ray, a run_dir not shared):
  # only rank 0's summary, which it writes before it exits last, shows here
  cells = [_Cell(11, 143, 0.6, (str(tmp_path / 'summary.json'), AGREED)), _Cell(12, 143, 0.05)]
  assert launch.watch(cells, ['h0', 'h1'], str(tmp_path), 3, lambda: None, 0.02) == 143
  err = capsys.readouterr().err
  assert ('STOPPED: the cells stopped together on SIGTERM (sent to a cell, not here) (rank 0: exit code 143; rank 1: '
          'exit code 143); rank 0 stopped (SIGTERM) at iteration 3.') in err and 'FATAL' not in err, err
  # the wait is bounded: rank 0 left hanging in an all-reduce, rank 1 stopped alone once the others had the time
  # to notice a dead rank (2 heartbeat timeouts + NOTICE_S)
  monkeypatch.setattr(launch, 'NOTICE_S', 0.3)
  monkeypatch.setattr(launch, 'GRACE_S', 0.1)
  cells = [_Cell(21, 3, 60), _Cell(22, 143, 0.05)]
  assert launch.watch(cells, ['h0', 'h1'], str(tmp_path / 'other'), 0, lambda: None, 0.02) == 3
  err = capsys.readouterr().err
  assert re.search(
      r'FATAL: cell rank 1 \(pid 22 on h1\) died \(exit code 143: SIGTERM, but \S+rank1/summary.json '
      r'records no stop the ranks agreed on, so it stopped alone\); the other cells stopped: none on its '
      r'own; ranks \[0\] were still running', err), err
