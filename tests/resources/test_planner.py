"""Planner and re-planner on synthetic profiles whose best plan is worked out by hand in the comments.

Profiles are fitted from noiseless samples of t(b, q) = (a + c b) max(1, q_sat / q), so the planner sees real
StageProfiles. Quota grid 10..100 step 10 unless said otherwise.
"""
import pytest

from ebrl_jax.resources import planner
from ebrl_jax.resources.profiles import StageProfile


def _profile(name, a, c, q_sat, batches, quotas=tuple(range(10, 101, 10))):
  profile = StageProfile(name)
  for b in batches:
    for q in quotas:
      profile.add_sample(b, q, (a + c * b) * max(1.0, q_sat / q))
  return profile


# sim: one group's rollout step. t(E, q) = (0.2 + 0.8 E / 2048) max(1, 25 / q): 1 s for 2048 envs at >= 25 %;
#   E = 4096: 1.8 s, E = 2048: 1.0 s, E = 1024: 0.6 s (times 25 / q below 25 %).
# train: 1 s at 100 %, time proportional to 1 / q (q_sat = 100): t = 100 / q_t.
PROFILES = {
    'sim': _profile('sim', 0.2, 0.8 / 2048, 25.0, (1024, 2048, 4096)),
    'train': _profile('train', 1.0, 0.0, 100.0, (4096, 8192))
}
SPACE = planner.PlanSpace(num_envs=4096, steps_per_iteration=1, num_groups=(1, 2, 4))


def test_async_plan_is_the_hand_computed_one():
  # async: G q_r + q_t <= 100, T = max(T_r, T_t).
  #   G=1 (1.8 s): q_r >= 30 saturates; q_r=30, q_t=60 -> max(1.8, 1.667) = 1.8 (total 90; q_t=50 gives 2.0).
  #   G=2 (1.0 s): q_r=20 -> T_r = 25/20 = 1.25, q_t <= 60 -> 1.667: T = 1.667 (q_r=30: q_t <= 40 -> 2.5).
  #   G=4 (0.6 s): q_r=10 -> T_r = 0.6 * 2.5 = 1.5, q_t <= 60 -> 1.667: T = 1.667, a tie with G=2.
  # Best 1.667 s; the tie goes to fewer groups: G=2, q_r=20, q_t=60; 4096 env-steps / (5/3 s) = 2457.6 /s.
  best = planner.plan(PROFILES, SPACE, 'async')
  assert (best.num_groups, best.envs_per_group, best.quotas) == (2, 2048, {'rollout': 20, 'trainer': 60})
  assert best.rollout_s == pytest.approx(1.25)
  assert best.train_s == pytest.approx(100 / 60)
  assert best.iteration_s == pytest.approx(100 / 60)
  assert best.env_steps_per_s == pytest.approx(2457.6)
  assert best.total_quota == 100
  assert 'iteration 1.667 s' in best.reason and 'runner-up 4 group(s)' in best.reason


def test_sync_chooses_differently():
  # sync: G q_r <= 100 and q_t <= 100 (the trainer runs alone), T = T_r + T_t; T_t = 1.0 at q_t = 100.
  #   G=1: 1.8 + 1 = 2.8.  G=2: q_r >= 30 -> 1.0 + 1 = 2.0.  G=4: q_r=20 (80 %) -> 0.6 * 25/20 = 0.75 -> 1.75.
  best = planner.plan(PROFILES, SPACE, 'sync')
  assert (best.num_groups, best.quotas) == (4, {'rollout': 20, 'trainer': 100})
  assert best.iteration_s == pytest.approx(1.75)
  assert 'runner-up 2 group(s)' in best.reason and '+14.3%' in best.reason  # 2.0 / 1.75 - 1


