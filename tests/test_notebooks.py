"""Every notebook in experiments/notebooks runs top to bottom, headless, and produces its key outputs.

Each notebook is executed with nbclient in a fresh IPython kernel started with this very interpreter (a private
kernelspec, so no `python3` kernel installed elsewhere is picked up), the repository root on PYTHONPATH,
JAX_PLATFORMS=cpu and MPLBACKEND=Agg. After the notebook's own cells, a probe cell prints a JSON line of values
read from the kernel, which the test checks. Stored notebooks must carry no outputs.
"""
import glob
import importlib
import json
import math
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, 'experiments', 'notebooks')
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, '*.ipynb')))
NOTEBOOK_TIMEOUT_S = 150  # whole notebook, kernel start included
PROBE_TAG = '__NOTEBOOK_PROBE__'

# Per notebook: an expression evaluated in the kernel after the last cell (JSON-serialisable), and its check.
_COMMON = "'figures': [len(f.axes) for f in map(plt.figure, plt.get_fignums())]"
PROBES = {
    '01_quickstart.ipynb': ("{'final_return': summary.final_eval_return, 'curve': len(summary.eval_curve), "
                            "'env_steps': summary.env_steps, " + _COMMON + "}"),
    '02_stages_in_your_code.ipynb':
        ("{'losses': [m['total_loss'] for m in history], 'obs_shape': list(batch.obs.shape), "
         "'raw_action_shape': list(batch.raw_action.shape), 'reward_shape': list(batch.reward.shape), "
         "'T': T, 'B': NUM_ENVS, 'O': spec.obs_dim, 'A': spec.action_dim, " + _COMMON + "}"),
    '03_reading_results.ipynb':
        ("{'rows': list(bench['figures']), 'seeds': len(bench['seeds']), 'stages': len(totals), "
         "'spans': len(spans), " + _COMMON + "}"),
}


def _check_01(out):
  assert math.isfinite(out['final_return']), out
  assert out['curve'] >= 2 and out['env_steps'] > 0, out
  assert out['figures'] and all(n >= 1 for n in out['figures']), out


def _check_02(out):
  assert len(out['losses']) >= 5 and all(math.isfinite(x) for x in out['losses']), out
  t, b = out['T'], out['B']
  assert out['obs_shape'] == [t, b, out['O']], out
  assert out['raw_action_shape'] == [t, b, 1, out['A']], out
  assert out['reward_shape'] == [t, b], out
  assert out['figures'], out


def _check_03(out):
  assert {'fused', 'sync', 'async', 'brax'} <= set(out['rows']) and out['seeds'] == 3, out
  assert out['stages'] > 0 and out['spans'] > 0, out
  assert len(out['figures']) >= 2, out


CHECKS = {
    '01_quickstart.ipynb': _check_01,
    '02_stages_in_your_code.ipynb': _check_02,
    '03_reading_results.ipynb': _check_03
}


def _deps():
  try:
    importlib.import_module('ipykernel')  # the kernel the notebooks run in
    import nbclient  # pylint: disable=g-import-not-at-top
    import nbformat  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    pytest.skip(f'notebook tests need nbclient, nbformat and ipykernel (pip install -e ".[test]"): {e}')
  return nbclient, nbformat


def _kernel_manager(tmp_path):
  """A kernel manager whose only kernelspec runs ipykernel with this interpreter."""
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  from jupyter_client.manager import KernelManager  # pylint: disable=g-import-not-at-top
  spec_dir = tmp_path / 'kernels' / 'ebrl_test'
  spec_dir.mkdir(parents=True)
  (spec_dir / 'kernel.json').write_text(
      json.dumps({
          'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
          'display_name': 'ebrl_jax test',
          'language': 'python'
      }))
  ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / 'kernels')])
  # The connection file goes in tmp_path too: by default jupyter_client makes it with tempfile.mkstemp in the
  # system's temporary folder and left one there per notebook run.
  return KernelManager(kernel_name='ebrl_test',
                       kernel_spec_manager=ksm,
                       connection_file=str(tmp_path / 'kernel-connection.json'))


def _probe_output(nb):
  for output in nb.cells[-1].get('outputs', []):
    for line in output.get('text', '').splitlines():
      if line.startswith(PROBE_TAG):
        return json.loads(line[len(PROBE_TAG):])
  raise AssertionError(f'the probe cell printed no {PROBE_TAG} line: {nb.cells[-1].get("outputs")}')


def test_notebooks_are_found_and_probed():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert names, f'no notebooks in {NOTEBOOK_DIR}'
  assert sorted(PROBES) == sorted(CHECKS) == names, 'each notebook needs a probe and a check here'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stored_clean(path):
  _, nbformat = _deps()
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  assert nb.cells[0].cell_type == 'markdown', 'the first cell says what the notebook shows'
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == 'code':
      assert not cell.outputs and cell.execution_count is None, f'cell {i} of {path} is stored with outputs'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nbclient, nbformat = _deps()
  name = os.path.basename(path)
  nb = nbformat.read(path, as_version=4)
  nb.cells.append(
      nbformat.v4.new_code_cell('import json as _json\nimport matplotlib.pyplot as plt\n'
                                f'print({PROBE_TAG!r} + _json.dumps({PROBES[name]}))'))

  # The kernel inherits this environment.
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')])))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  monkeypatch.setenv('TMPDIR', str(tmp_path))  # the notebooks' temporary run folders
  monkeypatch.setenv('JUPYTER_PLATFORM_DIRS', '1')

  deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S
  client = nbclient.NotebookClient(nb,
                                   km=_kernel_manager(tmp_path),
                                   timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                                   startup_timeout=120,
                                   resources={'metadata': {
                                       'path': NOTEBOOK_DIR
                                   }})
  try:
    client.execute()
  except nbclient.exceptions.CellTimeoutError as e:
    pytest.fail(f'{name} did not finish within {NOTEBOOK_TIMEOUT_S} s: {e}')
  CHECKS[name](_probe_output(nb))
