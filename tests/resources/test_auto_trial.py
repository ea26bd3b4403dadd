"""--schedule=auto's trial (resources/auto_trial.py): the verdict against fused's prediction, the trials file beside
the profile store, the trial's config, a kept trial deciding the next run without one, and the controller running
a trial (a stand-in for the pipeline) and going on with what it measured; the spawned trial and calibration
processes give their exit code and end with a killed caller."""
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from ebrl_jax.controller import auto
from ebrl_jax.resources import auto_trial
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import schedule_choice
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import run_clock
from ebrl_jax.trainer import driver
from test_autoplan import _fake_calibration, _sync_and_auto  # pylint: disable=g-bad-import-order


def _trial(measured, fused=1000.0, iterations=12, stopped='max_train_s', fused_measured=None):
  return {
      'layout': 'async;groups=2;quotas=-;mps=False;colocate=True;slices=1',
      'measured_env_steps_per_s': measured,
      'predicted_env_steps_per_s': 1500.0,
      'fused_predicted_env_steps_per_s': fused,
      'fused_measured_env_steps_per_s': fused_measured,
      'fused_measured_s': 20.1,
      'iterations': iterations,
      'measured_s': 20.4,
      'stopped': stopped
  }


def test_a_process_schedule_is_kept_only_past_fused_trial_and_the_margin():
  # Against fused's trial (both measured): the 2 % margin.
  keep, why = auto_trial.verdict(_trial(1030.0, fused=2000.0, fused_measured=1000.0))
  assert keep and why.startswith('async kept:') and '+3.0%' in why and "fused's trial, 1,000 over 20.1 s" in why
  keep, why = auto_trial.verdict(_trial(1015.0, fused=500.0, fused_measured=1000.0))  # +1.5 %: within
  assert not keep and why.startswith('fused:') and 'within the 2% margin' in why and 'predicted 1,500' in why
  # Fused's trial measured nothing: fused's prediction, with the choice's 5 % margin.
  keep, why = auto_trial.verdict(_trial(1060.0))
  assert keep and '+6.0%' in why and "fused's predicted 1,000" in why
  keep, why = auto_trial.verdict(_trial(1040.0))
  assert not keep and 'within the 5% margin' in why
  assert auto_trial.PREDICTED_MARGIN == schedule_choice.MARGIN
  keep, why = auto_trial.verdict(_trial(None, iterations=2, stopped='max_wall_s'))  # nothing measured
  assert keep and 'kept on its prediction' in why and 'max_wall_s' in why
  # A layout tried because the model could not tell (schedule_choice.uncertain: predicted below fused) and whose
  # trial measured nothing is not kept on that prediction.
  keep, why = auto_trial.verdict(dict(_trial(None, iterations=2, stopped='max_wall_s'),
                                      predicted_env_steps_per_s=900.0))
  assert not keep and why.startswith('fused:') and 'does not beat' in why and '(900 env-steps/s)' in why
  # Such a layout measured past fused's prediction, fused's own trial out of time: fused (on the H100, W1's fused
  # ran 903 k against its predicted 799 k).
  keep, why = auto_trial.verdict(dict(_trial(1100.0), predicted_env_steps_per_s=900.0, fused_trial='out of time'))
  assert not keep and why.startswith('fused:') and 'could not tell' in why and '(out of time)' in why


def test_the_trials_file_keeps_each_layout_and_a_damaged_one_is_read_as_empty(tmp_path):
  store = str(tmp_path / 'profiles' / 'abc123.json')
  path = auto_trial.path_for(store)
  assert path == str(tmp_path / 'profiles' / 'abc123.trials.json') and auto_trial.load(path) == {}
  auto_trial.save(path, 'a', {'x': 1})
  auto_trial.save(path, 'b', {'x': 2})
  auto_trial.save(path, 'a', {'x': 3})
  assert auto_trial.load(path) == {'a': {'x': 3}, 'b': {'x': 2}}
  with open(path, 'w') as f:
    f.write('{"format": "ebrl_jax.resources.auto_trial/1", "trials": ')  # cut short
  assert auto_trial.load(path) == {}
  with open(path, 'w') as f:
    json.dump({'format': 'something else', 'trials': {'a': {}}}, f)
  assert auto_trial.load(path) == {}