def test_fixed_choices_are_respected():
  # num_groups=1: q_r=30, q_t=60 -> 1.8 s (see the async test).
  one = planner.plan(PROFILES, SPACE, 'async', fixed={'num_groups': 1})
  assert (one.num_groups, one.quotas, one.iteration_s) == (1, {'rollout': 30, 'trainer': 60}, pytest.approx(1.8))
  assert planner.plan(PROFILES, SPACE, 'async', fixed={'envs_per_group': 4096}).quotas == one.quotas
  # rollout=10: G=1 -> 1.8 * 2.5 = 4.5; G=2 -> 2.5 (q_t=40 is the cheapest that keeps up);
  # G=4 -> max(1.5, 100/60) = 1.667 with q_t=60.
  pinned = planner.plan(PROFILES, SPACE, 'async', fixed={'rollout': 10})
  assert (pinned.num_groups, pinned.quotas) == (4, {'rollout': 10, 'trainer': 60})
  assert pinned.iteration_s == pytest.approx(100 / 60)
  # A quota off the grid may be pinned: trainer 55 -> G=2, q_r=20: max(1.25, 1.818) = 1.818.
  off_grid = planner.plan(PROFILES, SPACE, 'async', fixed={'trainer': 55})
  assert off_grid.quotas['trainer'] == 55 and off_grid.iteration_s == pytest.approx(100 / 55)
  with pytest.raises(ValueError, match='no feasible'):  # trainer 100 % leaves nothing for rollout under async
    planner.plan(PROFILES, SPACE, 'async', fixed={'trainer': 100})
  with pytest.raises(ValueError, match='valid keys: num_groups'):
    planner.plan(PROFILES, SPACE, 'async', fixed={'groups': 2})
  with pytest.raises(ValueError, match='equal groups'):
    planner.plan(PROFILES, SPACE, 'async', fixed={'num_groups': 3})


def test_separate_generation_process():
  # sim 10 ms a step, generation 4 ms * max(1, 50 / q_g), train 0.1 s, all independent of batch; 10 steps;
  # 10 ms hand-off a step. q_g=25: gen = 8 ms.
  #   G=2: step = max(10 + 8 + 10, 2 * 8) = 28 ms -> T_r = 0.28 s; async T = max(0.28, 0.1) = 0.28.
  #   G=4: step = max(28, 4 * 8 = 32) = 32 ms: the generation process is the bottleneck -> 0.32 s.
  profiles = {
      'sim': _profile('sim', 0.01, 0.0, 1.0, (512, 1024)),
      'generation': _profile('generation', 0.004, 0.0, 50.0, (512, 1024)),
      'train': _profile('train', 0.1, 0.0, 1.0, (64, 128))
  }
  space = planner.PlanSpace(num_envs=2048,
                            steps_per_iteration=10,
                            num_groups=(2, 4),
                            colocate_generation=False,
                            step_handoff_s=0.01)
  quotas = {'rollout': 20, 'generation': 25, 'trainer': 15}
  assert planner.evaluate(profiles, space, 2, quotas).iteration_s == pytest.approx(0.28)
  assert planner.evaluate(profiles, space, 4, quotas).iteration_s == pytest.approx(0.32)
  # Search: G=2 with q_g >= 50 (gen 4 ms): step = max(24, 8) ms -> 0.24 s; the least total quota for it is
  # 2 * 10 (sim saturates at <= 10) + 50 + 10 = 80.
  best = planner.plan(profiles, space, 'async')
  assert (best.num_groups, best.quotas) == (2, {'rollout': 10, 'generation': 50, 'trainer': 10})
  assert best.iteration_s == pytest.approx(0.24)


# Re-planner: sync, grid {50, 100}, 2048 envs in 1 or 2 groups; sim saturates at 50 % (q_sat = 50), so two
# groups at 50 % each run side by side; train is 1 s at any quota. T = T_r(E) + 1.
#   gain  5 %: a = 0.9, c = 0.1/1024 -> T_r(2048) = 1.1, T_r(1024) = 1.0: 2.1 s vs 2.0 s = +5 %.
#   gain 30 %: a = 0.4, c = 0.6/1024 -> T_r(2048) = 1.6, T_r(1024) = 1.0: 2.6 s vs 2.0 s = +30 %.
RE_SPACE = planner.PlanSpace(num_envs=2048, num_groups=(1, 2), quotas=(50, 100))


def _re_profiles(a, c):
  return {
      'sim': _profile('sim', a, c, 50.0, (1024, 2048), quotas=(25, 50, 100)),
      'train': _profile('train', 1.0, 0.0, 1.0, (2048, 4096), quotas=(50, 100))
  }


def _replanner(profiles, **kw):
  current = planner.plan(profiles, RE_SPACE, 'sync', fixed={'num_groups': 1})
  kw = dict(dict(hysteresis=0.10, min_interval_iterations=20, change_cost_s=10.0, horizon_iterations=100), **kw)
  return planner.Replanner(RE_SPACE, 'sync', plan=current, **kw), current


def test_replanner_keeps_the_plan_for_a_gain_within_hysteresis():
  profiles = _re_profiles(0.9, 0.1 / 1024)
  replanner, current = _replanner(profiles)
  assert current.iteration_s == pytest.approx(2.1)
  assert replanner.update(profiles, iteration=40) is None
  decision = replanner.decisions[-1]
  assert not decision.changed and decision.plan is current
  assert decision.predicted_gain == pytest.approx(0.05)
  assert 'hysteresis' in decision.reason


