"""A rollout worker restarted after it died: no iteration of its group reaches the trainer twice. One that died
after its delivery was counted goes on after it (`FeedbackSnapshot.next_iteration`); one that died between putting
its segment and counting it repeats that iteration, and the trainer drops the repeat (each block's iteration is
consumed once, whichever incarnation delivered it), so every batch of `sync` holds each group once."""
import time

import pytest

from ebrl_jax import controller
from ebrl_jax.rollout import groups
from ebrl_jax.rollout import worker as rollout_worker
from ebrl_jax.runtime import feedback
from ebrl_jax.trainer import worker as trainer_worker
from test_pipeline import _config as pipeline_config  # pylint: disable=g-bad-import-order


def _config(run_dir):
  return pipeline_config(run_dir,
                         'sync',
                         'thread',
                         num_groups=2,
                         num_timesteps=3 * 1280,
                         num_evals=1,
                         evaluator='trainer')


class _SlowFirst:
  """Group 1's first collect comes late, so group 0's restart happens before the first batch is whole."""

  def __init__(self, inner, group):
    self._inner, self._group, self._collects = inner, group, 0

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def collect(self, params, version, key):
    self._collects += 1
    if self._group == 1 and self._collects == 1:
      time.sleep(3.0)
    return self._inner.collect(params, version, key)


@pytest.fixture
def recorded(monkeypatch):
  """(records put as (group, incarnation, iteration), the trainer's batches as lists of (group, iteration))."""
  make_group, batch = groups.make_group, trainer_worker.ChannelSource._batch  # pylint: disable=protected-access
  monkeypatch.setattr(groups, 'make_group', lambda cfg, group, *a: _SlowFirst(make_group(cfg, group, *a), group))
  put, batches = [], []

  def spied(self, records):
    batches.append(sorted((int(r.group[0]), int(r.iteration[0])) for r in records))
    return batch(self, records)

  monkeypatch.setattr(trainer_worker.ChannelSource, '_batch', spied)
  return put, batches


@pytest.mark.parametrize('dies', ['after_put', 'after_count'])
def test_a_restarted_group_delivers_no_iteration_twice(tmp_path, monkeypatch, recorded, dies):
  put, batches = recorded
  put_all, delivered, died = rollout_worker._put_all, feedback.Feedback.delivered, []  # pylint: disable=protected-access

  def put_then_die(channel, records, stop):
    ok = put_all(channel, records, stop)
    first = records[0]
    put.append((int(first.group[0]), int(first.incarnation[0]), int(first.iteration[0])))
    if dies == 'after_put' and put[-1][0] == 0 and not died:
      died.append(put[-1])
      raise RuntimeError('died between putting its segment and counting it')
    return ok

  def count_then_die(self, stage_s, iteration):
    delivered(self, stage_s, iteration)
    if dies == 'after_count' and not died and put and put[-1][:2] == (0, 0):
      died.append(put[-1])
      raise RuntimeError('died after counting its delivery')

  monkeypatch.setattr(rollout_worker, '_put_all', put_then_die)
  monkeypatch.setattr(feedback.Feedback, 'delivered', count_then_die)
  summary = controller.run(_config(tmp_path))
  extra = summary.extra
  assert died == [(0, 0, 0)] and extra['worker_restarts'] == 1
  assert summary.iterations == 3 and batches == [[(0, i), (1, i)] for i in range(3)], batches
  assert extra['segments_consumed'] == 6 and extra['segments_dropped_stale'] == 0
  again = [p for p in put if p[:2] == (0, 1)]  # the restarted incarnation's deliveries
  if dies == 'after_put':  # its predecessor's iteration 0 was not counted: it repeats it, and the trainer drops it
    assert again[0] == (0, 1, 0) and extra['segments_duplicated'] == 1
  else:  # counted: it goes on after it
    assert again[0] == (0, 1, 1) and extra['segments_duplicated'] == 0


def test_next_iteration_follows_the_last_delivery_and_the_start_given():
  fb = feedback.Feedback(use_processes=False)
  assert fb.snapshot().next_iteration() == 0
  fb[feedback.START_ITERATION] = 5  # a standby swapped in at 5 that delivered nothing
  assert fb.snapshot().next_iteration() == 5
  fb.delivered(0.1, 5)
  fb.delivered(0.1, 6)
  assert fb.snapshot().next_iteration() == 7
