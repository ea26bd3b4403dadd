"""--plan: the decision from a profile store (hand-checkable), its pins, its keys, and a CPU run that calibrates
once and then starts from the saved store."""
import dataclasses

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import profile_keys
from ebrl_jax.resources import calibration_procs
from ebrl_jax.resources import profiles
from ebrl_jax.runtime import errors


def _cfg(tmp_path, schedule='async', sm_quotas='', **resources):
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=32,
                                                    num_eval_envs=8,
                                                    num_threads=1),
                           algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                           schedule=config_lib.ScheduleConfig(name=schedule,
                                                              num_timesteps=12_800,
                                                              num_evals=2,
                                                              run_dir=str(tmp_path / 'run'),
                                                              compilation_cache_dir='',
                                                              progress_bar=False,
                                                              transport='shm',
                                                              num_groups=2),
                           resources=config_lib.ResourceConfig(plan=True,
                                                               profile_dir=str(tmp_path / 'profiles'),
                                                               use_mps=bool(sm_quotas) or
                                                               resources.pop('use_mps', False),
                                                               sm_quotas=sm_quotas,
                                                               **resources))


def _fill(cfg, sim_s, gen_s, train_s):
  """A store where every stage is linear in the batch and saturates at q_sat (samples at two sizes and at each
  default --calibration_quotas, so a run with MPS finds every quota it would calibrate)."""
  machine, workload = autoplan.machine_key(), profile_keys.workload_key(cfg)
  store = profiles.ProfileStore(machine, workload)
  for name, (per_env, q_sat) in (('sim', sim_s), ('generation', gen_s)):
    for e in (8, 32):
      for q in (25, 50, 100):
        store.profile(name).add_sample(e, q, per_env * e * max(1.0, q_sat / q))
  steps = cfg.env_steps_per_iteration
  for q in (25, 50, 100):
    store.profile('train').add_sample(steps, q, train_s[0] * max(1.0, train_s[1] / q))
    store.profile('train').add_sample(steps // 2, q, train_s[0] / 2 * max(1.0, train_s[1] / q))
  store.save(autoplan.store_path(cfg, machine, workload))


def test_plan_from_a_store_balances_rollout_and_training_quotas(tmp_path):
  # 1 group of 32 envs: a step costs 16 us (sim saturating at 20 % of the SMs; generation 0.3 us), so an
  # iteration's S = 40 steps take 0.65 ms at >= 20 %, under 1 ms for this config's S; training takes 1 ms at
  # >= 80 %. Async at rollout 20 % + trainer 80 %: both fit in 100 % and iteration = max(rollout, 1 ms) = 1 ms,
  # the best any split can do (training alone needs 80 %); 2 groups tie and lose the tie (fewer groups first).
  cfg = _cfg(tmp_path, use_mps=True)
  steps = cfg.env_steps_per_iteration // cfg.sim.num_envs
  assert steps * 16.3e-6 < 1e-3
  _fill(cfg, sim_s=(0.5e-6, 20.0), gen_s=(1e-8, 1.0), train_s=(1e-3, 80.0))
  new_cfg, record = autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert record['calibrated_s'] is None  # the store had every stage
  assert record['quotas']['trainer'] == 80 and record['quotas']['rollout'] == 20 and record['num_groups'] == 1
  assert record['predicted_iteration_s'] == pytest.approx(1e-3, rel=1e-3)
  assert new_cfg.schedule.num_groups == 1
  assert new_cfg.resources.quotas == {'rollout': 20, 'trainer': 80}
  # A pinned trainer quota stays pinned, and the rest is planned around it.
  pinned = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources, sm_quotas='trainer=50'))
  _, record = autoplan.plan_run(pinned, mps_active=True, worker_env=None)
  assert record['quotas']['trainer'] == 50 and 'pinned' in record['reason']
  # The evaluator's quota is not planned (it is off the critical path): one given stays as it was.
  given = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources, sm_quotas='evaluator=5'))
  assert autoplan.plan_run(given, mps_active=True, worker_env=None)[0].resources.quotas['evaluator'] == 5


