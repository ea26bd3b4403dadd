"""--schedule=auto: fused, sync or async chosen from stage profiles, worked out by hand; a CPU run that takes the
choice from a saved profile store and runs it."""
import dataclasses

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.resources import auto_trial
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import planner
from ebrl_jax.resources import schedule_choice
from ebrl_jax.resources.profiles import StageProfile
from test_autoplan import _cfg, _fill  # pylint: disable=g-bad-import-order
from test_planner import PROFILES, SPACE  # pylint: disable=g-bad-import-order


def test_async_wins_when_training_and_simulation_overlap():
  # PROFILES (test_planner.py): sim t(E, q) = (0.2 + 0.8 E / 2048) max(1, 25 / q); train 100 / q_t; 4096 envs.
  # fused: every stage at 100 % on all envs in turn: sim(4096) 1.8 s + train 1.0 s = 2.8 s -> 1462.9 env-steps/s.
  # async: 2 groups, rollout 20 %, trainer 60 %: max(1.25, 1.667) = 1.667 s -> 2457.6 /s (test_planner);
  # sync: 4 groups at 20 %: 0.75 + 1.0 = 1.75 s -> 2340.6 /s. No hand-off: async, +68 % over fused.
  choice = schedule_choice.choose(PROFILES, SPACE, handoff_s=0.0)
  assert choice.schedule == 'async' and choice.plan.num_groups == 2
  assert choice.predicted['fused'] == pytest.approx(4096 / 2.8)
  assert choice.predicted['async'] == pytest.approx(2457.6)
  assert choice.predicted['sync'] == pytest.approx(4096 / 1.75)
  assert choice.reason.startswith('async: predicted +68.0% over fused')


def test_fused_wins_when_the_hand_off_eats_the_overlap():
  # A hand-off of 1.1 s per iteration: async 1.667 + 1.1 = 2.767 s, 1.2 % faster than fused's 2.8 s, within
  # the 5 % margin; sync 1.75 + 1.1 = 2.85 s is slower than fused. Fused runs.
  choice = schedule_choice.choose(PROFILES, SPACE, handoff_s=1.1)
  assert choice.schedule == 'fused' and choice.plan is None
  assert choice.predicted['async'] == pytest.approx(4096 / (5 / 3 + 1.1))
  assert 'within the 5% margin' in choice.reason and '+1.2%' in choice.reason
  # With no margin the 1.2 % is enough.
  assert schedule_choice.choose(PROFILES, SPACE, handoff_s=1.1, margin=0.0).schedule == 'async'


def test_fused_prediction_ignores_quotas_and_hand_offs():
  space = dataclasses.replace(SPACE, iteration_handoff_s=5.0, step_handoff_s=1.0)
  fused = schedule_choice.predict_fused(PROFILES, space)
  assert (fused.schedule, fused.num_groups, fused.iteration_s) == ('fused', 1, pytest.approx(2.8))
  with pytest.raises(ValueError, match='margin=-0.1'):
    schedule_choice.choose(PROFILES, SPACE, 0.0, margin=-0.1)


def test_cpu_simulation_is_no_gpu_work_in_a_shared_prediction():
  # Without quotas (no MPS) the GPU work of processes that run at once adds up. Native MuJoCo simulates on CPU
  # cores: 2 groups of 2048 envs at sim 1.0 s each are 1.0 s of rollout in parallel, not 2.0 s of GPU work.
  space = dataclasses.replace(SPACE, quota_limit=False)
  gpu = planner.evaluate(PROFILES, space, 2, {}, 'async')
  cpu = planner.evaluate(PROFILES, dataclasses.replace(space, sim_on_gpu=False), 2, {}, 'async')
  assert gpu.iteration_s == pytest.approx(2 * 1.0 + 1.0)  # max(1.0, 1.0, 2.0 + 1.0)
  assert cpu.iteration_s == pytest.approx(1.0)  # max(1.0, 1.0, 0 + 1.0)


def _auto(tmp_path, name, trial_s=0.0):
  cfg = _cfg(tmp_path)
  return dataclasses.replace(cfg,
                             schedule=dataclasses.replace(cfg.schedule,
                                                          name='auto',
                                                          run_dir=str(tmp_path / name),
                                                          num_timesteps=6_400),
                             resources=dataclasses.replace(cfg.resources, plan=False, auto_trial_s=trial_s))


@pytest.mark.parametrize(
    'stages, expected',
    [
        # 40 steps per iteration of 32 envs at 20 us per env-step (25.6 ms) and a 25 ms train step: overlapped in two
        # processes (async, max(25.6 / G, 25) ms) they beat their sum (fused, 50.6 ms) by far.
        (dict(sim_s=(20e-6, 1.0), gen_s=(1e-9, 1.0), train_s=(25e-3, 1.0)), 'async'),
        # The same simulation beside a 0.1 ms train step: nothing to overlap, and the hand-off costs; fused.
        (dict(sim_s=(20e-6, 1.0), gen_s=(1e-9, 1.0), train_s=(1e-4, 1.0)), 'fused'),
    ])