def test_the_trial_is_the_chosen_config_stopped_by_its_training_seconds(tmp_path):
  cfg, _ = _sync_and_auto(tmp_path, plan=False)
  cfg = dataclasses.replace(cfg,
                            schedule=dataclasses.replace(cfg.schedule,
                                                         target_return=100.0,
                                                         resume=True,
                                                         checkpoint_every=2,
                                                         trace_dir=str(tmp_path / 'trace')))
  t = auto_trial.trial_config(cfg, 15.0, 40.0)
  s = t.schedule
  assert s.run_dir == cfg.schedule.run_dir + '/auto_trial' and (s.max_train_s, s.max_wall_s) == (15.0, 40.0)
  assert (s.target_return, s.resume, s.checkpoint_every, s.trace_dir) == (None, False, 0, '')
  assert (s.name, s.num_groups, s.num_evals, s.num_timesteps) == ('sync', 2, 2, 12_800)  # the run's own
  assert t.sim == cfg.sim and t.policy == cfg.policy and t.algo == cfg.algo and t.resources == cfg.resources
  with pytest.raises(ValueError, match='--auto_trial_s=0'):
    auto_trial.trial_config(cfg, 0.0, 0.0)
  assert auto_trial.wall_limit(None, 100.0) == (0.0, None)
  assert auto_trial.wall_limit(time.time() + 30, time.time() - 10)[0] == pytest.approx(40.0, abs=0.1)
  assert 'no room for a trial' in auto_trial.wall_limit(time.time() + 0.5, time.time())[1]


def _async_auto(tmp_path, monkeypatch):
  """The test config as --schedule=auto (no MPS) over a store where async wins by far (test_autoplan's numbers:
  25.6 ms of rollout beside a 25 ms train step)."""
  _fake_calibration(monkeypatch, [], sim_s=20e-6, train_s=25e-3)
  _, auto_cfg = _sync_and_auto(tmp_path, plan=False)
  return dataclasses.replace(auto_cfg, resources=dataclasses.replace(auto_cfg.resources, use_mps=False))


def test_a_kept_trial_decides_the_next_run_without_one(tmp_path, monkeypatch):
  auto_cfg = _async_auto(tmp_path, monkeypatch)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  assert chosen.schedule.name == 'async' and record['trial']['pending']
  layout, path = record['trial']['layout'], record['trial']['path']
  assert layout == auto_trial.key(chosen) and layout.startswith(f'async;groups={chosen.schedule.num_groups};')
  fused, predicted = record['predicted']['fused'], record['predicted_env_steps_per_s']  # async's beats fused's
  auto_trial.save(path, layout, dict(_trial(0.9 * fused, fused), layout=layout,
                                     predicted_env_steps_per_s=predicted))  # measured below fused's prediction
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  assert chosen.schedule.name == 'fused' and record['schedule'] == 'fused' and not record['trial']['pending']
  assert record['choice_reason'] == record['trial']['verdict'] and 'within the 5% margin' in record['choice_reason']
  assert record['trial']['plan']['num_groups'] >= 1 and 'num_groups' not in record  # the plan that was tried
  auto_trial.save(path, layout, dict(_trial(1.2 * fused, fused), layout=layout, predicted_env_steps_per_s=predicted))
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  assert chosen.schedule.name == 'async' and record['trial']['kept'] and record['num_groups'] >= 1
  # --auto_trial_s=0: no trial asked for, none read
  off = dataclasses.replace(auto_cfg, resources=dataclasses.replace(auto_cfg.resources, auto_trial_s=0.0))
  assert 'trial' not in autoplan.plan_auto(off, mps_active=False, worker_env=None, handoff=0.0)[1]


def _summary(rate, iterations, stopped, schedule='async'):
  return driver.RunSummary(env_steps=iterations * 1280,
                           iterations=iterations,
                           wall_s=30.0,
                           compile_s=8.0,
                           train_wall_s=20.0,
                           env_steps_per_s=rate,
                           final_eval_return=None,
                           best_eval_return=None,
                           target_return=None,
                           env_steps_to_target=None,
                           wall_s_to_target=None,
                           train_s_to_target=None,
                           eval_curve=[],
                           num_params=1,
                           schedule=schedule,
                           backend='mujoco_cpu',
                           task='inverted_pendulum',
                           device='cpu',
                           extra={},
                           stopped=stopped)


