"""A full disk: a clear error naming it, exit code 3, the last checkpoint intact and `--resume` continuing, no
worker process or shared-memory segment left. The disk is a real one: a 64 MiB tmpfs in a private mount namespace
(`unshare -rm`), filled with `dd` once the run has committed its first checkpoint. A full disk the trainer thread
reports (--transport=thread) is the same error."""
import errno
import json
import os
import subprocess
import sys

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import storage
from ebrl_jax.trainer import driver

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside the namespace: the first run until the disk fills, then (space freed) the same run with --resume.
SCRIPT = r'''
set -u
D=$(mktemp -d)
mount -t tmpfs -o size=64m tmpfs "$D" || exit 90
run() { "$PY" -m ebrl_jax.main --flagfile=experiments/quickstart.flags --run_dir="$D/run" --checkpoint_every=1 \
          --target_return=100000 --num_timesteps=61440 --compilation_cache_dir= "$@"; }
run $FLAGS > "$D/first.log" 2>&1 &
pid=$!
while ! ls "$D/run/checkpoints" 2>/dev/null | grep -qE '^[0-9]+$'; do
  kill -0 $pid 2>/dev/null || break
  sleep 0.05
done
dd if=/dev/zero of="$D/fill" bs=1M >/dev/null 2>&1
wait $pid; first=$?
cp "$D/first.log" "$OUT/first.log"
cp "$D/run/workers.json" "$OUT/workers.json" 2>/dev/null
ls "$D/run/checkpoints" > "$OUT/steps_after_fill"
rm -f "$D/fill"
run $FLAGS --resume > "$OUT/second.log" 2>&1; second=$?
cp "$D/run/summary.json" "$OUT/summary.json" 2>/dev/null
umount "$D"
echo "$first $second" > "$OUT/exits"
'''


def test_disk_full_is_recognised_from_the_os_error_and_through_wrappers():
  with pytest.raises(OSError) as e:
    with open('/dev/full', 'w') as f:  # the kernel's always-full device: a real ENOSPC
      f.write('x')
      f.flush()
  assert e.value.errno == errno.ENOSPC and storage.disk_full(e.value).startswith('No space left on device')
  named = OSError(errno.ENOSPC, 'No space left on device', '/runs/x/metrics.jsonl')
  assert storage.disk_full(named) == 'No space left on device: /runs/x/metrics.jsonl'
  try:  # orbax / tensorstore keep only the text, sometimes on the cause
    try:
      raise ValueError('Error writing local file "/runs/x/checkpoints/3.tmp/d/0": [OS error 28: No space left on '
                       'device]')
    except ValueError as inner:
      raise RuntimeError('save failed') from inner
  except RuntimeError as outer:
    assert storage.disk_full(outer) == ('Error writing local file "/runs/x/checkpoints/3.tmp/d/0": [OS error 28: '
                                        'No space left on device]')
  assert storage.disk_full(OSError(errno.EACCES, 'Permission denied')) is None
  assert storage.disk_full(ValueError('bad shape')) is None


def test_resume_advice_names_the_newest_committed_checkpoint(tmp_path):
  assert 'no checkpoint had been written' in storage.resume_advice(str(tmp_path))
  for name in ('6', '12.orbax-checkpoint-tmp-1', '3'):
    (tmp_path / 'checkpoints' / name).mkdir(parents=True)
  assert storage.resume_advice(str(tmp_path)).startswith(f'checkpoint 6 in {tmp_path}/checkpoints is intact')


def test_checkpoint_advice_says_truthfully_whether_there_is_a_checkpoint(tmp_path):
  """The fault suite's kill_trainer trials found 'Its last checkpoint ... stays loadable' printed for a trainer
  killed during start-up, before any checkpoint existed."""
  line = storage.checkpoint_advice(str(tmp_path))
  assert 'No checkpoint had been written' in line and 'nothing to resume' in line and '--resume' not in line
  (tmp_path / 'checkpoints' / '3').mkdir(parents=True)
  (tmp_path / 'checkpoints' / '7.orbax-checkpoint-tmp-1').mkdir()  # not committed: not offered
  line = storage.checkpoint_advice(str(tmp_path), 'start MPS again')
  assert line == (f'Its checkpoint 3 in {tmp_path}/checkpoints stays loadable: start MPS again, then continue with '
                  '--resume.')


@pytest.mark.parametrize('flags', ['', '--schedule=async --num_groups=2'], ids=['fused', 'async_processes'])
def test_a_full_disk_stops_the_run_clearly_and_resume_continues(tmp_path, flags):
  if not runs_testlib.can_mount_a_tmpfs():
    pytest.skip('cannot mount a tmpfs in a private namespace here (unshare -rm)')
  env = dict(os.environ, PY=sys.executable, FLAGS=flags, OUT=str(tmp_path), PYTHONPATH=ROOT)
  proc = subprocess.run(['unshare', '-rm', 'bash', '-c', SCRIPT],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  first, second = (int(x) for x in (tmp_path / 'exits').read_text().split())
  log = (tmp_path / 'first.log').read_text()
  assert first == 3, log[-3000:]
  fatal = [line for line in log.splitlines() if line.startswith('FATAL: ')]
  assert len(fatal) == 1, log[-3000:]
  assert 'is full' in fatal[0] and 'free space, then continue with --resume' in fatal[0]
  # tensorboardX's writer thread and its exit hook fail on the full disk too: one line, no traceback
  assert 'Traceback' not in log, log[-3000:]
  assert log.count('TensorBoard events: the disk is full') <= 1
  committed = [int(s) for s in (tmp_path / 'steps_after_fill').read_text().split() if s.isdigit()]
  assert committed and f'checkpoint {max(committed)} in ' in fatal[0]
  if not flags:  # in-process: the failed write is named
    assert 'No space left on device' in fatal[0]
  else:  # the trainer's own line names it; every worker it listed is gone, and no shared memory is left
    assert 'trainer: the disk holding' in log and 'No space left on device' in log
    pids = json.loads((tmp_path / 'workers.json').read_text())
    for pid in pids['workers'].values():
      assert not os.path.exists(f'/proc/{pid}') or 'Z' in open(f'/proc/{pid}/stat').read().split()[2]
    assert not [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{pids["controller"]}_')]
  # Space freed, the same command with --resume continues from that checkpoint to the end.
  assert second == 0, (tmp_path / 'second.log').read_text()[-3000:]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['env_steps'] >= 61440 and summary['iterations'] > max(committed)


def test_a_full_disk_the_trainer_thread_reports_is_disk_full_naming_the_thread(tmp_path, monkeypatch):
  """--transport=thread: the trainer is a thread (no pid); its report reaches the controller as the DiskFull it
  raised, not an AttributeError of formatting a pid."""

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device', str(tmp_path / 'metrics.jsonl'))

  monkeypatch.setattr(driver, 'train', full)  # run_training turns it into DiskFull, as on a full disk
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                   num_envs=32,
                                                   num_eval_envs=8,
                                                   num_threads=1),
                          algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                          schedule=config_lib.ScheduleConfig(name='sync',
                                                             run_dir=str(tmp_path),
                                                             compilation_cache_dir='',
                                                             progress_bar=False,
                                                             transport='thread',
                                                             num_timesteps=1280,
                                                             num_evals=1),
                          resources=config_lib.ResourceConfig(telemetry_period_s=0))
  with pytest.raises(errors.DiskFull, match='the trainer thread stopped: '):
    controller.run(cfg)