def test_auto_runs_the_schedule_its_profiles_choose(tmp_path, stages, expected):
  cfg = _auto(tmp_path, expected)
  _fill(cfg, **stages)
  summary = controller.run(cfg)
  record = summary.extra['auto']
  assert record['schedule'] == summary.schedule == expected and record['calibrated_s'] is None
  assert set(record['predicted']) == {'fused', 'sync', 'async'} and record['handoff_s'] > 0
  assert summary.env_steps >= 6_400 and summary.eval_curve
  assert 'auto_choice' in summary.compile_breakdown


def test_auto_tries_the_predicted_process_schedule_and_keeps_the_verdict(tmp_path):
  # The first store above (async predicted far ahead of fused: 25.6 ms of rollout beside a 25 ms train step) and
  # --auto_trial_s=3: async runs for real, then fused (in a process of its own), and the run goes on with the
  # faster by the trials' margin (the test holds the rule, whichever it gives). A second run of the same machine
  # and workload reads the verdict and runs no trial.
  cfg = _auto(tmp_path, 'first', trial_s=3.0)
  _fill(cfg, sim_s=(20e-6, 1.0), gen_s=(1e-9, 1.0), train_s=(25e-3, 1.0))
  summary = controller.run(cfg)
  record, trial = summary.extra['auto'], summary.extra['auto']['trial']
  assert trial['iterations'] >= 3 and trial['measured_env_steps_per_s'] > 0 and trial['stopped'] in ('max_train_s',
                                                                                                     'num_timesteps')
  assert trial['fused_iterations'] >= 2 and trial['fused_measured_env_steps_per_s'] > 0
  won = trial['measured_env_steps_per_s'] > trial['fused_measured_env_steps_per_s'] * (1 + auto_trial.MEASURED_MARGIN)
  assert summary.schedule == record['schedule'] == ('async' if won else 'fused') and trial['kept'] == won
  assert summary.env_steps >= 6_400 and 'auto_trial' in summary.compile_breakdown
  for name in ('auto_trial', 'auto_trial_fused'):
    assert (tmp_path / 'first' / name / 'summary.json').exists()
  # The run checked the verdict at its end: its own rate against the other schedule's trial (auto_trial.check_run).
  check = trial['run_check']
  other = trial['measured_env_steps_per_s' if summary.schedule == 'fused' else 'fused_measured_env_steps_per_s']
  if summary.train_wall_s >= 3.0 and check['confirmed'] is not None:
    assert check['confirmed'] == (summary.env_steps_per_s >= other * (1 - auto_trial.MEASURED_MARGIN))
  again = controller.run(
      dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, run_dir=str(tmp_path / 'second'))))
  if check['confirmed'] is False:  # dropped: the second run tries again, and keeps its new verdict
    assert (tmp_path / 'second' / 'auto_trial' / 'summary.json').exists() and 'auto_trial' in again.compile_breakdown
    assert again.extra['auto']['trial']['measured_env_steps_per_s'] != trial['measured_env_steps_per_s']
    return
  assert again.schedule == summary.schedule and not again.extra['auto']['trial']['pending']
  assert again.extra['auto']['trial']['measured_env_steps_per_s'] == trial['measured_env_steps_per_s']
  assert not (tmp_path / 'second' / 'auto_trial').exists() and 'auto_trial' not in again.compile_breakdown


def test_auto_refuses_live_quota_changes(tmp_path):
  with pytest.raises(ValueError, match='--schedule=auto cannot be combined with --quota_schedule'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(name='auto', run_dir=str(tmp_path)),
                      resources=config_lib.ResourceConfig(use_mps=True, quota_schedule='10:rollout=40'))
  assert autoplan.handoff_s(2_300_000, 1_150_000) == pytest.approx(2e-3)


def test_quotas_below_100_are_skipped_only_when_even_full_speed_everywhere_cannot_win():
  # PROFILES at 100 %: sim(4096) 1.8 s, sim(2048) 1.0 s, sim(1024) 0.6 s, train 1.0 s; fused 2.8 s. The best case
  # (every process at 100 %, none slowing another) is async with 2 groups: max(1.0, 1.0) = 1.0 s (+180 %; 4 groups
  # tie at max(0.6, 1.0), and the tie goes to fewer groups, whatever the last bit of either sum), so
  # the quotas may make a process schedule win: not skipped. With a 1.7 s hand-off it is 2.7 s, +3.7 % over fused,
  # within the 5 % margin: no quota can win, and `choose` (on every quota) indeed picks fused.
  best = schedule_choice.best_case(PROFILES, SPACE, 0.0)
  assert (best.schedule, best.num_groups, best.iteration_s) == ('async', 2, pytest.approx(1.0))
  assert schedule_choice.quotas_cannot_win(PROFILES, SPACE, 0.0) is None
  reason = schedule_choice.quotas_cannot_win(PROFILES, SPACE, 1.7)
  assert reason is not None and '+3.7% over fused' in reason and 'no SM quota can make it win' in reason
  # Sound: wherever the bound skips, the choice on the full profiles is fused.
  for handoff in (0.0, 0.5, 1.0, 1.5, 1.7, 1.8, 2.0, 3.0):
    if schedule_choice.quotas_cannot_win(PROFILES, SPACE, handoff) is not None:
      assert schedule_choice.choose(PROFILES, SPACE, handoff).schedule == 'fused'


