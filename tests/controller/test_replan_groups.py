"""--replan_groups: the re-planner changes the env groups from measured step times during a run, no segment lost
or duplicated; its flags' errors name the flag. The decisions by hand: tests/resources/test_group_replanner.py."""
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.controller import group_replan
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import profile_keys
from ebrl_jax.resources import profiles


def _config(run_dir, **schedule):
  # Collecting dominates: 40 steps of 32 native-MuJoCo envs an iteration, one SGD step on them. With one group
  # measured, the in-run profile predicts 4 groups of 8 envs collect in a quarter of the time.
  return config_lib.Config(
      sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=32, num_eval_envs=8, num_threads=1),
      algo=config_lib.AlgoConfig(unroll_length=40, batch_size=32, num_minibatches=1, num_updates_per_batch=1),
      schedule=config_lib.ScheduleConfig(
          **{
              'name': 'async',
              'run_dir': str(run_dir),
              'compilation_cache_dir': '',
              'progress_bar': False,
              'transport': 'thread',
              'num_groups': 1,
              'num_evals': 1,
              'evaluator': 'trainer',
              'replan_groups': (2, 4),
              # room for a slow group under CI load: the test is about losing and
              # duplicating segments across a change, not about staleness (a segment more
              # than one version behind was dropped once on the loaded 2-core machine)
              'max_staleness': 4,
              'num_timesteps': 1280 * 36,
              **schedule
          }),
      resources=config_lib.ResourceConfig(replan_window=3, replan_hysteresis=0.05, replan_group_change_cost_s=0.1))


def test_replanner_changes_the_groups_without_losing_or_duplicating_a_segment(tmp_path):
  cfg = _config(tmp_path)
  summary = controller.run(cfg)
  extra = summary.extra
  assert summary.env_steps == summary.iterations * cfg.env_steps_per_iteration
  # lcm(1, 2, 4) = 4 blocks of 8 envs an iteration, each reaching the trainer once.
  assert extra['segments_consumed'] == 4 * summary.iterations
  assert extra['segments_duplicated'] == 0 and extra['segments_dropped_stale'] == 0
  record = extra['relayout']
  assert record['mode'] == 'replan_groups' and 'compiles' in record['generation_buckets']
  changed = [d for d in record['decisions'] if d['changed']]
  assert changed, [d['reason'] for d in record['decisions']]
  first = changed[0]
  assert first['groups'] == 1 and first['new_groups'] in (2, 4) and first['predicted_gain'] > 0.05
  assert first['candidates'][str(first['new_groups'])]['source'] == 'model'
  change = record['changes'][0]
  assert (change['old_groups'], change['new_groups']) == (1, first['new_groups']) and not change['failed']
  assert change['predicted_gain'] == first['predicted_gain'] and change['reason'] == first['reason']
  assert first['cost']['pause_s'] == change['pause_s'] >= 0 and change['standbys_ready_s'] > 0
  assert change['envs_per_group'] == 32 // first['new_groups']
  # The new layout's first window ended before the run did: the measured gain sits beside the predicted one.
  assert isinstance(first['measured_gain'], float) and first['measured_env_steps_per_s'] > 0


@pytest.mark.parametrize('schedule, resources, words', [
    (dict(replan_groups=(4,), group_schedule='4:groups=2'), {}, 'both change the env groups'),
    (dict(replan_groups=(0,)), {}, 'must be >= 1'),
    (dict(replan_groups=(3,)), {}, 'whole blocks'),
    (dict(num_groups=2, replan_groups=(1,)), {
        'num_envs': 48
    }, 'power-of-two group sizes'),
    (dict(replan_groups=(2,), deterministic=True), {}, '--deterministic'),
    (dict(replan_groups=(2,), colocate_generation=False), {}, '--colocate_generation'),
    (dict(replan_groups=(2,), name='fused'), {}, '--schedule=sync or async'),
    (dict(replan_groups=(2,), name='auto'), {}, '--schedule=sync or async'),
])
def test_replan_groups_errors_name_the_flag(tmp_path, schedule, resources, words):
  with pytest.raises(ValueError, match=words.replace('-', r'\-')):
    config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=resources.get('num_envs', 32)),
                      algo=config_lib.AlgoConfig(batch_size=48 if resources else 32, num_minibatches=1),
                      schedule=config_lib.ScheduleConfig(**{
                          'name': 'sync',
                          'run_dir': str(tmp_path),
                          **schedule
                      }))
  with pytest.raises(ValueError, match=r'\-\-replan_window'):
    config_lib.ResourceConfig(replan_window=0)


def test_the_trigger_reads_the_plan_store_where_the_run_was_planned_else_measures_in_the_run(tmp_path):
  cfg = _config(tmp_path)
  path = str(tmp_path / 'store.json')
  store = profiles.ProfileStore(autoplan.machine_key(), profile_keys.workload_key(cfg))
  for name in ('sim', 'train'):
    store.profile(name).add_sample(8, 100, 0.01)
  store.save(path)
  planned = group_replan.make_trigger(cfg, None, {'profile_store': path}, mps_active=False).replanner
  assert planned.calibrated and sorted(planned.store) == ['sim', 'train'] and planned.candidates == (1, 2, 4)
  assert planned.space.steps_per_iteration == 40 and not planned.space.sim_on_gpu
  # The group re-planner's own assumed pause (--replan_group_change_cost_s), not the quota re-planner's.
  assert planned.assumed_pause_s == cfg.resources.replan_group_change_cost_s == 0.1
  assert cfg.resources.replan_change_cost_s == config_lib.ResourceConfig().replan_change_cost_s == 30.0
  unplanned = group_replan.make_trigger(cfg, None, None, mps_active=False).replanner
  assert not unplanned.calibrated and not list(unplanned.store)
  # A store without the stages (another machine's file reads as empty): measured in the run, with a warning.
  other = group_replan.make_trigger(cfg, None, {'profile_store': str(tmp_path / 'none.json')}, False).replanner
  assert not other.calibrated
