"""tensorboardX's import of torch is kept out of a run's start-up, and torch still imports afterwards."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip('tensorboardX')

_PROBE = textwrap.dedent("""
    import json, sys
    preload = sys.argv[2] == 'preload'
    if preload:
      import torch
    from ebrl_jax.runtime import metrics
    logger = metrics.MetricsLogger(sys.argv[1], 10, progress_bar=False)
    logger.log(0, {'loss': 1.0})
    loaded_during = 'torch' in sys.modules
    import tensorboardX.writer
    compatible = tensorboardX.writer.numpy_compatible.__module__
    import torch  # a user's own import after the logger: the real (here: fake) module
    print(json.dumps({'loaded_during': loaded_during, 'torch': torch.MARK, 'compatible': compatible,
                      'tb_files': bool(logger._tb)}))
    logger.close()
""")


def _probe(tmp_path, mode):
  fake = tmp_path / 'site' / 'torch'
  fake.mkdir(parents=True, exist_ok=True)
  (fake / '__init__.py').write_text('MARK = "fake torch"\nclass Tensor:\n  pass\n')
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / 'site'), os.getcwd()]))
  out = subprocess.run([sys.executable, '-c', _PROBE, str(tmp_path / mode), mode],
                       env=env,
                       capture_output=True,
                       text=True,
                       check=True,
                       timeout=120)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_tensorboard_writer_does_not_import_torch(tmp_path):
  got = _probe(tmp_path, 'plain')
  assert got == {'loaded_during': False, 'torch': 'fake torch', 'compatible': 'numpy', 'tb_files': True}


def test_torch_already_imported_is_left_to_tensorboardx(tmp_path):
  got = _probe(tmp_path, 'preload')
  assert got == {'loaded_during': True, 'torch': 'fake torch', 'compatible': 'torch', 'tb_files': True}
