"""The README's two set-up commands are the ones CI and users run."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
  text = open(os.path.join(ROOT, 'README.md')).read()
  block = re.search(r'## Two commands.*?```bash\n(.*?)```', text, re.S).group(1)
  return [line for line in block.splitlines() if line and not line.startswith('#')]


def test_readme_has_two_commands_and_ci_runs_the_test_one():
  commands = _readme_commands()
  assert len(commands) == 2
  main_cmd, test_cmd = commands
  assert 'python -m ebrl_jax.main --flagfile=experiments/quickstart.flags' in main_cmd
  assert 'pytest' in test_cmd
  ci = open(os.path.join(ROOT, '.ci', 'run')).read()
  assert test_cmd in ci.splitlines(), 'the .ci/run script must run the README test command verbatim'
  assert os.path.exists(os.path.join(ROOT, 'experiments', 'quickstart.flags'))
