"""The evaluator process (--evaluator=process): its scores are the in-trainer evaluation's, its reports are recorded
in version order, and a killed evaluator is restarted without a gap in the curve or anything left behind."""
import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax import transport
from ebrl_jax import types
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import lifecycle
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import remote_eval
from ebrl_jax.trainer import stages
from test_pipeline import _config as pipeline_config  # pylint: disable=g-bad-import-order


def _config(run_dir, schedule='sync', transport_kind='thread', **schedule_kw):
  """test_pipeline's tiny run, one group, evaluated by the evaluator process."""
  return pipeline_config(run_dir,
                         schedule,
                         transport_kind,
                         num_groups=1,
                         evaluator='process',
                         **{
                             'num_timesteps': 12_800,
                             **schedule_kw
                         })


def test_the_evaluator_scores_a_version_as_the_in_trainer_evaluation_does(tmp_path):
  """A sync run evaluated by the evaluator (threads here: the same code as the process): its first and last points
  are what the trainer's own evaluator gives for version 0 (the initial parameters) and for the final version
  (the checkpoint), with the key of that version, bit for bit."""
  cfg = _config(tmp_path / 'run', num_timesteps=6400, num_evals=1)
  summary = controller.run(cfg)
  assert [(e['version'], e['env_steps']) for e in summary.eval_curve] == [(0, 0), (5, 6400)]
  assert summary.extra['evaluator']['evaluations'] == 2
  for point in summary.eval_curve:  # one clock: wall_s is when its evaluation finished, from process start
    assert abs(point['unix'] - point['wall_s'] - summary.start_unix) < 0.05
  spec, network, optimizer = driver.network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  root = keys.root(cfg.schedule.seed)
  initial = stages.init_train_state(network, optimizer, keys.init_key(root), spec.obs_dim,
                                    cfg.policy.normalize_observations)
  with checkpoint.Checkpointer(str(tmp_path / 'run' / 'checkpoints')) as ckpt:
    final, _, step = ckpt.restore(initial)
  assert step == 5
  in_trainer = evaluation.make_evaluator(cfg.sim, cfg.policy, cfg.schedule.seed, cfg.schedule.deterministic_eval,
                                         network)
  try:
    for point, params in ((summary.eval_curve[0], initial.params), (summary.eval_curve[-1], final.params)):
      metrics = in_trainer.evaluate(params, keys.eval_key(root, point['version']))
      assert point['return'] == metrics['eval/episode_return'], point
  finally:
    in_trainer.close()


class _Logger:

  def __init__(self):
    self.logged = []

  def log(self, step, metrics):
    self.logged.append((step, dict(metrics)))


class _Progress:
  """The driver's counters that `evaluations.record` reads and writes."""

  def __init__(self):
    self.iterations, self.env_steps, self.train_wall = 0, 0, 0.0
    self.eval_curve, self.target_hit = [], None


def _report(version, ret):
  return types.EvalReport(np.int64(version), np.float64(ret), np.float64(7.0), np.float64(0.01),
                          np.float64(time.time()))


def _link():
  template = {'w': jax.ShapeDtypeStruct((3,), np.float32)}
  spec = transport.record_spec(types.EvalReport, {n: () for n in types.EvalReport._fields},
                               dtypes={'version': 'int64'},
                               default_dtype='float64')
  return remote_eval.EvalLink(transport.make_param_store('thread', template), transport.make_channel('thread', spec, 4))


def test_reports_are_recorded_in_version_order_one_in_flight_repeats_dropped_and_a_missing_one_said():
  link = _link()
  remote = remote_eval.RemoteEvaluations(link, target=50.0, wait_s=0.5, max_pending=2)
  progress, logger = _Progress(), _Logger()
  try:
    for version in (0, 5):  # two asked for: only the first goes into the store until it is reported
      progress.iterations, progress.env_steps = version, version * 100
      remote.submit(None, {'w': np.full((3,), version, np.float32)}, None, progress, reached_s=0.1 * version)
    assert lifecycle.wait_for_version(link.store, 0, threading.Event())
    time.sleep(0.2)
    assert link.store.version() == 0  # one in flight
    link.reports.put(_report(0, 10.0))
    deadline = time.monotonic() + 5
    while link.store.version() != 5 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert link.store.version() == 5 and float(link.store.latest()[1]['w'][0]) == 5.0
    link.reports.put(_report(0, 10.0))  # a restarted evaluator repeating a version already reported: dropped
    link.reports.put(_report(5, 60.0))
    remote.finish(progress, logger, now=lambda: 1.0)
    assert [(e['version'], e['env_steps'], e['return']) for e in progress.eval_curve] == [(0, 0, 10.0), (5, 500, 60.0)]
    # when each was asked for (the pace is read there), and when it came in
    assert [e['reached_s'] for e in progress.eval_curve] == [0.0, 0.5]
    assert all(0.5 < e['wall_s'] <= 1.0 for e in progress.eval_curve)  # the report's time on the run clock
    assert progress.target_hit[0] == 500  # reached by version 5's point (the trainer has gone further since)
    assert remote.counts['duplicates'] == 1 and remote.counts['evaluations'] == 2
    progress.iterations = 10
    remote.submit(None, {'w': np.zeros((3,), np.float32)}, None, progress, reached_s=1.5)
    remote.finish(progress, logger, now=lambda: 2.0)  # never reported: left out after wait_s, counted
    assert remote.counts['missing'] == 1 and len(progress.eval_curve) == 2
  finally:
    remote.close(progress, logger, now=lambda: 3.0)


def _kill_evaluator_once_it_has_reported(run_dir, killed):
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and not killed:
    phase = lifecycle.read_phases(str(run_dir)).get('evaluator', {})
    if phase.get('phase') == 'evaluating':
      os.kill(phase['pid'], signal.SIGKILL)
      killed.append(phase['pid'])
      return
    time.sleep(0.05)


def test_a_killed_evaluator_is_restarted_and_the_curve_has_every_version(tmp_path):
  run_dir = tmp_path / 'run'
  killed = []
  killer = threading.Thread(target=_kill_evaluator_once_it_has_reported, args=(run_dir, killed), daemon=True)
  killer.start()
  summary = controller.run(_config(run_dir, schedule='async', transport_kind='shm'))
  killer.join(timeout=1)
  assert killed, 'the evaluator never reported a version'
  assert summary.extra['worker_restarts'] == 1
  # Every version asked for is on the curve, in order, each once: the restarted evaluator took the one in flight.
  versions = [e['version'] for e in summary.eval_curve]
  assert versions == [0, 5, 10] and summary.iterations == 10
  assert summary.extra['evaluator']['missing'] == 0
  workers = json.load(open(run_dir / 'workers.json'))
  assert workers['workers']['evaluator'] != killed[0]  # its replacement
  assert not [p for p in list(workers['workers'].values()) + killed if lifecycle.pid_alive(p)]
  assert not [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{os.getpid()}_')]


def test_evaluator_flag_errors_name_the_flag():
  with pytest.raises(ValueError, match='--evaluator=.elsewhere.'):
    config_lib.ScheduleConfig(evaluator='elsewhere')
  with pytest.raises(ValueError, match='--evaluator_wait_s=0'):
    config_lib.ScheduleConfig(evaluator_wait_s=0)