def test_a_run_that_contradicts_its_verdict_drops_it_and_the_next_run_tries_again(tmp_path, monkeypatch):
  auto_cfg = _async_auto(tmp_path, monkeypatch)
  _, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  layout, path = record['trial']['layout'], record['trial']['path']

  def decide(async_rate):  # a kept verdict: async's trial at async_rate, fused's at 1000
    auto_trial.save(path, layout, dict(_trial(async_rate, fused_measured=1000.0), layout=layout, auto_trial_s=20.0))
    return autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)

  chosen, record = decide(1100.0)  # async kept (+10 %); its run measures 1.5 % below fused's trial: it holds
  assert chosen.schedule.name == 'async'
  auto._check_verdict(record['trial'], _summary(985.0, 40, 'num_timesteps'))
  assert record['trial']['run_check']['confirmed'] and layout in auto_trial.load(path)
  auto._check_verdict(record['trial'], _summary(950.0, 40, 'num_timesteps'))  # 5 % below: dropped
  assert record['trial']['run_check']['confirmed'] is False and '-5.0% against fused\'s trial' in record['trial'][
      'run_check']['reason']
  assert layout not in auto_trial.load(path)
  assert autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)[1]['trial']['pending']

  chosen, record = decide(1010.0)  # fused (async +1 %, within the margin); fused's run then measures 900
  assert chosen.schedule.name == 'fused'
  short = dataclasses.replace(_summary(900.0, 40, 'max_train_s', 'fused'), train_wall_s=5.0)
  for not_checked in (short, _summary(900.0, 40, 'SIGTERM', 'fused')):  # too short, or stopped by a signal
    auto._check_verdict(record['trial'], not_checked)
    assert record['trial']['run_check']['confirmed'] is None and layout in auto_trial.load(path)
  auto._check_verdict(record['trial'], _summary(900.0, 40, 'max_train_s', 'fused'))
  assert 'against async\'s trial (1,010)' in record['trial']['run_check']['reason']
  assert layout not in auto_trial.load(path)


def test_a_verdict_borne_out_by_recheck_after_runs_is_tried_again(tmp_path, monkeypatch):
  # The other schedule's rate is one trial's: after RECHECK_AFTER runs that bore the verdict out, the next run
  # measures both again; a run that is not checked (a signal) does not count.
  auto_cfg = _async_auto(tmp_path, monkeypatch)
  _, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  layout, path = record['trial']['layout'], record['trial']['path']
  auto_trial.save(path, layout, dict(_trial(1100.0, fused_measured=1000.0), layout=layout, auto_trial_s=20.0))
  for run in range(1, auto_trial.RECHECK_AFTER + 1):
    chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
    assert chosen.schedule.name == 'async' and not record['trial']['pending']
    auto._check_verdict(record['trial'], _summary(1080.0, 40, 'SIGTERM'))  # not checked, not counted
    auto._check_verdict(record['trial'], _summary(1080.0, 40, 'num_timesteps'))
    assert record['trial']['run_check'] == {
        'confirmed': True,
        'reason': record['trial']['run_check']['reason'],
        'confirmed_runs': run
    }
    assert (layout in auto_trial.load(path)) == (run < auto_trial.RECHECK_AFTER)
  assert autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)[1]['trial']['pending']
  assert auto_trial.confirm(path, layout) == (0, False)  # no verdict left to count


@pytest.mark.parametrize('ratio, stopped, want', [(0.9, 'max_train_s', 'fused'), (1.2, 'max_train_s', 'async'),
                                                  (1.2, 'SIGTERM', 'stopped')])
def test_the_controller_runs_both_trials_and_goes_on_with_what_they_measured(tmp_path, monkeypatch, ratio, stopped,
                                                                             want):
  # The process schedule's trial measures `ratio` x fused's trial, which measures half of fused's prediction (a
  # prediction the process schedule beats either way: only fused's measured rate decides).
  auto_cfg = _async_auto(tmp_path, monkeypatch)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  fused = record['predicted']['fused'] / 2
  runs = []

  def fake_pipeline(cfg, pids, start):
    runs.append(cfg)
    return _summary(ratio * fused, 12, stopped)

  def fake_fused(cfg, start, deadline):
    runs.append(cfg)
    return _summary(fused, 40, 'max_train_s', 'fused')

  monkeypatch.setattr(auto.pipeline, 'run', fake_pipeline)
  monkeypatch.setattr(auto, '_fused_trial', fake_fused)
  start = run_clock.StartClock(time.time())
  after, record, ended = auto.trial(auto_cfg, chosen, record, start)
  assert runs[0].schedule.max_train_s == auto_cfg.resources.auto_trial_s == 20.0
  assert runs[0].schedule.run_dir.endswith('auto_trial') and runs[0].schedule.name == 'async'
  with open(f'{runs[0].schedule.run_dir}/summary.json') as f:
    assert json.load(f)['env_steps_per_s'] == pytest.approx(ratio * fused)  # the trial's own summary, kept
  kept = auto_trial.load(record['trial']['path'])
  if want == 'stopped':  # a signal ended the trial: the run ends with it, fused is not tried, nothing is kept
    assert ended.stopped == 'SIGTERM' and after is chosen and kept == {} and 'SIGTERM' in record['trial']['verdict']
    assert len(runs) == 1
    return
  (fused_cfg,) = runs[1:]
  assert fused_cfg.schedule.name == 'fused' and fused_cfg.schedule.run_dir.endswith('auto_trial_fused')
  assert fused_cfg.schedule.max_train_s == 20.0 and fused_cfg.schedule.checkpoint_every == 0
  assert ended is None and after.schedule.name == want == record['schedule']
  entry = kept[record['trial']['layout']]
  assert entry['measured_env_steps_per_s'] == pytest.approx(ratio * fused)
  assert entry['fused_measured_env_steps_per_s'] == pytest.approx(fused) and entry['fused_iterations'] == 40
  assert record['trial']['kept'] == (want == 'async') and record['trial']['iterations'] == 12