def test_a_trainer_that_needs_every_sm_gets_a_plan_without_quotas(tmp_path):
  # Training takes 1 ms only at 100 % of the SMs (q_sat 100: 1.11 ms at 90 %, the most quotas leave it beside a
  # 10 % rollout); a step's generation costs 32 envs * 10 ns = 0.32 us on the GPU (its 1 ns of native-MuJoCo sim
  # runs on CPU cores: no GPU work). Without quotas the GPU work adds up: iteration = S * 0.32 us + 1 ms, about
  # 1.01 ms for this config's S, under the 1.11 ms of the best quota split, so the plan sets no quotas at all.
  cfg = _cfg(tmp_path, use_mps=True)
  steps = cfg.env_steps_per_iteration // cfg.sim.num_envs
  _fill(cfg, sim_s=(1e-9, 20.0), gen_s=(1e-8, 1.0), train_s=(1e-3, 100.0))
  new_cfg, record = autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert record['shared'] and record['quotas'] is None and record['num_groups'] == 1
  assert record['predicted_iteration_s'] == pytest.approx(1e-3 + steps * 32 * 10e-9, rel=1e-4)
  assert 'no quotas (SMs shared)' in record['reason'] and 'trainer 90%' in record['reason']
  assert new_cfg.resources.quotas == {} and new_cfg.resources.use_mps


def test_workload_key_changes_with_what_changes_stage_times(tmp_path):
  cfg = _cfg(tmp_path)
  bigger = dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, num_envs=64))
  epochs = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, num_updates_per_batch=8))
  seed = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, seed=7))
  keys = {profile_keys.workload_key(c) for c in (cfg, bigger, epochs)}
  assert len(keys) == 3 and profile_keys.workload_key(seed) == profile_keys.workload_key(cfg)
  # A run that sets none of the later settings keeps the key it had before they were added (stored profiles hold).
  assert profile_keys.workload_key(cfg) == (
      'task=inverted_pendulum;backend=mujoco_cpu;num_envs=32;policy=mlp:32x32x32x32/'
      '256x256x256x256x256;algo=ppo,seg=256,unroll=5,mb=8,epochs=4;repeat=1;threads=1')


def _replaced(cfg, **sections):
  return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def test_workload_key_tells_apart_the_trunk_pixels_solver_training_extras_and_grpo_episodes(tmp_path):
  cfg = _replaced(_cfg(tmp_path), sim=dict(task='push_cube'), policy=dict(kind='transformer'))
  pixels = _replaced(cfg, sim=dict(obs='pixels'))
  variants = [
      cfg,
      _replaced(cfg, policy=dict(compute_dtype='bfloat16')),
      _replaced(cfg, policy=dict(critic='mlp')),
      _replaced(cfg, policy=dict(kind='token')),
      _replaced(cfg, policy=dict(kind='token', num_bins=64)),
      _replaced(cfg, sim=dict(ls_iterations=8)),
      _replaced(cfg, sim=dict(randomize='friction=0.8:1.2')),
      _replaced(cfg, policy=dict(normalize_observations=False)),
      _replaced(cfg, algo=dict(value_norm_rate=0.05)),
      _replaced(cfg, algo=dict(max_update_kl=0.02)),
      _replaced(cfg, policy=dict(value_hidden_sizes=(64, 64))),  # state: the transformer's critic is an MLP
      _replaced(cfg, policy=dict(kind='token', num_bins=64, value_hidden_sizes=(64, 64))),
      pixels,
      _replaced(pixels, sim=dict(image_size=32)),
      _replaced(pixels, sim=dict(frame_stack=3)),
      _replaced(pixels, policy=dict(cnn_channels=(8, 16))),
      _replaced(pixels, policy=dict(vision_encoder='patches')),
  ]
  keys = [profile_keys.workload_key(c) for c in variants]
  assert len(set(keys)) == len(keys), keys
  assert keys[1].endswith(';compute_dtype=bfloat16') and keys[15].endswith(';obs=pixels;cnn_channels=8,16')
  # The MLP policy's CNN features are --d_model wide; without a camera --d_model is not read by it.
  mlp_pixels = _replaced(pixels, policy=dict(kind='mlp'))
  assert profile_keys.workload_key(_replaced(mlp_pixels, policy=dict(d_model=256))).endswith(';obs=pixels;d_model=256')
  mlp = _replaced(cfg, policy=dict(kind='mlp'))
  assert profile_keys.workload_key(_replaced(mlp, policy=dict(d_model=256))) == profile_keys.workload_key(mlp)
  # A shared critic (the trunk's value head) reads no --value_hidden_sizes.
  shared = _replaced(cfg, policy=dict(critic='shared'))
  assert profile_keys.workload_key(_replaced(
      shared, policy=dict(value_hidden_sizes=(64,)))) == (profile_keys.workload_key(shared))
  # Camera settings do not enter the key of a run without a camera (they take no effect there).
  assert profile_keys.workload_key(_replaced(cfg, sim=dict(image_size=32))) == keys[0]
  grpo = _replaced(cfg, sim=dict(group_size=4, episode_length=40), algo=dict(name='grpo'))
  longer = _replaced(grpo, sim=dict(episode_length=80))
  assert ';algo=grpo,episode=40,group=4,unroll=5,' in profile_keys.workload_key(grpo)
  assert profile_keys.workload_key(longer) != profile_keys.workload_key(grpo)  # GRPO's batch is the whole episode
  assert profile_keys.workload_key(_replaced(grpo, algo=dict(batch_size=64))) == profile_keys.workload_key(grpo)


