"""The structure checker (experiments/structure.py) on small synthetic package trees: each rule it enforces is
shown to fail where it should, so a passing tests/test_layering.py means something."""
import json
import textwrap

from experiments import structure


def _tree(tmp_path, files):
  """Writes {relative path under ebrl_jax/: source} (plus the package __init__) and analyzes the tree."""
  files = {'__init__.py': '', **files}
  for rel, source in files.items():
    path = tmp_path / 'ebrl_jax' / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
  return structure.analyze(str(tmp_path))


def _edges(result, src):
  return sorted({(e['dst'], e['function']) for e in result['edges'] if e['src'] == src})


def test_a_clean_tree_passes(tmp_path):
  result = _tree(
      tmp_path, {
          'config.py': 'import os\n',
          'types.py': 'from ebrl_jax import config\n',
          'sim/__init__.py': '',
          'sim/stages.py': 'import jax\nfrom ebrl_jax import types\n'
      })
  assert structure.failures(result) == []
  assert _edges(result, 'ebrl_jax.sim.stages') == [('ebrl_jax.types', None)]


def test_a_two_module_cycle_is_found(tmp_path):
  result = _tree(
      tmp_path, {
          'config.py': 'from ebrl_jax import types\n',
          'types.py': 'def f():\n  import ebrl_jax.config  # lazy: only f needs it\n'
      })
  assert [c['modules'] for c in result['cycles']] == [['ebrl_jax.config', 'ebrl_jax.types']]
  assert [(e['src'], e['dst']) for e in result['cycles'][0]['example']] == [('ebrl_jax.config', 'ebrl_jax.types'),
                                                                            ('ebrl_jax.types', 'ebrl_jax.config')]
  assert structure.failures(result) == ['import cycles']


def test_a_self_import_is_a_cycle(tmp_path):
  result = _tree(tmp_path, {'config.py': 'from ebrl_jax.config import x\n'})
  assert [c['modules'] for c in result['cycles']] == [['ebrl_jax.config']]


def test_an_upward_import_is_against_the_layering(tmp_path):
  result = _tree(
      tmp_path, {
          'sim/__init__.py': '',
          'controller/__init__.py': '',
          'controller/runner.py': '',
          'sim/stages.py': 'from ebrl_jax.controller import runner\n'
      })
  assert [(e['src'], e['dst']) for e in result['layering']] == [('ebrl_jax.sim.stages', 'ebrl_jax.controller.runner')]
  assert 'stage imports no controller' in result['layering'][0]['why']


def test_service_and_role_exceptions(tmp_path):
  result = _tree(
      tmp_path, {
          'runtime/__init__.py': '',
          'runtime/tracing.py': 'from ebrl_jax import config\nfrom ebrl_jax.sim import x\n',
          'transport/__init__.py': 'from ebrl_jax.runtime import tracing\n',
          'config.py': '',
          'resources/__init__.py': 'from ebrl_jax.sim import x\nfrom ebrl_jax.transport import y\n',
          'sim/__init__.py': '',
          'rollout/__init__.py': '',
          'rollout/groups.py': '',
          'trainer/__init__.py': '',
          'rollout/worker.py': 'from ebrl_jax.rollout import groups\nfrom ebrl_jax import main\n',
          'trainer/driver.py': '',
          'trainer/worker.py': 'from ebrl_jax.trainer import driver\nfrom ebrl_jax.rollout import groups\n',
          'main.py': ''
      })
  bad = sorted((e['src'], e['dst']) for e in result['layering'])
  assert bad == [('ebrl_jax.rollout.worker', 'ebrl_jax.main'), ('ebrl_jax.runtime.tracing', 'ebrl_jax.sim'),
                 ('ebrl_jax.trainer.worker', 'ebrl_jax.rollout.groups')]


def test_a_module_in_no_layer_fails(tmp_path):
  result = _tree(tmp_path, {'storage.py': ''})
  assert result['unplaced'] == ['ebrl_jax.storage']
  assert structure.failures(result) == ['modules in no layer']