def _children(pid):
  with open(f'/proc/{pid}/task/{pid}/children') as f:
    return [int(c) for c in f.read().split()]


def test_a_spawned_trial_or_calibration_process_ends_with_its_killed_caller(tmp_path):
  # A caller (standing in for the controller) runs a 60 s sleep through run_process and is SIGKILLed: the sleeper
  # must not outlive it (it did before the parent-death signal: a fused trial ran on to its end, a calibration
  # could to its 900 s).
  caller = subprocess.Popen([
      sys.executable, '-c', 'import time\nfrom ebrl_jax.resources import calibration_procs\n'
      'print(calibration_procs.run_process(time.sleep, (60,), "sleeper", 120))'
  ],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  try:
    sleeper, deadline = None, time.time() + 60
    while sleeper is None and time.time() < deadline and caller.poll() is None:
      time.sleep(0.2)
      for c in _children(caller.pid):
        with open(f'/proc/{c}/cmdline') as f:
          if 'spawn_main' in f.read():
            sleeper = c
    assert sleeper is not None, 'run_process started no process'
    time.sleep(1.0)  # past its start: the signal is armed first thing
    assert lifecycle.pid_alive(sleeper)
    caller.kill()
    caller.wait(10)
    deadline = time.time() + 10
    while lifecycle.pid_alive(sleeper) and time.time() < deadline:
      time.sleep(0.1)
    assert not lifecycle.pid_alive(sleeper), f'pid {sleeper} outlived its killed caller'
  finally:
    if caller.poll() is None:
      caller.kill()


def test_run_process_gives_the_exit_code_or_none_at_its_timeout():
  assert calibration_procs.run_process(time.sleep, (0.0,), 'quick', 60) == 0
  assert calibration_procs.run_process(time.sleep, (30,), 'slow', 1.0) is None
  assert calibration_procs.exit_text(-9) == 'killed by SIGKILL' and calibration_procs.exit_text(3) == 'exit code 3'


@pytest.mark.parametrize('exitcode', [None, 1], ids=['out_of_time', 'failed'])
def test_a_fused_trial_out_of_the_budget_leaves_the_verdict_to_its_prediction(tmp_path, monkeypatch, exitcode):
  # On the H100, W1's fused trial (a 48 s compile) got the 36 s the calibration budget had left, and the run ended
  # on a FATAL line. Out of time, fused's prediction now stands in for its trial; a trial that failed still stops
  # the run naming it.
  auto_cfg = _async_auto(tmp_path, monkeypatch)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=False, worker_env=None, handoff=0.0)
  fused = record['predicted']['fused']
  monkeypatch.setattr(auto.pipeline, 'run', lambda cfg, pids, start: _summary(0.5 * fused, 12, 'max_train_s'))
  monkeypatch.setattr(auto.calibration_procs, 'run_process', lambda *args: exitcode)
  start = run_clock.StartClock(time.time())
  if exitcode is not None:
    with pytest.raises(errors.RunError, match=r"fused's trial ended without its summary \(exit code 1"):
      auto.trial(auto_cfg, chosen, record, start)
    return
  after, record, ended = auto.trial(auto_cfg, chosen, record, start)
  assert ended is None and record['trial']['fused_measured_env_steps_per_s'] is None
  assert 'prediction stood in' in record['trial']['fused_trial']
  # the process trial measured half of fused's prediction: fused it is
  assert after.schedule.name == 'fused' == record['schedule'] and record['trial']['kept'] is False