def test_plan_needs_a_process_schedule(tmp_path):
  with pytest.raises(ValueError, match='--plan .* needs --schedule=sync or --schedule=async'):
    _cfg(tmp_path, schedule='fused')


def test_cpu_run_calibrates_once_then_starts_from_the_saved_profiles(tmp_path):
  """No MPS here: one calibration process at 100 %, groups chosen, the run completes with the plan and the
  measured rate in its summary; a second run of the same workload does not calibrate again."""
  first = controller.run(_cfg(tmp_path))
  plan = first.extra['plan']
  assert plan['calibrated_s'] > 0 and plan['calibration_quotas'] == [100] and plan['mps'] is False
  assert plan['num_groups'] in (1, 2, 4, 8) and plan['quotas'] is None
  assert plan['measured_env_steps_per_s'] == pytest.approx(first.env_steps_per_s)
  assert first.env_steps == 12_800 and first.extra['segments_duplicated'] == 0
  assert (tmp_path / 'run' / 'calibration_q100.json').exists()
  cfg2 = _cfg(tmp_path)
  cfg2 = dataclasses.replace(cfg2, schedule=dataclasses.replace(cfg2.schedule, run_dir=str(tmp_path / 'run2')))
  second = controller.run(cfg2)
  assert second.extra['plan']['calibrated_s'] is None
  assert second.extra['plan']['num_groups'] == plan['num_groups']


def test_native_mujoco_group_choices_leave_each_group_its_threads():
  # 512 envs, 3 threads per group, 2 env slices: every count in (1, 2, 4, 8) splits evenly; with 12 sim cores only
  # up to 4 groups get 3 threads each (8 x 3 = 24 > 12); one group always fits.
  cfg = config_lib.Config(sim=config_lib.SimConfig(num_envs=512, num_threads=3, num_eval_envs=4),
                          algo=config_lib.AlgoConfig(batch_size=512, num_minibatches=1),
                          schedule=config_lib.ScheduleConfig(name='async',
                                                             num_groups=4,
                                                             colocate_generation=False,
                                                             env_slices=2))
  assert autoplan.group_choices(cfg, sim_cores=12) == (1, 2, 4)
  assert autoplan.group_choices(cfg, sim_cores=2) == (1,)
  assert autoplan.group_choices(dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, num_threads=0)),
                                sim_cores=2) == (1, 2, 4, 8)