def test_a_training_bound_run_like_w2_is_not_skipped():
  # W2's 100 % stage profile on the H200 (experiments/results/w2_stage_profile.json, per env step of a group):
  # sim 2.60 us (1024 envs) / 1.51 us (2048), generation 1.26 / 1.12 us, train 0.551 s, 32 steps per iteration.
  # Fused: 32 * 2048 * (1.51 + 1.12) us + 0.551 = 0.724 s. Training-bound, but async could hide the 0.125 s
  # rollout of 2 groups behind it (0.551 s, +31 %) if training kept its speed beside them: only the quotas'
  # profiles say whether it does, so they are calibrated.
  w2 = {name: StageProfile(name) for name in ('sim', 'generation', 'train')}
  for e, sim_us, gen_us in ((1024, 2.539, 1.262), (2048, 1.513, 1.120)):
    w2['sim'].add_sample(e, 100, sim_us * 1e-6 * e)
    w2['generation'].add_sample(e, 100, gen_us * 1e-6 * e)
  w2['train'].add_sample(65536, 100, 0.5514)
  space = planner.PlanSpace(num_envs=2048, steps_per_iteration=32, num_groups=(1, 2), group_sizes=(1024, 2048))
  assert schedule_choice.predict_fused(w2, space).iteration_s == pytest.approx(0.724, rel=1e-3)
  assert schedule_choice.best_case(w2, space, 0.0).iteration_s == pytest.approx(0.5514)
  assert schedule_choice.quotas_cannot_win(w2, space, 0.0) is None


def _w1_h200():
  """W1's 100 % stage profile on the H200 (--schedule=auto's calibration, w1_matrix_train30_h200.json's run):
  per step of a group, sim 2.76 / 2.75 / 3.32 / 3.79 ms and generation 0.20 / 0.24 / 0.21 / 0.28 ms at 512 /
  1024 / 2048 / 4096 envs, train 79.2 ms for the 327,680-transition batch; 80 steps per iteration."""
  w1 = {name: StageProfile(name) for name in ('sim', 'generation', 'train')}
  for e, sim_ms, gen_ms in ((512, 2.756, 0.199), (1024, 2.746, 0.236), (2048, 3.322, 0.206), (4096, 3.793, 0.277)):
    w1['sim'].add_sample(e, 100, sim_ms * 1e-3)
    w1['generation'].add_sample(e, 100, gen_ms * 1e-3)
  w1['train'].add_sample(327680, 100, 0.0792)
  space = planner.PlanSpace(num_envs=4096, steps_per_iteration=80, num_groups=(1, 2, 4), quotas=(100,))
  return w1, space


def test_under_mps_a_layout_the_model_cannot_tell_from_fused_goes_to_a_trial():
  # W1 on the H200, calibrated at 100 % only, hand-off 39.7 ms. fused: 80 * (3.80 + 0.30) ms + 79.2 ms = 0.4071 s
  # (804.9 k env-steps/s, the profile's fit). With the processes' GPU work added up (what `choose` predicts without
  # quotas) every process schedule is slower: async with 1 group 0.3279 + 0.0792 + 0.0397 = 0.4468 s, -8.9 %:
  # fused. With none slowing another, async with 1 group is max(0.3279, 0.0792) + 0.0397 = 0.3676 s (+10.7 %), 2
  # and 4 groups more; of those past the 5 % margin, 1 group loses least if the sum is right: its trial is asked
  # for (async with 2 groups by hand measured +6.3 % on that machine).
  w1, space = _w1_h200()
  choice = schedule_choice.choose(w1, space, 0.0397)
  assert choice.schedule == 'fused' and '-8.9%' in choice.reason
  assert choice.predicted['fused'] == pytest.approx(4096 * 80 / 0.40711, rel=1e-4)
  probe = schedule_choice.uncertain(w1, space, 0.0397)
  assert (probe.schedule, probe.plan.num_groups, probe.plan.shared) == ('async', 1, True)
  assert probe.plan.iteration_s == pytest.approx(0.4468, rel=1e-3)  # its own prediction: the sum
  assert 'on trial' in probe.reason and '+10.7%' in probe.reason and probe.plan.reason == probe.reason
  # An 80 ms hand-off: 1 group's bound (0.408 s) no longer beats fused; 2 groups' does (max(80 * 3.42 ms, 79.2
  # ms) + 80 ms = 0.353 s, +15.2 %; 3.42 ms: the profile's fit of a 2048-env step), with the best sum of those left.
  probe = schedule_choice.uncertain(w1, space, 0.08)
  assert (probe.schedule, probe.plan.num_groups) == ('async', 2) and '+15.2%' in probe.reason
  # 150 ms: even 4 groups' bound (0.246 + 0.15 s) is within the margin: no trial.
  assert schedule_choice.uncertain(w1, space, 0.15) is None
