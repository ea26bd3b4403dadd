"""Dependencies point inward, by the layering in experiments/structure.py (LAYERS): no import cycle, no import
against the layering, no function-level import of a package module without a `# lazy:` reason, no file over 400
lines, no worker main over 120 lines; stage modules import only jax/flax/optax/chex/numpy (and the simulators for
sim, orbax for the trainer); importing the stages defines no absl flag and pulls in no worker, runtime, transport,
controller or main module. The checker's own tests are in tests/test_structure_tool.py."""
import os
import subprocess
import sys

import pytest

from experiments import structure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN_INTERNAL = ('ebrl_jax.main', 'ebrl_jax.controller', 'ebrl_jax.runtime', 'ebrl_jax.transport',
                      'ebrl_jax.resources')
RESULT = structure.analyze(ROOT)
STAGES = [m for m, info in RESULT['modules'].items() if info['layer'] == 1]


def _lines(key):
  return '\n'.join(structure.details(RESULT, key))


def test_no_import_cycle():
  assert not RESULT['cycles'], _lines('cycles')


def test_every_module_has_a_layer():
  assert not RESULT['unplaced'], _lines('unplaced')


def test_no_import_against_the_layering():
  assert not RESULT['layering'], _lines('layering')


def test_no_unexplained_function_level_import():
  assert not RESULT['unexplained_lazy'], _lines('unexplained_lazy')


def test_no_file_over_400_lines():
  assert not RESULT['long_files'], _lines('long_files')


def test_worker_mains_at_most_120_lines():
  assert RESULT['worker_mains'], 'no worker main found: the checker is looking at the wrong tree'
  assert not RESULT['long_worker_mains'], _lines('long_worker_mains')


@pytest.mark.parametrize('module', STAGES)
def test_stage_module_imports_only_allowed_roots(module):
  bad = [x for x in RESULT['stage_external'] if x['module'] == module]
  assert not bad, f'{RESULT["modules"][module]["path"]} imports {[x["name"] for x in bad]}; allowed roots: ' + str(
      sorted(structure.STAGE_COMMON | structure.STAGE_EXTRA[module.split('.')[1]]))


def test_importing_stages_defines_no_flags_and_no_runtime():
  code = ('import sys\n'
          'from absl import flags\n'
          'from ebrl_jax.trainer import stages as t\n'
          'from ebrl_jax.generation import stages as g\n'
          'from ebrl_jax.sim import stages as s\n'
          'from ebrl_jax import sim\n'
          f'bad = [m for m in sys.modules if m.startswith({FORBIDDEN_INTERNAL!r})]\n'
          'assert not bad, bad\n'
          'ours = [f for f in flags.FLAGS if "ebrl" in str(flags.FLAGS.find_module_defining_flag(f, ""))]\n'
          'assert not ours, ours\n'
          'assert "task" not in flags.FLAGS and "num_envs" not in flags.FLAGS\n'
          'print("ok")\n')
  result = subprocess.run([sys.executable, '-c', code],
                          cwd=ROOT,
                          capture_output=True,
                          text=True,
                          timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().endswith('ok')