def _fake_calibration(monkeypatch, calls, sim_s, train_s):
  """Replaces the calibration processes: each quota's JSON from t_sim(E, q) = sim_s * E (per env step of E envs)
  and t_train = train_s, both at every quota (nothing slows below 100 %), generation 1 ns; records the quotas."""

  def fake(cfg, sizes, quotas, worker_env, run_dir, repeats=3, timeout_s=calibration_procs.TIMEOUT_S):
    calls.append(list(quotas))
    entry = lambda e, t: {'samples_s': [t], 'env_steps': e}  # one env step per env: t is per env step of E
    return [{
        'quota': q,
        'steps_per_iteration': cfg.env_steps_per_iteration,
        'groups': {
            str(e): {
                'sim': entry(e, sim_s * e),
                'generation': entry(e, 1e-9)
            } for e in sizes
        },
        'train': {
            'samples_s': [train_s]
        },
        'process_s': 2.0,
        'phase_s': {
            'setup': 1.0
        }
    } for q in quotas]

  monkeypatch.setattr(calibration_procs, 'calibrate_quotas', fake)


def _sync_and_auto(tmp_path, plan: bool):
  """The test config as `sync` (with --plan) and as `--schedule=auto` (with --plan if `plan`), MPS on."""
  cfg = _cfg(tmp_path, schedule='sync', use_mps=True)
  return cfg, dataclasses.replace(cfg,
                                  schedule=dataclasses.replace(cfg.schedule, name='auto'),
                                  resources=dataclasses.replace(cfg.resources, plan=plan))


def test_auto_calibrates_100_first_and_skips_the_quotas_that_cannot_win(tmp_path, monkeypatch):
  # 40 steps of 32 envs at 0.1 us per env step (0.13 ms of rollout) beside a 0.1 s train step: fused 0.1001 s, and
  # even with every process at full speed async is max(0.13 ms, 0.1 s): +0.1 %, within the margin. Only 100 % is
  # calibrated; the 50 and 25 % processes are skipped, the reason recorded, and fused chosen.
  calls = []
  _fake_calibration(monkeypatch, calls, sim_s=1e-7, train_s=0.1)
  cfg, auto_cfg = _sync_and_auto(tmp_path, plan=False)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)
  assert calls == [[100]] and chosen.schedule.name == 'fused'
  assert record['calibration_quotas'] == [100] and record['calibrated_s'] == 2.0
  assert record['calibration_process_s'] == {'100': 2.0} and record['calibration_phase_s'] == {'100': {'setup': 1.0}}
  assert record['calibration_skipped']['quotas'] == [50, 25]
  assert 'no SM quota can make it win' in record['calibration_skipped']['reason']
  # The next auto run reads the 100 % profile, skips again and calibrates nothing.
  _, again = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)
  assert calls == [[100]] and again['calibrated_s'] is None and again['calibration_skipped']['quotas'] == [50, 25]
  # --plan needs every quota: it calibrates only the two the store lacks.
  _, planned = autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert calls == [[100], [50], [25]] and planned['calibration_quotas'] == [50, 25]
  assert planned['calibration_skipped'] is None


def test_auto_calibrates_every_quota_where_a_process_schedule_may_win(tmp_path, monkeypatch):
  # 20 us per env step: 25.6 ms of rollout beside a 25 ms train step; fused 50.6 ms against async's best case of
  # max(25.6 / G, 25) ms: the quotas decide, so all three are calibrated, 100 % first.
  calls = []
  _fake_calibration(monkeypatch, calls, sim_s=20e-6, train_s=25e-3)
  cfg, auto_cfg = _sync_and_auto(tmp_path, plan=False)
  _, record = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)
  assert calls == [[100], [50], [25]] and record['calibration_quotas'] == [100, 50, 25]
  assert record['calibration_skipped'] is None and record['calibrated_s'] == 6.0
  # Without MPS there is one quota, 100 %, and nothing to skip.
  calls.clear()
  _, record = autoplan.plan_auto(dataclasses.replace(auto_cfg,
                                                     resources=dataclasses.replace(auto_cfg.resources,
                                                                                   use_mps=False,
                                                                                   profile_dir=str(tmp_path / 'p2'))),
                                 mps_active=False,
                                 worker_env=None,
                                 handoff=0.0)
  assert calls == [[100]] and record['calibration_quotas'] == [100] and record['calibration_skipped'] is None


