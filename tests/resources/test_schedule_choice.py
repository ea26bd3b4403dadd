"""--schedule=auto: fused, sync or async chosen from stage profiles, worked out by hand; a CPU run that takes the
choice from a saved profile store and runs it."""
import dataclasses

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import planner
from ebrl_jax.resources import schedule_choice
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


def _auto(tmp_path, name):
  cfg = _cfg(tmp_path)
  return dataclasses.replace(cfg,
                             schedule=dataclasses.replace(cfg.schedule,
                                                          name='auto',
                                                          run_dir=str(tmp_path / name),
                                                          num_timesteps=6_400),
                             resources=dataclasses.replace(cfg.resources, plan=False))


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


def test_auto_refuses_live_quota_changes(tmp_path):
  with pytest.raises(ValueError, match='--schedule=auto cannot be combined with --quota_schedule'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(name='auto', run_dir=str(tmp_path)),
                      resources=config_lib.ResourceConfig(use_mps=True, quota_schedule='10:rollout=40'))
  assert autoplan.handoff_s(2_300_000, 1_150_000) == pytest.approx(2e-3)
