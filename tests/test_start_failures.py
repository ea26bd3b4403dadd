"""A run that cannot write its files from the start: a disk already full (a real tmpfs in a private mount namespace,
as in tests/test_disk_full.py), one with too little room for a first checkpoint, a --run_dir whose config.json
cannot be written, and an OS error that no writer of the run named. Each is one `FATAL:` line naming the run
directory and what is wrong, no traceback, the exit code the README gives (3 for a full disk), no worker started
and no shared memory left."""
import os
import subprocess
import sys

import pytest

from ebrl_jax.runtime import errors

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Inside the namespace: a 2 MiB tmpfs filled up to $FREE_PAGES free 4 KiB pages, with a previous run's config.json
# in the run directory; the run's log, exit code, its files after and the shared memory its pid left go to $OUT.
SCRIPT = r'''
set -u
D=$(mktemp -d)
mount -t tmpfs -o size=2m tmpfs "$D" || exit 90
mkdir -m 700 "$D/run" && echo '{"previous": "run"}' > "$D/run/config.json"
dd if=/dev/zero of="$D/spare" bs=4k count=$FREE_PAGES >/dev/null 2>&1
dd if=/dev/zero of="$D/fill" bs=4k >/dev/null 2>&1
rm -f "$D/spare"
"$PY" -m ebrl_jax.main --flagfile=experiments/quickstart.flags --run_dir="$D/run" --num_timesteps=2000 \
    --num_evals=0 --compilation_cache_dir= --noprogress_bar $FLAGS > "$OUT/log" 2>&1 &
pid=$!
wait $pid; echo $? > "$OUT/exit"
cp "$D/run/config.json" "$OUT/config.json"
ls "$D/run" > "$OUT/files"
ls /dev/shm | grep "^ebrl_${pid}_" > "$OUT/shm"
umount "$D"
'''


def _run_on_a_full_disk(tmp_path, free_pages, flags=''):
  if not runs_testlib.can_mount_a_tmpfs():
    pytest.skip('cannot mount a tmpfs in a private namespace here (unshare -rm)')
  env = dict(os.environ,
             PY=sys.executable,
             FLAGS=flags,
             OUT=str(tmp_path),
             FREE_PAGES=str(free_pages),
             PYTHONPATH=ROOT,
             JAX_PLATFORMS='cpu')
  proc = subprocess.run(['unshare', '-rm', 'bash', '-c', SCRIPT],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  log = (tmp_path / 'log').read_text()
  fatal = [line for line in log.splitlines() if line.startswith('FATAL: ')]
  assert len(fatal) == 1, log[-3000:]
  assert not (tmp_path / 'shm').read_text().split(), 'shared memory left behind'
  return int((tmp_path / 'exit').read_text()), fatal[0], log


@pytest.mark.parametrize('flags', ['', '--schedule=async --num_groups=2'], ids=['fused', 'async_processes'])
def test_a_disk_full_at_start_is_one_fatal_line_and_exit_code_3(tmp_path, flags):
  """Before the fix: config.json's write raised a bare OSError (a traceback, exit code 1)."""
  code, fatal, log = _run_on_a_full_disk(tmp_path, 0, flags)
  assert code == 3, log[-3000:]
  assert 'Traceback' not in log, log[-3000:]
  assert '/run is full (No space left on device)' in fatal and 'config.json could not be written' in fatal, fatal
  assert 'nothing to resume: free space and start again' in fatal
  # the previous run's config.json stays as it was; no worker started (none recorded) and nothing else written
  assert (tmp_path / 'config.json').read_text() == '{"previous": "run"}\n'
  assert (tmp_path / 'files').read_text().split() == ['config.json']


def test_a_checkpoint_that_finds_the_disk_full_is_not_called_out_of_memory(tmp_path):
  """128 KiB free: config.json and the metrics fit, the first checkpoint does not. Tensorstore names its failed
  write RESOURCE_EXHAUSTED, which the run took for XLA's refused allocation ('FATAL: out of memory: ...' with the
  flags that size memory as the fix)."""
  code, fatal, log = _run_on_a_full_disk(tmp_path, 32)
  assert code == 3, log[-3000:]
  assert fatal.startswith('FATAL: the disk holding ') and 'is full' in fatal, fatal
  assert 'out of memory' not in fatal and '--num_envs' not in fatal, fatal


def test_a_tensorstore_write_to_a_full_disk_is_no_allocation_failure():
  disk = ('RESOURCE_EXHAUSTED: Error writing "opt_state.0.mu/0" in OCDBT database at local file "/r/checkpoints/1'
          '.orbax-checkpoint-tmp/state/ocdbt.process_0/": Failed writing: "/r/d/77": Failed to write 2888300 bytes '
          "to file 22: No space left on device [os_error_code='28']")
  assert errors.out_of_memory(ValueError(disk)) is None
  xla = 'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.'
  assert errors.out_of_memory(RuntimeError('INTERNAL: x\n' + xla)) == xla


def _main(*args, prelude=''):
  code = (f'{prelude}\n'
          'import sys\n'
          'from ebrl_jax import main\n'
          'sys.argv = ["ebrl_jax.main", *sys.argv[1:]]\n'
          'main.run_main()\n')
  return subprocess.run([sys.executable, '-c', code, *args],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=120)


def test_a_config_json_that_cannot_be_written_refuses_the_run_dir(tmp_path):
  """A directory where config.json goes: os.replace fails with IsADirectoryError, an OS error but no full disk."""
  run_dir = tmp_path / 'run'
  (run_dir / 'config.json' / 'inside').mkdir(parents=True)
  run_dir.chmod(0o700)
  done = _main('--flagfile=experiments/quickstart.flags', f'--run_dir={run_dir}', '--compilation_cache_dir=')
  fatal = [line for line in done.stderr.splitlines() if line.startswith('FATAL: ')]
  assert done.returncode == 2, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr and len(fatal) == 1, done.stderr[-3000:]
  assert fatal[0].startswith(f'FATAL: --run_dir={run_dir}: {run_dir}/config.json cannot be written (') and \
      'Is a directory' in fatal[0], fatal[0]
  assert os.listdir(run_dir) == ['config.json']


def test_an_os_error_no_writer_named_is_one_fatal_line_with_exit_code_3(tmp_path):
  """Permission denied on a run file mid-start (say), raised past every writer's own handling."""
  prelude = ('from ebrl_jax import controller\n'
             'def refuse(cfg, start_unix=None):\n'
             f'  raise PermissionError(13, "Permission denied", "{tmp_path}/run/metrics.jsonl")\n'
             'controller.run = refuse\n')
  done = _main('--flagfile=experiments/quickstart.flags', f'--run_dir={tmp_path}/run', prelude=prelude)
  fatal = [line for line in done.stderr.splitlines() if line.startswith('FATAL: ')]
  assert done.returncode == 3, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr and len(fatal) == 1, done.stderr[-3000:]
  assert fatal[0] == (f'FATAL: the run in {tmp_path}/run stopped on an operating-system error (PermissionError: '
                      f'[Errno 13] Permission denied: \'{tmp_path}/run/metrics.jsonl\'). No checkpoint had been '
                      f'written in {tmp_path}/run/checkpoints yet (see --first_checkpoint_iteration), so there is '
                      'nothing to resume: mend what it names, then start the run again.')
