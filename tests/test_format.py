"""One formatter for the repo: every Python file is as yapf (pinned in setup.py's test extra, style in
.style.yapf) leaves it. To fix a failure: `yapf -i -r -p ebrl_jax tests experiments setup.py`."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_python_file_is_formatted():
  listed = subprocess.run(['git', 'ls-files', '*.py'], cwd=ROOT, capture_output=True, text=True, check=True)
  files = [f for f in listed.stdout.split() if os.path.exists(os.path.join(ROOT, f))]
  assert len(files) > 50, files  # the package, the tests and the experiments
  proc = subprocess.run([sys.executable, '-m', 'yapf', '--diff', '--parallel', *files],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=600)
  changed = [line[4:].split('\t')[0] for line in proc.stdout.splitlines() if line.startswith('--- ')]
  assert proc.returncode == 0 and not changed, f'not formatted (run yapf -i on them): {changed}\n{proc.stderr}'