def test_replanner_changes_for_a_large_gain_only_after_min_interval():
  profiles = _re_profiles(0.4, 0.6 / 1024)
  replanner, current = _replanner(profiles)
  assert current.iteration_s == pytest.approx(2.6)
  assert replanner.update(profiles, iteration=19, measured_iteration_s=2.6) is None  # 19 < 20 since the start
  assert '19 < 20' in replanner.decisions[-1].reason
  new = replanner.update(profiles, iteration=20, measured_iteration_s=2.6)
  # Saves 0.6 s an iteration: 60 s over 100 iterations > the 10 s change cost.
  assert new is not None and (new.num_groups, new.quotas) == (2, {'rollout': 50, 'trainer': 50})
  assert new.iteration_s == pytest.approx(2.0)
  assert replanner.plan is new and replanner.decisions[-1].changed
  assert replanner.decisions[-1].predicted_gain == pytest.approx(0.30)
  # The next decision reports the measured gain of that change: 2.6 s before, 2.0 s after -> +30 %.
  assert replanner.update(profiles, iteration=21, measured_iteration_s=2.0) is None
  assert replanner.decisions[-1].measured_gain == pytest.approx(0.30)
  assert [d.changed for d in replanner.decisions] == [False, True, False]


def test_replanner_keeps_a_plan_whose_change_does_not_pay_back():
  profiles = _re_profiles(0.4, 0.6 / 1024)
  replanner, _ = _replanner(profiles, change_cost_s=100.0)  # saves 0.6 * 100 = 60 s < 100 s
  assert replanner.update(profiles, iteration=50) is None
  assert 'pay back' in replanner.decisions[-1].reason
  replanner, _ = _replanner(profiles)  # cost 10 s, but 10 iterations left: 0.6 * 10 = 6 s < 10 s
  assert replanner.update(profiles, iteration=50, remaining_iterations=10) is None
  assert replanner.update(profiles, iteration=50, remaining_iterations=20) is not None  # 12 s > 10 s


def test_replanner_without_a_plan_adopts_the_best():
  profiles = _re_profiles(0.4, 0.6 / 1024)
  replanner = planner.Replanner(RE_SPACE, 'sync')
  first = replanner.update(profiles, iteration=0)
  assert first is not None and first.num_groups == 2 and replanner.decisions[-1].reason.startswith('initial')


def test_rollouts_on_cpu_take_no_quota():
  # Native MuJoCo with a separate generation process: the rollout processes hold no GPU context, so only
  # generation and trainer share the 100 %. sim 10 ms a step (any quota), generation 4 ms * max(1, 50 / q_g),
  # train 0.2 s * max(1, 50 / q_t); 10 steps, 10 ms hand-off a step; async.
  #   rollouts on CPU: q_g = 50, q_t = 50 -> step = max(10 + 4 + 10, 2 * 4) = 24 ms -> T_r = 0.24 s, T_t = 0.2 s:
  #     T = 0.24 s (G=4: max(24, 16) ms, a tie, goes to fewer groups).
  #   the same profiles with rollouts counted (2 * q_r >= 20): q_g + q_t <= 80; q_g = q_t = 40 -> gen 5 ms,
  #     step 25 ms -> 0.25 s, train 0.25 s: T = 0.25 s (q_g = 50, q_t = 30: 0.333; q_g = 30, q_t = 50: 0.267).
  profiles = {
      'sim': _profile('sim', 0.01, 0.0, 1.0, (512, 1024)),
      'generation': _profile('generation', 0.004, 0.0, 50.0, (512, 1024)),
      'train': _profile('train', 0.2, 0.0, 50.0, (64, 128))
  }
  common = dict(num_envs=2048,
                steps_per_iteration=10,
                num_groups=(2, 4),
                colocate_generation=False,
                step_handoff_s=0.01)
  host = planner.PlanSpace(rollout_on_gpu=False, **common)
  assert host.roles == ('generation', 'trainer')
  best = planner.plan(profiles, host, 'async')
  assert (best.num_groups, best.quotas) == (2, {'generation': 50, 'trainer': 50})
  assert best.iteration_s == pytest.approx(0.24)
  assert best.total_quota == 100
  on_gpu = planner.plan(profiles, planner.PlanSpace(**common), 'async')
  assert (on_gpu.num_groups, on_gpu.quotas) == (2, {'rollout': 10, 'generation': 40, 'trainer': 40})
  assert on_gpu.iteration_s == pytest.approx(0.25)
  with pytest.raises(ValueError, match='simulate on CPU cores only'):
    planner.plan(profiles, host, 'async', fixed={'rollout': 10})
  with pytest.raises(ValueError, match='needs a separate generation process'):
    planner.PlanSpace(num_envs=2048, rollout_on_gpu=False)