def test_function_level_imports_need_a_lazy_reason(tmp_path):
  result = _tree(
      tmp_path, {
          'config.py':
              '',
          'types.py':
              '''\
      import typing
      if typing.TYPE_CHECKING:
        from ebrl_jax import main
      def explained():
        from ebrl_jax import config  # lazy: config is heavy
      def explained_above():
        # lazy: config is heavy
        from ebrl_jax import (
            config)
      class C:
        def unexplained(self):
          import ebrl_jax.config  # pylint: disable=g-import-not-at-top
      def empty_reason():
        from ebrl_jax import config  # lazy:
      '''
      })
  assert sorted((e['function'], e['lazy']) for e in result['edges']) == [('C.unexplained', False),
                                                                         ('empty_reason', False), ('explained', True),
                                                                         ('explained_above', True)]
  assert [e['function'] for e in result['unexplained_lazy']] == ['C.unexplained', 'empty_reason']
  assert structure.failures(result) == ['function-level imports with no `# lazy:` reason']


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
  result = _tree(
      tmp_path, {
          'config.py':
              '',
          'types.py':
              '',
          'sim/registry.py':
              '',
          'sim/__init__.py':
              '''\
      from . import registry
      from .registry import names
      from .. import types
      from ..config import Config
      from ebrl_jax.sim import registry as r, names as n
      ''',
          'sim/stages.py':
              'from . import registry\nfrom .. import types\n'
      })
  assert _edges(result, 'ebrl_jax.sim') == [('ebrl_jax.config', None), ('ebrl_jax.sim', None),
                                            ('ebrl_jax.sim.registry', None), ('ebrl_jax.types', None)]
  assert _edges(result, 'ebrl_jax.sim.stages') == [('ebrl_jax.sim.registry', None), ('ebrl_jax.types', None)]


def test_long_files_functions_and_worker_mains(tmp_path):
  body = lambda name, n: f'def {name}():\n' + '  x = 1\n' * (n - 1)
  result = _tree(tmp_path, {
      'config.py': body('long', 61) + body('ok_main', 120) + body('long_main', 121),
      'types.py': '\n' * 401
  })
  assert [(f['name'], f['lines']) for f in result['long_functions']] == [('long', 61)]
  assert [f['name'] for f in result['worker_mains']] == ['ok_main', 'long_main']
  assert [f['name'] for f in result['long_worker_mains']] == ['long_main']
  assert [f['module'] for f in result['long_files']] == ['ebrl_jax.types']
  assert structure.failures(result) == ['files over 400 lines', 'worker mains over 120 lines']


def test_stage_modules_import_only_allowed_roots(tmp_path):
  result = _tree(
      tmp_path, {
          'sim/__init__.py': 'import mujoco\n',
          'trainer/__init__.py': 'import orbax.checkpoint\n',
          'trainer/stages.py': 'import mujoco\ndef f():\n  import absl.flags  # lazy: x\n',
          'trainer/worker.py': 'import absl\n'
      })
  assert sorted(
      (x['module'], x['name']) for x in result['stage_external']) == [('ebrl_jax.trainer.stages', 'absl.flags'),
                                                                      ('ebrl_jax.trainer.stages', 'mujoco')]


def test_main_prints_counts_writes_json_and_fails(tmp_path, capsys):
  _tree(tmp_path, {'config.py': 'from ebrl_jax import types\n', 'types.py': 'from ebrl_jax import config\n'})
  out = tmp_path / 'structure.json'
  assert structure.main(['--root', str(tmp_path), '--json', str(out)]) == 1
  report = capsys.readouterr().out
  assert report.splitlines()[0].startswith('ebrl_jax: 3 modules') and 'FAIL: import cycles' in report
  figures = json.loads(out.read_text())
  assert figures['failures'] == ['import cycles'] and len(figures['edges']) == 2
