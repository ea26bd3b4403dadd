"""--replan_groups' decisions by hand on synthetic windows: a change when the gain beats the margin and pays back
its pause within the horizon, a kept layout with the failed condition as its reason otherwise."""
import json

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.resources import group_replanner
from ebrl_jax.resources import planner
from ebrl_jax.resources import profiles

# 32 envs, 80 env steps each per iteration: an iteration is 2560 env steps. Native MuJoCo without MPS: the groups
# simulate on CPU cores (no GPU work of theirs to add up) and every process may use every SM.
_SPACE = planner.PlanSpace(num_envs=32,
                           steps_per_iteration=80,
                           num_groups=(1, 2, 4),
                           quotas=(100,),
                           quota_limit=False,
                           sim_on_gpu=False)
_STEPS = 32 * 80


def _window(groups, collect_s, train_s, rate=None):
  rate = rate if rate is not None else _STEPS / (collect_s + train_s)  # sync: collect, then train
  return group_replanner.Window(groups=groups,
                                iterations=5,
                                seconds=5 * _STEPS / rate,
                                env_steps_per_s=rate,
                                collect_s=collect_s,
                                train_s=train_s)


def _replanner(schedule='sync', **kw):
  kw = {'margin': 0.05, 'horizon_s': 60.0, 'assumed_pause_s': 2.0, **kw}
  return group_replanner.GroupReplanner(_SPACE, schedule, (1, 2, 4), **kw)


def test_changes_when_the_gain_beats_the_margin_and_pays_back_then_measures_and_keeps_the_measured_best():
  r = _replanner()
  # 1 group: 1.0 s collecting, 0.25 s training: 2048 env steps/s. One size measured, so the in-run 'sim' profile
  # is proportional to the group size: 4 groups collect in 0.25 s, an iteration of 0.5 s, 2.5x the rate.
  r.observe(_window(1, 1.0, 0.25))
  d = r.decide(iteration=6, remaining_s=100.0)
  assert d['changed'] and d['new_groups'] == 4 and d['reason'].startswith('change to 4 groups')
  assert d['candidates']['4']['source'] == 'model' and d['candidates']['1']['source'] == 'measured over 1 window(s)'
  assert d['predicted_gain'] == pytest.approx(1.25 / 0.5 - 1)
  assert d['candidates']['2']['gain'] == pytest.approx(1.25 / 0.75 - 1)
  # The assumed 2 s pause: 5120 env steps/s catch up with 2048 after 2 * 5120 / (5120 - 2048) s.
  assert d['pause_source'].startswith('assumed') and d['payback_s'] == pytest.approx(2 * 5120 / 3072)
  assert 'one batch size measured' in d['fits']['sim']
  # The change's cost, as the changer records it, joins the decision; the measured pause replaces the assumed.
  r.changed({'new_groups': 4, 'standbys_ready_s': 3.0, 'pause_s': 0.5, 'env_steps_lost': 1024.0, 'failed': False})
  assert d['cost'] == {'standbys_ready_s': 3.0, 'pause_s': 0.5, 'env_steps_lost': 1024.0, 'failed': False}
  assert r.pause_s == 0.5
  # 4 groups measured 3000 env steps/s (collect 0.5 s: they contend), not the predicted 5120: the outcome is
  # recorded against the rate before the change.
  outcome = r.observe(_window(4, 0.5, 0.25, rate=3000.0))
  assert outcome is d and d['measured_gain'] == pytest.approx(3000 / 2048 - 1)
  # Now 1 and 4 groups are measured; 2 is modelled from two sizes (per step a + c * E through 1/80 at 32 envs and
  # 0.5/80 at 8: 1/120 at 16, a 0.667 s collect), 3000 * 0.75 / 0.9167 = 2455 < 3000: 4 groups stay.
  d2 = r.decide(iteration=12, remaining_s=100.0)
  assert not d2['changed'] and d2['reason'].startswith('keep: the current layout is the best predicted')
  assert d2['candidates']['1']['source'].startswith('measured') and d2['candidates']['1']['env_steps_per_s'] == 2048
  assert d2['candidates']['2']['env_steps_per_s'] == pytest.approx(3000 * 0.75 / (80 / 120 + 0.25), rel=1e-3)
  assert d2['pause_source'] == 'measured' and d2['expected_pause_s'] == 0.5
  # A layout's measured rate is the mean of its windows (one window on a busy machine can be far off).
  r.observe(_window(4, 0.5, 0.25, rate=2600.0))
  assert r.rate(4) == 2800.0 and r.decide(iteration=18)['candidates']['4']['env_steps_per_s'] == 2800.0
  json.dumps(r.decisions)  # the records go into summary.json as they are