def test_no_quotas_is_a_candidate_and_wins_where_quotas_starve_the_trainer():
  # W3's shape: simulation on CPU cores (no quota), one generation process, the trainer; 10 steps an iteration.
  # sim 10 ms a step at any quota; generation 1 ms * max(1, 50 / q_g); train 0.1 s * 100 / q_t.
  # Quotas (q_g + q_t <= 100): q_g=10 -> gen 5 ms, T_r = 10 * 15 ms = 0.15 s, q_t=90 -> 0.111: T = 0.15;
  #   q_g=20 -> 2.5 ms, T_r = 0.125, q_t=80 -> 0.125: T = 0.125 (the best with quotas);
  #   q_g=30 -> 1.667 ms, T_r = 0.1167, q_t=70 -> 0.1429.
  # No quotas: gen 1 ms, T_r = 10 * 11 ms = 0.11 s, T_t = 0.1, the GPU's work added up gpu_r + T_t =
  #   10 * 1 * 1 ms + 0.1 = 0.11: T = max(0.11, 0.1, 0.11) = 0.11 s, which beats 0.125.
  profiles = {
      'sim': _profile('sim', 0.01, 0.0, 1.0, (512, 1024)),
      'generation': _profile('generation', 0.001, 0.0, 50.0, (512, 1024)),
      'train': _profile('train', 0.1, 0.0, 100.0, (10240,))
  }
  space = planner.PlanSpace(num_envs=1024,
                            steps_per_iteration=10,
                            num_groups=(1,),
                            colocate_generation=False,
                            rollout_on_gpu=False)
  best = planner.plan(profiles, space, 'async')
  assert best.shared and best.quotas == {'generation': 100, 'trainer': 100}
  assert best.iteration_s == pytest.approx(0.11)
  assert 'no quotas (SMs shared)' in best.reason
  assert 'runner-up 1 group(s) x 1024 envs, quotas generation 20% trainer 80%' in best.reason
  assert '+13.6%' in best.reason  # 0.125 / 0.11 - 1
  # Without the option, or with a quota pinned by hand, the quota plan stands.
  no_option = planner.plan(profiles, planner.PlanSpace(**{**space.__dict__, 'shared_option': False}), 'async')
  assert not no_option.shared and no_option.quotas == {'generation': 20, 'trainer': 80}
  assert no_option.iteration_s == pytest.approx(0.125)
  assert not planner.plan(profiles, space, 'async', fixed={'generation': 20}).shared
  # Without MPS every plan is shared: the same prediction.
  no_mps = planner.PlanSpace(**{**space.__dict__, 'quotas': (100,), 'quota_limit': False})
  alone = planner.plan(profiles, no_mps, 'async')
  assert alone.shared and alone.iteration_s == pytest.approx(0.11)
  # sync, no quotas: T = max(T_r, gpu_r) + T_t = max(0.11, 0.01) + 0.1.
  assert planner.evaluate(profiles, space, 1, {}, 'sync', shared=True).iteration_s == pytest.approx(0.21)
  # A Replanner holding a shared plan predicts it as shared.
  replanner = planner.Replanner(space, 'async', plan=best)
  assert replanner.update(profiles, iteration=100) is None
  assert replanner.decisions[-1].current_s == pytest.approx(0.11)


def test_shared_plans_add_up_gpu_work_of_groups_that_simulate_on_the_gpu():
  # PROFILES (MJX-like, sim on the GPU, co-located): no quotas, G groups' steps take turns on the GPU:
  #   async G=1: max(1.8, 1.0, 1 * 1.8 + 1.0) = 2.8 s; G=2: 2 * 1.0 + 1.0 = 3.0; G=4: 4 * 0.6 + 1.0 = 3.4.
  for g, expected in ((1, 2.8), (2, 3.0), (4, 3.4)):
    assert planner.evaluate(PROFILES, SPACE, g, {}, 'async', shared=True).iteration_s == pytest.approx(expected)
  assert not planner.plan(PROFILES, SPACE, 'async').shared  # 1.667 s with quotas (see the first test)
