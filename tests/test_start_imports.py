"""Start-up imports whose loaders swallow a KeyboardInterrupt (trimesh wraps its optional imports in `except
BaseException`) are loaded while main still holds stop signals, before its handlers turn them into interrupts:
a Ctrl-C or SIGTERM that came while they loaded would otherwise be lost and the run would train to its end."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r'''
import sys
from ebrl_jax import controller, main
def run(cfg, start_unix=None):
  print('loaded before the run:', 'trimesh' in sys.modules and 'brax.io.mjcf' in sys.modules, flush=True)
  raise KeyboardInterrupt('SIGINT')
controller.run = run
sys.argv = ['ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--run_dir=' + sys.argv[1]]
main.run_main()
'''


def test_trimesh_and_brax_loaders_are_imported_before_the_stop_handlers(tmp_path):
  probe = subprocess.run([sys.executable, '-c', PROBE, str(tmp_path / 'run')],
                         cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS='cpu'),
                         capture_output=True,
                         text=True,
                         timeout=120)
  assert 'loaded before the run: True' in probe.stdout, probe.stdout + probe.stderr[-2000:]
  assert probe.returncode == 130 and 'STOPPED: SIGINT' in probe.stderr