def test_keeps_the_layout_within_the_margin():
  r = _replanner(margin=0.10)
  r.observe(_window(1, 0.1, 1.0))  # training-bound: 4 groups would save 0.075 of 1.1 s, +7.3 %
  d = r.decide(iteration=6, remaining_s=100.0)
  assert not d['changed'] and d['best_groups'] == 4 and d['predicted_gain'] == pytest.approx(1.1 / 1.025 - 1)
  assert d['reason'].startswith('keep: gain within the 10% margin')


def test_async_training_bound_layouts_predict_no_gain():
  r = _replanner('async')
  r.observe(_window(2, 0.2, 1.0, rate=_STEPS / 1.0))  # async: the iteration is max(collect, train)
  d = r.decide(iteration=6)
  assert not d['changed'] and d['best_groups'] == 2  # every layout ties at +0 %: a tie keeps the current one
  assert all(o['gain'] <= 1e-9 for o in d['candidates'].values())


@pytest.mark.parametrize('pause_s, remaining_s, horizon_s', [(100.0, 1000.0, 60.0), (2.0, 2.0, 2.0)])
def test_keeps_the_layout_when_the_pause_does_not_pay_back_within_the_horizon(pause_s, remaining_s, horizon_s):
  """A 100 s pause against a 60 s horizon; a 2 s pause (paid back in 3.3 s) with 2 s of the run left."""
  r = _replanner(assumed_pause_s=pause_s)
  r.observe(_window(1, 1.0, 0.25))
  d = r.decide(iteration=6, remaining_s=remaining_s)
  assert not d['changed'] and d['horizon_s'] == horizon_s and d['payback_s'] > horizon_s
  assert d['reason'].startswith('keep: the change would not pay back its pause within the horizon')


def test_the_default_assumed_pause_lets_a_first_change_of_a_third_pay_back_where_the_quota_cost_did_not():
  """Sync, 1 group collecting 0.5 s and training 1.0 s; the in-run profile (one size: time proportional to size)
  predicts 4 groups at 0.125 + 1.0 s, +33.3 %. With the default assumed pause (--replan_group_change_cost_s, 8 s)
  4 groups catch up 8 * 1.333 / 0.333 = 32 s after the change, within the 60 s horizon: change. With the quota
  re-planner's 30 s (--replan_change_cost_s, which the group re-planner used before) they would need 120 s: a
  first change then had to be predicted over +100 % (30 (1 + g) / g <= 60)."""
  resources = config_lib.ResourceConfig()
  assert resources.replan_group_change_cost_s == 8.0 and resources.replan_change_cost_s == 30.0
  outcomes = {}
  for pause in (resources.replan_group_change_cost_s, resources.replan_change_cost_s):
    r = group_replanner.GroupReplanner(_SPACE, 'sync', (1, 2, 4), assumed_pause_s=pause)  # margin 5 %, 60 s
    r.observe(_window(1, 0.5, 1.0))
    outcomes[pause] = r.decide(iteration=6, remaining_s=1000.0)
  changed, kept = outcomes[8.0], outcomes[30.0]
  assert changed['changed'] and changed['new_groups'] == 4 and changed['expected_pause_s'] == 8.0
  assert changed['predicted_gain'] == pytest.approx(1.5 / 1.125 - 1)
  assert changed['payback_s'] == pytest.approx(32.0) and changed['horizon_s'] == 60.0
  assert not kept['changed'] and kept['payback_s'] == pytest.approx(120.0)
  assert kept['reason'].startswith('keep: the change would not pay back its pause within the horizon')
  # The class's own default is the flag's.
  assert group_replanner.GroupReplanner(_SPACE, 'sync', (1, 2)).assumed_pause_s == 8.0


