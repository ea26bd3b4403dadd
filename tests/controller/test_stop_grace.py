"""A stopping trainer's grace covers the checkpoint it saves at the stop (runtime/stop_grace.py): the time of the
run's earlier saves (orbax's own record of each), and as long as the stop's save is still being written, up to a
cap. Before, the controller gave the trainer a fixed 10 s after a stop, its save included, and terminated it mid-save
past that. A stand-in trainer process answers the controller's SIGINT with a slow save laid out as orbax lays one
out (an uncommitted step directory, renamed to the step at its commit); the run's older checkpoint is a real orbax
save, and it stays whole when the cap ends a save that went on too long."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import pipeline
from ebrl_jax.runtime import stop_grace
from ebrl_jax.runtime import feedback
from ebrl_jax.runtime import launch
from ebrl_jax.trainer import checkpoint

# Installs its SIGINT handler, reports its phase (the controller asks only a trainer that has), and on SIGINT
# "saves" step 2 for argv[2] seconds: an uncommitted directory written chunk by chunk, then renamed (the commit).
STAND_IN = r'''
import json, os, signal, sys, time
run_dir, save_s = sys.argv[1], float(sys.argv[2])
asked = []
signal.signal(signal.SIGINT, lambda *_: asked.append(time.time()))
os.makedirs(os.path.join(run_dir, 'phases'), exist_ok=True)
with open(os.path.join(run_dir, 'phases', 'trainer.json'), 'w') as f:
  json.dump({'name': 'trainer', 'phase': 'running', 'since': time.time(), 'pid': os.getpid()}, f)
while not asked:
  time.sleep(0.01)
tmp = os.path.join(run_dir, 'checkpoints', '2.orbax-checkpoint-tmp-1')
init = time.time_ns()
os.makedirs(os.path.join(tmp, 'state'))
end = time.monotonic() + save_s
i = 0
while time.monotonic() < end:
  with open(os.path.join(tmp, 'state', f'chunk{i}'), 'w') as f:
    f.write('x' * 1000)
  i += 1
  time.sleep(0.2)
with open(os.path.join(tmp, '_CHECKPOINT_METADATA'), 'w') as f:
  json.dump({'init_timestamp_nsecs': init, 'commit_timestamp_nsecs': time.time_ns()}, f)
os.rename(tmp, os.path.join(run_dir, 'checkpoints', '2'))
'''
STEP_1 = {'w': np.arange(6.0)}


class _Trainer:
  """The stand-in as the supervisor's worker process: pid, is_alive, terminate."""

  def __init__(self, proc):
    self.proc, self.pid = proc, proc.pid

  def is_alive(self):
    return self.proc.poll() is None

  def terminate(self):
    self.proc.terminate()


class _Workers:
  """What `_stop_trainer` reads of the supervisor; `watch` returns when the trainer has ended."""

  def __init__(self, trainer):
    self.workers, self.trainer_interrupt, self.use_processes, self.cell_rank = {'trainer': trainer}, None, True, False
    self.tick, self.trainer_feedback = None, feedback.Feedback(False)

  def watch(self):
    self.workers['trainer'].proc.wait(timeout=120)


def _stop_a_slow_saver(run_dir, save_s):
  """A real orbax checkpoint 1 in run_dir, then the stand-in trainer stopped the way the controller stops one;
  returns (its exit code, seconds from the stop to its end)."""
  manager = ocp.CheckpointManager(os.path.join(run_dir, 'checkpoints'), item_names=('state', 'extra'))
  manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(STEP_1), extra=ocp.args.JsonSave({'a': 1})))
  manager.wait_until_finished()
  proc = subprocess.Popen([sys.executable, '-c', STAND_IN, str(run_dir), str(save_s)])
  try:
    deadline = time.monotonic() + 60
    while not (run_dir / 'phases' / 'trainer.json').exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.05)
    t0 = time.monotonic()
    pipeline._stop_trainer(
        config_lib.Config(schedule=config_lib.ScheduleConfig(run_dir=str(run_dir))),  # pylint: disable=protected-access
        _Workers(_Trainer(proc)))
    return proc.wait(timeout=60), time.monotonic() - t0
  finally:
    if proc.poll() is None:
      proc.kill()