def test_auto_choosing_fused_drops_the_process_schedules_own_flags(tmp_path, monkeypatch):
  # The same training-bound store as above: auto picks fused. With --plan given (fine with auto), the chosen
  # config used to keep it, and building it raised the fused schedule's refusal of --plan.
  calls = []
  _fake_calibration(monkeypatch, calls, sim_s=1e-7, train_s=0.1)
  cfg, auto_cfg = _sync_and_auto(tmp_path, plan=True)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)
  assert chosen.schedule.name == 'fused' and record['dropped'] == ['--plan'] and not chosen.resources.plan
  assert chosen.resources.use_mps and chosen.resources.profile_dir == cfg.resources.profile_dir


class _Clock:
  """autoplan's `time` for the budget tests (the fake calibration never reads a clock of its own): time() and monotonic() read `now`, which a fake calibration moves."""

  def __init__(self, now=1000.0):
    self.now = now

  def time(self):
    return self.now

  def monotonic(self):
    return self.now


def _timed_calibration(monkeypatch, calls, process_s, fail_at=None):
  """`_fake_calibration`'s profiles (a workload where every quota may matter), each taking `process_s` on a fake
  clock; a quota `fail_at` maps to is stopped at its timeout ('timeout') or fails ('fail'). Records
  (quotas, timeout_s) per call; returns the clock."""
  clock = _Clock()
  monkeypatch.setattr(autoplan, 'time', clock)
  inner = []
  _fake_calibration(monkeypatch, inner, sim_s=20e-6, train_s=25e-3)
  profile_of = calibration_procs.calibrate_quotas

  def fake(cfg, sizes, quotas, worker_env, run_dir, repeats=3, timeout_s=calibration_procs.TIMEOUT_S):
    calls.append((list(quotas), timeout_s))
    how = (fail_at or {}).get(quotas[0])
    if how == 'timeout':
      clock.now += timeout_s
      raise calibration_procs.CalibrationTimeout(quotas[0], timeout_s)
    if how in ('fail', 'kill'):
      raise calibration_procs.CalibrationFailed(quotas[0], 1 if how == 'fail' else -9)
    clock.now += process_s
    return [dict(p, process_s=process_s) for p in profile_of(cfg, sizes, quotas, worker_env, run_dir)]

  monkeypatch.setattr(calibration_procs, 'calibrate_quotas', fake)
  return clock


def _stored_quotas(cfg):
  path = autoplan.store_path(cfg, autoplan.machine_key(), profile_keys.workload_key(cfg))
  return autoplan.calibrated_quotas(
      profiles.ProfileStore.load(path, autoplan.machine_key(), profile_keys.workload_key(cfg)))


def test_calibration_deadline_is_the_budget_flag_else_a_third_of_max_wall_s(tmp_path):
  cfg = _cfg(tmp_path)
  with_wall = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, max_wall_s=300.0))
  assert calibration_procs.deadline(cfg, 50.0) is None  # neither set: each process's own timeout only
  assert calibration_procs.deadline(with_wall, 50.0) == pytest.approx(150.0)
  budget = dataclasses.replace(with_wall, resources=dataclasses.replace(with_wall.resources, calibration_budget_s=20))
  assert calibration_procs.deadline(budget, 50.0) == pytest.approx(70.0)
  assert calibration_procs.deadline(budget, None) is None
  with pytest.raises(ValueError, match='calibration_budget_s'):
    config_lib.ResourceConfig(calibration_budget_s=-1)


def test_auto_skips_the_quotas_the_calibration_budget_has_no_room_for(tmp_path, monkeypatch):
  # Each quota's process takes 2 s; the budget ends 5 s after the start: 100 % (ends at 2 s, 3 s left >= 2 s) and
  # 50 % (ends at 4 s, 1 s left < the 2 s it took) run, 25 % is skipped. Each process may run until the deadline.
  calls = []
  clock = _timed_calibration(monkeypatch, calls, process_s=2.0)
  _, auto_cfg = _sync_and_auto(tmp_path, plan=False)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0, deadline=clock.now + 5.0)
  assert calls == [([100], 5.0), ([50], 3.0)]
  assert record['calibration_quotas'] == [100, 50] and record['calibration_skipped']['quotas'] == [25]
  assert 'calibration budget' in record['calibration_skipped']['reason']
  assert _stored_quotas(auto_cfg) == {100, 50}
  assert chosen.schedule.name in ('fused', 'sync', 'async') and record['choice_reason']
  # The next run calibrates only what the store lacks.
  autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0, deadline=clock.now + 5.0)
  assert calls[2:] == [([25], 5.0)] and _stored_quotas(auto_cfg) == {100, 50, 25}


