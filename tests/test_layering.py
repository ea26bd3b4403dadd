"""Dependencies point inward: stage modules import only jax/flax/optax/chex/numpy (and the simulators for sim)
plus ebrl_jax.types/config and their own package; importing them defines no absl flag and pulls in no worker,
transport, controller or main module."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_PACKAGES = ('sim', 'generation', 'trainer', 'rollout')
# Third-party roots a stage may import. brax and mujoco only in sim; orbax only in the trainer's checkpoint module.
COMMON = {'jax', 'flax', 'optax', 'chex', 'numpy', 'typing', 'functools', 'dataclasses', '__future__', 'math',
          'collections', 'os', 'concurrent', 'threading', 'enum', 'abc', 'itertools', 'time', 'json', 'shutil',
          'contextlib', 'logging', 'etils', 'importlib', 'pathlib', 'warnings'}
EXTRA = {'sim': {'brax', 'mujoco'}, 'generation': set(), 'trainer': {'orbax'}, 'rollout': set()}
FORBIDDEN_INTERNAL = ('ebrl_jax.main', 'ebrl_jax.controller', 'ebrl_jax.transport', 'ebrl_jax.resources')


def _stage_modules():
  for package in STAGE_PACKAGES:
    folder = os.path.join(ROOT, 'ebrl_jax', package)
    for name in sorted(os.listdir(folder)):
      if name.endswith('.py') and name != 'worker.py':
        yield package, os.path.join(folder, name)


def _imports(path):
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      yield node.module


@pytest.mark.parametrize('package,path', list(_stage_modules()), ids=lambda v: os.path.basename(str(v)))
def test_stage_module_imports_only_allowed_roots(package, path):
  allowed = COMMON | EXTRA[package]
  for module in _imports(path):
    root = module.split('.')[0]
    if root == 'ebrl_jax':
      assert not module.startswith(FORBIDDEN_INTERNAL), f'{path} imports {module}'
      # Stages may build on other stage packages (the trainer's losses evaluate the policy), never on workers.
      assert module in ('ebrl_jax', 'ebrl_jax.types', 'ebrl_jax.config') or module.startswith(
          tuple(f'ebrl_jax.{p}' for p in STAGE_PACKAGES)), f'{path} imports {module}'
      assert not module.endswith('.worker'), f'{path} imports the worker module {module}'
    else:
      assert root in allowed, f'{path} imports {module}; allowed roots for {package}: {sorted(allowed)}'


def test_importing_stages_defines_no_flags_and_no_runtime():
  code = (
      'import sys\n'
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
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().endswith('ok')