@pytest.fixture
def short_grace(monkeypatch):
  """1 s to reach the iteration boundary, a 0.5 s floor for the save: the stand-in's 5 s save is past both."""
  monkeypatch.setattr(pipeline, '_STOP_GRACE_S', 1.0)
  monkeypatch.setattr(stop_grace, 'SAVE_FLOOR_S', 0.5)
  monkeypatch.setattr(stop_grace, 'POLL_S', 0.1)


def test_a_slow_save_at_the_stop_is_waited_for_while_it_is_written(tmp_path, short_grace):
  del short_grace
  code, took = _stop_a_slow_saver(tmp_path, save_s=5.0)
  assert code == 0 and took >= 5.0  # not terminated (-15) at the fixed grace, 1 s here
  assert checkpoint.committed_steps(str(tmp_path / 'checkpoints')) == [2, 1]
  assert stop_grace.save_seconds(str(tmp_path / 'checkpoints'))[-1] >= 5.0  # the next stop's allowance: 3x that


def test_a_save_past_the_cap_is_ended_and_the_older_checkpoint_stays_whole(tmp_path, short_grace, monkeypatch):
  del short_grace
  monkeypatch.setattr(stop_grace, 'SAVE_CAP_S', 2.0)
  code, took = _stop_a_slow_saver(tmp_path, save_s=30.0)
  assert code == -15 and 2.5 <= took < 10.0  # terminated at 1 s + the 2 s cap, mid-save
  directory = str(tmp_path / 'checkpoints')
  assert checkpoint.committed_steps(directory) == [1] and checkpoint.damage(directory, 1) is None
  restored = ocp.CheckpointManager(directory, item_names=('state', 'extra')).restore(
      1, args=ocp.args.Composite(state=ocp.args.StandardRestore(STEP_1), extra=ocp.args.JsonRestore()))
  np.testing.assert_array_equal(restored.state['w'], STEP_1['w'])


def _committed(directory, step, took_s, name=None):
  path = os.path.join(directory, name or str(step))
  os.makedirs(path)
  with open(os.path.join(path, '_CHECKPOINT_METADATA'), 'w') as f:
    json.dump({'init_timestamp_nsecs': 10**18, 'commit_timestamp_nsecs': 10**18 + int(took_s * 1e9)}, f)


def test_the_allowance_is_three_times_the_longest_save_within_the_floor_and_the_cap(tmp_path):
  directory = str(tmp_path)
  assert stop_grace.save_allowance(directory) == 20.0  # no save measured: the floor
  _committed(directory, 3, 2.0)
  _committed(directory, 10, 5.0)
  _committed(directory, 11, 400.0, name='11.orbax-checkpoint-tmp-7')  # uncommitted: not a save that took 400 s
  os.makedirs(os.path.join(directory, '12'))
  with open(os.path.join(directory, '12', '_CHECKPOINT_METADATA'), 'w') as f:
    f.write('{"init_timestamp_nsecs": ')  # unreadable: left out
  assert stop_grace.save_seconds(directory) == [2.0, 5.0]  # step order
  assert stop_grace.save_allowance(directory) == 20.0  # 3 x 5 s = 15 s, under the floor
  _committed(directory, 20, 100.0)
  assert stop_grace.save_allowance(directory) == 300.0  # 3 x 100 s
  _committed(directory, 30, 1000.0)
  assert stop_grace.save_allowance(directory) == 600.0  # 3 x 1000 s, capped
  assert stop_grace.base_grace(10.0, 0.0) == 10.0 and stop_grace.base_grace(10.0, 7.0) == 14.0  # 2 iterations