def test_the_standbys_build_time_counts_against_the_horizon():
  """Paid back 3.3 s after the standbys are ready: before any change their build time is unknown (0 counted), so
  it pays within 10 s; once a change measured 8 s of building, it misses the 10 s horizon."""
  r = _replanner(horizon_s=10.0)
  r.observe(_window(1, 1.0, 0.25))
  d = r.decide(iteration=6)
  assert d['changed'] and d['expected_standby_s'] is None
  r.changed({'new_groups': 4, 'standbys_ready_s': 8.0, 'pause_s': 2.0, 'env_steps_lost': 0.0, 'failed': False})
  r.observe(_window(1, 1.0, 0.25))  # (a window of the old layout: this change's outcome stays unmeasured)
  d = r.decide(iteration=12)
  assert not d['changed'] and 'would not pay back' in d['reason'] and d['expected_standby_s'] == 8.0


def test_a_layout_whose_change_failed_is_not_proposed_again():
  r = _replanner()
  r.observe(_window(1, 1.0, 0.25))
  assert r.decide(iteration=6)['new_groups'] == 4
  r.changed({'new_groups': 4, 'standbys_ready_s': float('nan'), 'pause_s': float('nan'), 'failed': True})
  assert r.pause_s is None  # a failed change measured no pause
  r.observe(_window(1, 1.0, 0.25))
  d = r.decide(iteration=12)
  assert '4' not in d['candidates'] and d['new_groups'] == 2


def test_only_the_latest_keep_decisions_are_kept_and_every_change():
  r = _replanner()
  r.observe(_window(1, 1.0, 0.25))
  change = r.decide(iteration=1)
  r.changed({'new_groups': 4, 'standbys_ready_s': 1.0, 'pause_s': 0.1, 'env_steps_lost': 0.0, 'failed': False})
  for i in range(group_replanner.KEEP_DECISIONS + 5):
    r.observe(_window(4, 0.25, 0.25))
    assert not r.decide(iteration=10 + i)['changed']
  assert r.decisions[0] is change and len(r.decisions) == 1 + group_replanner.KEEP_DECISIONS and r.left_out == 5
  assert r.decisions[-1]['iteration'] == 10 + group_replanner.KEEP_DECISIONS + 4


def test_a_calibrated_store_is_corrected_not_refitted():
  """With --plan's profiles the windows move each profile's correction (EMA 0.2) and leave its samples: a collect
  measured at twice the calibrated time takes the sim correction to 1.2, and every layout's prediction with it."""
  store = profiles.ProfileStore('m', 'w')
  for e, per_step in ((32, 1 / 80), (16, 0.6 / 80), (8, 0.4 / 80)):
    store.profile('sim').add_sample(e, 100, per_step)
  store.profile('train').add_sample(_STEPS, 100, 0.25)
  r = _replanner(store=store)
  r.observe(_window(1, 2.0, 0.25))
  assert store['sim'].correction == pytest.approx(1.2) and len(store['sim'].samples) == 3
  assert store['train'].correction == pytest.approx(1.0)
  d = r.decide(iteration=6)
  now_s, four_s = 1.2 * 1.0 + 0.25, 1.2 * 0.4 + 0.25  # sync: collect + train; 8 envs calibrated at 0.4 s
  assert d['candidates']['4']['gain'] == pytest.approx(now_s / four_s - 1)


def test_no_decision_before_stage_times_are_measured():
  r = _replanner()
  r.observe(
      group_replanner.Window(groups=1, iterations=5, seconds=1.0, env_steps_per_s=1000.0, collect_s=None, train_s=0.2))
  d = r.decide(iteration=6)
  assert not d['changed'] and 'no sim time measured yet' in d['reason']


def test_quota_follows_the_total_share_and_bad_arguments_raise_errors():
  assert group_replanner.quota_for(40, 2, 4) == 20 and group_replanner.quota_for(None, 2, 4) is None
  assert group_replanner.quota_for(3, 1, 8) == 1
  with pytest.raises(ValueError, match='horizon_s'):
    _replanner(horizon_s=0.0)
  with pytest.raises(ValueError, match='no window observed'):
    _replanner().decide(iteration=1)