def test_a_calibration_stopped_by_the_budget_leaves_auto_fused_and_plan_a_clear_error(tmp_path, monkeypatch):
  calls = []
  clock = _timed_calibration(monkeypatch, calls, process_s=2.0, fail_at={100: 'timeout'})
  cfg, auto_cfg = _sync_and_auto(tmp_path, plan=True)
  budget = lambda c: dataclasses.replace(c, resources=dataclasses.replace(c.resources, calibration_budget_s=60))
  chosen, record = autoplan.plan_auto(budget(auto_cfg),
                                      mps_active=True,
                                      worker_env=None,
                                      handoff=0.0,
                                      deadline=clock.now + 60.0)
  assert calls == [([100], 60.0)]  # killed at the deadline, not after its own 900 s
  assert chosen.schedule.name == 'fused' and not chosen.resources.plan and record['schedule'] == 'fused'
  assert record['calibration_quotas'] == [] and record['calibration_skipped']['quotas'] == [100, 50, 25]
  assert '--calibration_budget_s=60' in record['choice_reason'] and record['calibration_budget_s'] == 60
  with pytest.raises(errors.RunError, match='no stage profile could be calibrated .*calibration budget'):
    autoplan.plan_run(budget(cfg), mps_active=True, worker_env=None, deadline=clock.now + 60.0)
  # Without a budget a process that hangs past its own timeout is an error, as before.
  with pytest.raises(calibration_procs.CalibrationTimeout, match='did not finish in 900 s'):
    autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)


def test_each_calibrated_quota_is_saved_and_a_failed_process_skips_the_rest(tmp_path, monkeypatch):
  # The 50 % process fails: 100 % is kept, 50 and 25 % are skipped with the failure as the reason, and --plan goes
  # on from what it has; the next run calibrates the two again.
  calls = []
  _timed_calibration(monkeypatch, calls, process_s=2.0, fail_at={50: 'fail'})
  cfg, _ = _sync_and_auto(tmp_path, plan=True)
  _, record = autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert _stored_quotas(cfg) == {100} and record['calibration_quotas'] == [100]
  assert record['calibration_skipped'] == {
      'quotas': [50, 25],
      'reason': 'stage calibration at SM quota 50 % failed (exit code 1); see its log above'
  }
  calls.clear()
  _timed_calibration(monkeypatch, calls, process_s=2.0)
  autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert [q for q, _ in calls] == [[50], [25]] and _stored_quotas(cfg) == {100, 50, 25}


def test_a_killed_first_calibration_leaves_auto_fused_and_plan_one_fatal_error(tmp_path, monkeypatch):
  # The 100 % process is killed (SIGKILL, e.g. the kernel's OOM killer): auto runs fused saying so; --plan, with
  # nothing to plan from, stops with a RunError (main prints it as one FATAL line) naming the signal.
  _timed_calibration(monkeypatch, [], process_s=2.0, fail_at={100: 'kill'})
  cfg, auto_cfg = _sync_and_auto(tmp_path, plan=False)
  chosen, record = autoplan.plan_auto(auto_cfg, mps_active=True, worker_env=None, handoff=0.0)
  assert chosen.schedule.name == 'fused' and 'killed by SIGKILL' in record['choice_reason']
  with pytest.raises(errors.RunError,
                     match=r'no stage profile could be calibrated \(stage calibration at SM quota '
                     r'100 % failed \(killed by SIGKILL\)'):
    autoplan.plan_run(cfg, mps_active=True, worker_env=None)
  assert str(calibration_procs.CalibrationFailed(25, 3)).startswith('stage calibration at SM quota 25 % failed (exit')