def test_a_save_in_progress_moves_the_deadline_up_to_the_cap(tmp_path):
  """By a hand clock: base 10 s, allowance the 20 s floor, so the deadline is t+30; a save directory made after the
  stop keeps it 10 s ahead of now, up to t + 10 + 600 s (the cap); once committed (renamed), the deadline stands."""
  now, ended = [1000.0], []
  trainer = type('Trainer', (), {'is_alive': lambda self: True, 'terminate': lambda self: ended.append(now[0])})()
  grace = stop_grace.StopGrace(trainer, str(tmp_path), 10.0, clock=lambda: now[0])
  assert grace.deadline == 1030.0
  saving = tmp_path / '5.orbax-checkpoint-tmp-1'
  saving.mkdir()
  os.utime(saving, (1001.0, 1001.0))  # made 1 s after the stop
  now[0] = 1100.0
  assert not grace.poll() and grace.deadline == 1110.0  # 1100 + 10
  now[0] = 1605.0
  assert not grace.poll() and grace.deadline == 1610.0  # 1605 + 10 would pass 1000 + 10 + 600
  now[0] = 1610.5
  assert grace.poll() and ended == [1610.5]  # past the cap: terminated, although still saving

  grace = stop_grace.StopGrace(trainer, str(tmp_path), 10.0, clock=lambda: now[0])  # a stop at 1610.5
  now[0] = 1640.0
  assert not grace.poll() and grace.deadline == 1640.5  # that directory is older than this stop: not its save
  os.utime(saving, (1620.0, 1620.0))  # this stop's save
  assert not grace.poll() and grace.deadline == 1650.0
  saving.rename(tmp_path / '5')  # committed
  now[0] = 1650.5
  assert grace.poll() and ended == [1610.5, 1650.5]


class _SavingCell:
  """A stand-in cell of --launcher=local: on the stop's signal it starts its step's save (an uncommitted step
  directory, as rank 0 does), which commits `save_s` later; then it ends with 143."""

  def __init__(self, pid, checkpoints, save_s):
    self.pid, self._dir, self._save_s, self.returncode, self._end_t = pid, checkpoints, save_s, None, None

  def send_signal(self, sig):
    del sig
    os.makedirs(os.path.join(self._dir, '4.orbax-checkpoint-tmp-1'))
    self._end_t = time.monotonic() + self._save_s

  def poll(self):
    if self.returncode is None and self._end_t is not None and time.monotonic() >= self._end_t:
      os.rename(os.path.join(self._dir, '4.orbax-checkpoint-tmp-1'), os.path.join(self._dir, '4'))
      self.returncode = 143
    return self.returncode

  def kill(self):
    self.returncode = -9

  def wait(self, timeout=None):
    until = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if until is not None and time.monotonic() >= until:
        raise subprocess.TimeoutExpired('cell', timeout)
      time.sleep(0.01)
    return self.returncode


def test_the_launcher_waits_for_rank_0s_save_at_a_stop(tmp_path, monkeypatch, capsys):
  """--launcher=local passes a stop on to its cells, then waits STOP_GRACE_S (0.3 s here) plus rank 0's save:
  a 2 s save is waited for, not SIGKILLed."""
  monkeypatch.setattr(launch, 'STOP_GRACE_S', 0.3)
  monkeypatch.setattr(stop_grace, 'SAVE_FLOOR_S', 0.2)
  (tmp_path / 'checkpoints').mkdir()
  cells = [_SavingCell(11, str(tmp_path / 'checkpoints'), 2.0)]
  t0 = time.monotonic()
  code = launch.watch(cells, ['h'], str(tmp_path), 3, lambda: 'SIGTERM', 0.02)
  assert code == 143 and cells[0].returncode == 143 and time.monotonic() - t0 >= 2.0
  assert 'rank 0: exit code 143' in capsys.readouterr().err
  assert checkpoint.committed_steps(str(tmp_path / 'checkpoints')) == [4]
