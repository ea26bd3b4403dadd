"""The benchmark harness itself: `--quick` on the CPU writes a JSON whose every figure is present and sane, and
the report tool reads it, and rejects malformed files naming the file and the field."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def quick_result(tmp_path_factory):
  out = tmp_path_factory.mktemp('bench') / 'quick.json'
  proc = subprocess.run([
      sys.executable, '-m', 'experiments.bench.run', '--quick', '--schedules=fused,async', '--seeds=0', f'--out={out}'
  ],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return out, json.load(open(out))


def _with_second_seed(result):
  """The quick invocation runs one seed (CI time: each run is ~40 s on the 2-core machine): the same result with a
  second seed made from the first (its command says --seed=1, its end-to-end rate is 1.25x), the figures and
  ratios recomputed by the harness's own functions as an invocation of both seeds computes them."""
  from experiments.bench import run as bench_run
  runs = {}
  for label, seeds in result['runs'].items():
    twin = copy.deepcopy(seeds[0])
    twin['command'] = twin['command'].replace('--seed=0', '--seed=1')
    twin['summary']['env_steps_per_s'] *= 1.25
    runs[label] = [seeds[0], twin]
  figures = bench_run.aggregate(runs)
  return dict(result,
              seeds=result['seeds'] + ['1'],
              runs=runs,
              figures=figures,
              ratios_vs_fused=bench_run.ratios(figures, 'fused', runs))


def test_quick_bench_reports_every_figure(quick_result):
  _, one_seed = quick_result
  assert one_seed['quick'] and one_seed['commit'] and one_seed['machine']['cpu_count'] >= 1
  assert one_seed['seeds'] == ['0'] and one_seed['figures']['fused']['seeds_finished'] == 1
  assert one_seed['figures']['async']['env_steps_per_s'] == pytest.approx(
      one_seed['runs']['async'][0]['summary']['env_steps_per_s'])
  assert set(one_seed['runs']) == {'fused', 'async'}
  for schedule, seeds in one_seed['runs'].items():
    assert len(seeds) == 1
    for run in seeds:
      s = run['summary']
      # The quick flags: 6400 steps in whole iterations of 16 x 4 segments x 5 steps = 320 steps.
      assert s['env_steps'] == 6400
      for name in ('env_steps_per_s', 'compile_s', 'wall_s', 'train_wall_s'):
        assert math.isfinite(s[name]) and s[name] > 0, (schedule, name, s[name])
      assert s['schedule'] == schedule
      # The quickstart's target (1000) is out of reach in 6400 steps: the field is there, empty.
      assert 'env_steps_to_target' in s and s['target_return'] == 1000
      assert s['env_steps_to_target'] is None or s['env_steps_to_target'] <= s['env_steps']
      assert run['gpm']['sm_activity_pct'] is None and 'NVML' in run['gpm']['reason'] or run['gpm']['samples']
  result = _with_second_seed(one_seed)  # the figures over two seeds: means, sample sd, ratios
  figures = result['figures']
  for schedule in ('fused', 'async'):
    f = figures[schedule]
    assert f['seeds_finished'] == 2
    per_seed = [r['summary']['env_steps_per_s'] for r in result['runs'][schedule]]
    assert f['env_steps_per_s'] == pytest.approx(sum(per_seed) / 2)
    sd = (sum((x - f['env_steps_per_s'])**2 for x in per_seed))**0.5  # sample sd of two values
    assert f['env_steps_per_s_sd'] == pytest.approx(sd) and f['env_steps_per_s_seeds'] == 2
    assert not f['env_steps_per_s_counts_first_iteration']
    assert f['quota_changes'] == 0 and f['quota_change_env_steps_lost'] is None
  # Rollout throughput: reported by the process schedules (not by fused, whose collection is inside one program);
  # each group's rate is its segments' env steps over its seconds in collect, and collecting alone is faster than
  # collecting and training end to end.
  assert figures['fused']['rollout_env_steps_per_s'] is None
  for run in one_seed['runs']['async']:  # the first iteration is start-up, kept beside the rate
    assert run['summary']['extra']['startup_s'] > 0
  for runs in one_seed['runs'].values():  # each run's whole output beside it, to its controller's last line
    for run in runs:
      with open(run['log']) as f:
        assert 'telemetry means:' in f.read()
  for run in one_seed['runs']['async']:
    rollout = run['summary']['extra']['rollout']
    rates = rollout['group_env_steps_per_s']
    assert sorted(rates) == ['rollout/0', 'rollout/1'] and all(r > 0 for r in rates.values())
    assert rollout['env_steps_per_s'] == pytest.approx(sum(rates.values()))
    assert rollout['segments'] >= 6400 // (16 * 4 * 5) * 2  # 20 iterations x 2 groups, at least
    assert rollout['env_steps_per_s'] > run['summary']['env_steps_per_s']
  assert figures['async']['rollout_env_steps_per_s'] == pytest.approx(
      sum(r['summary']['extra']['rollout']['env_steps_per_s'] for r in result['runs']['async']) / 2)
  ratios = result['ratios_vs_fused']
  assert ratios['fused']['env_steps_per_s'] == pytest.approx(1.0)
  assert ratios['async']['env_steps_per_s'] == pytest.approx(figures['async']['env_steps_per_s'] /
                                                             figures['fused']['env_steps_per_s'])


def test_report_reads_the_quick_result(quick_result):
  path, _ = quick_result
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench.report', str(path)],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr
  assert '| quick.json | fused | 1 |' in proc.stdout and '| quick.json | async | 1 |' in proc.stdout
  assert os.path.getsize(os.path.splitext(str(path))[0] + '.png') > 10_000


@pytest.mark.parametrize('content,message', [
    ('{not json', 'cannot read it as JSON'),
    ('[1, 2]', 'the top level must be an object'),
    ('{"foo": 1}', 'no field "runs"'),
    ('{"runs": {"fused": [{"summary": {"env_steps": 1, "env_steps_per_s": 2.0}}]}}',
     'fused seed #0: missing field "eval_curve"'),
    ('{"runs": {"fused": [{"summary": {"env_steps": 1, "env_steps_per_s": 2.0, '
     '"eval_curve": [{"env_steps": 0, "wall_s": 1.0}]}}]}}', 'an eval_curve point has no finite "return"'),
    ('{"runs": {"fused": [{"oops": 1}]}}', 'runs.fused[0] has neither "summary" nor "error_tail"'),
])
def test_report_names_the_file_and_field_of_a_bad_result(tmp_path, content, message):
  path = tmp_path / 'bad.json'
  path.write_text(content)
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench.report', str(path)],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2
  assert str(path) in proc.stderr and message in proc.stderr, proc.stderr


def test_labels_brax_and_stage_profile_in_one_quick_invocation(tmp_path):
  """A relabelled schedule with its own flag, Brax's PPO as a schedule, and the isolated stage profile whose
  ceiling gives each label's overlap efficiency."""
  out = tmp_path / 'labels.json'
  proc = subprocess.run([
      sys.executable, '-m', 'experiments.bench.run', '--quick', '--schedules=sync,a2=async,brax',
      '--only=a2:--max_staleness=2', '--only=brax:--backend=mjx', '--seeds=0', '--stage_profile', f'--out={out}'
  ],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.load(open(out))
  assert result['labels']['a2'] == {'schedule': 'async', 'flags': ['--max_staleness=2'], 'time_limit_s': 3600}
  assert '--max_staleness=2' in result['runs']['a2'][0]['command']
  assert '--max_staleness=2' not in result['runs']['sync'][0]['command']
  assert result['runs']['a2'][0]['summary']['schedule'] == 'async'
  brax = result['runs']['brax'][0]['summary']
  assert brax['schedule'] == 'brax' and brax['env_steps'] == 6400 and brax['env_steps_per_s'] > 0
  assert brax['eval_curve'][0]['env_steps'] == 0 and len(brax['eval_curve']) >= 2
  # On the harness's clock: from process start, with the start-up parts adding up to compile_s.
  assert brax['start_unix'] >= result['runs']['brax'][0]['start_unix'] - 1.0
  assert sum(brax['compile_breakdown'].values()) == pytest.approx(brax['compile_s'], abs=1e-2)
  assert brax['compile_breakdown']['imports'] > 0 and brax['eval_curve'][-1]['wall_s'] <= brax['wall_s']
  profile = result['stage_profile']
  assert sorted(profile['groups']) == ['16', '8']  # all envs (fused, brax) and one of 2 groups (sync, async)
  for e, g in profile['groups'].items():
    t = [g['sim']['per_env_step_s'], g['generation']['per_env_step_s'], profile['train']['per_env_step_s']]
    assert all(math.isfinite(x) and x > 0 for x in t)
    assert g['overlap_ceiling_steps_per_s'] == pytest.approx(1 / max(t))
    assert g['sequential_floor_steps_per_s'] == pytest.approx(1 / sum(t))
  from experiments.bench import run as bench_run
  for label in ('sync', 'a2', 'brax'):
    o = result['overlap'][label]
    assert o['envs_per_call'] == 16
    assert o['ceiling_steps_per_s'] == pytest.approx(bench_run.stage_bounds(profile)['ceiling_steps_per_s'])
    assert o['ceiling_steps_per_s'] >= profile['groups']['16']['overlap_ceiling_steps_per_s']
    assert o['overlap_efficiency'] == pytest.approx(result['figures'][label]['env_steps_per_s'] /
                                                    o['ceiling_steps_per_s'])


def _profile(backend, sim_us, threads):
  """A stage profile by hand: per size, sim µs per env step and its threads; generation 2 µs, training 10 µs."""
  return {
      'backend': backend,
      'train': {
          'per_env_step_s': 10e-6
      },
      'groups': {
          str(e): {
              'sim': {
                  'per_env_step_s': sim_us[e] * 1e-6
              },
              'generation': {
                  'per_env_step_s': 2e-6
              },
              'sim_threads': threads[e]
          } for e in sim_us
      }
  }


def test_overlap_bounds_by_hand():
  """Native MuJoCo: 4 groups of 128 envs on 3 threads each (36 µs per env step alone) step at once in 12 threads,
  9 µs per env step, faster than one 512-env call on 12 threads (21 µs): ceiling 1 / max(9, 2, 10) µs, floor
  1 / 21 µs. On MJX, or where the groups' threads do not fit in the whole batch's, the one call's 21 µs stands."""
  from experiments.bench import run as bench_run
  cpu = bench_run.stage_bounds(_profile('mujoco_cpu', {128: 36, 512: 21}, {128: 3, 512: 12}))
  assert cpu['sim_groups'] == 4 and cpu['sim_per_env_step_s'] == pytest.approx(9e-6)
  assert cpu['ceiling_steps_per_s'] == pytest.approx(1e5)
  assert cpu['sequential_floor_steps_per_s'] == pytest.approx(1 / 21e-6)
  for profile in (_profile('mjx', {
      128: 36,
      512: 21
  }, {
      128: None,
      512: None
  }), _profile('mujoco_cpu', {
      128: 36,
      512: 21
  }, {
      128: 6,
      512: 12
  })):  # 4 x 6 threads > 12
    b = bench_run.stage_bounds(profile)
    assert b['sim_groups'] == 1 and b['ceiling_steps_per_s'] == pytest.approx(1 / 21e-6)
    assert b['sequential_floor_steps_per_s'] == pytest.approx(1 / 33e-6)
  slow_groups = bench_run.stage_bounds(_profile('mujoco_cpu', {128: 100, 512: 21}, {128: 3, 512: 12}))
  assert slow_groups['sim_groups'] == 1  # 100 / 4 = 25 µs: the one call is faster
  effs = bench_run.overlap_efficiency({
      'async': {
          'env_steps_per_s': 5e4
      },
      'sync': {
          'env_steps_per_s': None
      }
  }, [('async', 'async', ()), ('sync', 'sync', ())], _profile('mujoco_cpu', {
      128: 36,
      512: 21
  }, {
      128: 3,
      512: 12
  }))
  assert effs['async']['overlap_efficiency'] == pytest.approx(0.5)
  assert effs['async']['vs_sequential_floor'] == pytest.approx(5e4 * 21e-6)
  assert effs['sync']['overlap_efficiency'] is None


def test_a_newer_stage_profile_replaces_a_results_and_its_overlap(quick_result, tmp_path):
  """--merge with --stage_profile_from: a bare profile of the same env batch sizes replaces the result's and the
  overlap figures follow it; other sizes, or a file that is neither, are refused by name."""
  from experiments.bench import run as bench_run
  _, result = quick_result
  assert 'stage_profile' not in result  # run without one: any sizes are taken, later ones must match them
  sizes = [8, 16]
  bare = _profile('mujoco_cpu', {e: 50.0 for e in sizes}, {e: 1 for e in sizes})
  (tmp_path / 'bare.json').write_text(json.dumps(bare))
  out = bench_run.with_profile(result, str(tmp_path / 'bare.json'))
  assert out['stage_profile']['taken_from'] == 'bare.json'
  label = next(iter(result['labels']))
  assert out['overlap'][label]['ceiling_steps_per_s'] == pytest.approx(1 / 50e-6)
  assert out['overlap'][label]['overlap_efficiency'] == pytest.approx(result['figures'][label]['env_steps_per_s'] *
                                                                      50e-6)
  other = _profile('mujoco_cpu', {e * 2: 50.0 for e in sizes}, {e * 2: 1 for e in sizes})
  (tmp_path / 'other.json').write_text(json.dumps(other))
  with pytest.raises(ValueError, match='other.json profiles env batches of 16, 32, the result.s runs use 8, 16'):
    bench_run.with_profile(out, str(tmp_path / 'other.json'))
  (tmp_path / 'neither.json').write_text('{"runs": {}}')
  with pytest.raises(ValueError, match='neither.json is neither a result'):
    bench_run.with_profile(result, str(tmp_path / 'neither.json'))


def test_schedule_labels_and_only_flags_are_checked():
  from experiments.bench import run as bench_run
  assert bench_run.parse_schedules(['fused', 'q=async'], ['q:--use_mps']) == [('fused', 'fused', ()),
                                                                              ('q', 'async', ('--use_mps',))]
  with pytest.raises(ValueError, match="schedule 'nope' is not one of"):
    bench_run.parse_schedules(['x=nope'], [])
  with pytest.raises(ValueError, match='used twice'):
    bench_run.parse_schedules(['async', 'async'], [])
  with pytest.raises(ValueError, match="no schedule labelled 'sync'"):
    bench_run.parse_schedules(['async'], ['sync:--use_mps'])
  with pytest.raises(ValueError, match='must be label:--flag'):
    bench_run.parse_schedules(['async'], ['async'])


def test_runs_go_label_by_label_or_round_by_round():
  from experiments.bench import run as bench_run
  labels = [('fused', 'fused', ()), ('q', 'async', ('--use_mps',))]
  by_label = [(j.label, j.seed) for j in bench_run.job_order(labels, ['0', '1'], 'labels')]
  assert by_label == [('fused', '0'), ('fused', '1'), ('q', '0'), ('q', '1')]
  rounds = bench_run.job_order(labels, ['0', '1'], 'rounds')
  assert [(j.label, j.seed) for j in rounds] == [('fused', '0'), ('q', '0'), ('fused', '1'), ('q', '1')]
  assert rounds[1] == bench_run.Job('q', 'async', '0', ('--use_mps',))
  with pytest.raises(ValueError, match='must be labels or rounds'):
    bench_run.job_order(labels, ['0'], 'random')


def test_label_time_limits_and_environments_are_checked_and_default_to_timeout_s():
  from experiments.bench import run as bench_run
  labels = bench_run.parse_schedules(['fused', 'auto'], [])
  assert bench_run.parse_label_timeouts(['auto:400'], labels, 300) == {'fused': 300, 'auto': 400}
  with pytest.raises(ValueError, match="label_timeout_s='sync:5' must be label:seconds with a label"):
    bench_run.parse_label_timeouts(['sync:5'], labels, 300)
  with pytest.raises(ValueError, match='seconds must be a positive integer'):
    bench_run.parse_label_timeouts(['auto:soon'], labels, 300)
  assert bench_run.parse_label_env(['auto:XLA_FLAGS=--a=1 --b', 'auto:X=', 'fused:Y=2'], labels) == {
      'fused': {
          'Y': '2'
      },
      'auto': {
          'XLA_FLAGS': '--a=1 --b',
          'X': ''
      }
  }
  for bad in ('sync:X=1', 'auto:X', 'auto:=1', 'auto:1X=2', 'X=1'):
    with pytest.raises(ValueError, match='must be label:NAME=VALUE'):
      bench_run.parse_label_env([bad], labels)


def test_a_stopped_runs_summary_is_taken_and_a_stale_one_is_not(tmp_path):
  from experiments.bench import run as bench_run
  path = str(tmp_path / 'summary.json')
  assert bench_run.take_summary(path, 0, 100.0) is None  # nothing written
  stopped = {'start_unix': 101.0, 'stopped': 'SIGTERM', 'eval_curve': [{'env_steps': 8}]}
  with open(path, 'w') as f:
    json.dump(stopped, f)
  assert bench_run.take_summary(path, 143, 100.0) == stopped  # stopped at the time limit, partial curve kept
  assert bench_run.take_summary(path, 143, 200.0) is None  # written by an earlier attempt in the same directory
  assert bench_run.take_summary(path, 1, 100.0) is None  # a failure is a failure, whatever the directory holds
  with open(path, 'w') as f:
    json.dump(dict(stopped, stopped='num_timesteps'), f)
  assert bench_run.take_summary(path, 143, 100.0) is None  # killed after it finished: not a stopped run's record
  assert bench_run.take_summary(path, 0, 100.0)['stopped'] == 'num_timesteps'


def test_brax_start_up_is_on_our_clock_by_hand():
  """Brax's curve: step-0 evaluation ends at 30 s of the process clock; epochs take 12, 4, 5 and 4 s of Brax's
  training time (the first compiles): start-up is 30 + (12 - 4) s, the rate counts 25 - 8 s of training."""
  from experiments.bench import brax_ppo
  curve = [{'wall_s': 30.0, 'walltime': 0.0}] + [{'wall_s': 30.0 + w, 'walltime': w} for w in (12., 16., 21., 25.)]
  split = brax_ppo.startup_split(curve, imports_s=6.0, env_build_s=1.5)
  assert split['compile_s'] == pytest.approx(38.0)
  assert split['compile_breakdown'] == {'imports': 6.0, 'env_build': 1.5, 'init_and_first_eval': 22.5, 'compile': 8.0}
  assert sum(split['compile_breakdown'].values()) == pytest.approx(split['compile_s'])
  assert split['train_wall_s'] == pytest.approx(17.0) and not split['train_compile_in_rate']
  one = brax_ppo.startup_split(curve[:2], imports_s=6.0, env_build_s=1.5)  # one epoch: its compile stays in
  assert one['compile_s'] == 30.0 and one['train_wall_s'] == 12.0 and one['train_compile_in_rate']


def test_brax_refuses_what_its_trainer_cannot_run():
  from ebrl_jax import config as config_lib
  from experiments.bench import brax_ppo
  cfg = config_lib.Config(policy=config_lib.PolicyConfig(kind='transformer'),
                          sim=config_lib.SimConfig(backend='mujoco_cpu'))
  with pytest.raises(ValueError, match='--policy=transformer.*--backend=mujoco_cpu'):
    brax_ppo.check_supported(cfg)
  randomized = config_lib.Config(sim=config_lib.SimConfig(backend='mjx', randomize='friction=0.5:1.5'))
  with pytest.raises(ValueError, match='--randomize'):
    brax_ppo.check_supported(randomized)
  capped = config_lib.Config(sim=config_lib.SimConfig(backend='mjx', ls_iterations=8))
  with pytest.raises(ValueError, match='--ls_iterations'):
    brax_ppo.check_supported(capped)
  for backend in ('mjx', 'mjx_warp'):  # Brax's own MJX env, and the same env on MJX-Warp
    brax_ppo.check_supported(config_lib.Config(sim=config_lib.SimConfig(backend=backend)))


def test_brax_ends_at_the_evaluation_after_a_held_sigterm():
  """The harness's time limit (SIGTERM) reaches Brax's trainer while its epoch runs: held, it ends the run at the
  next evaluation, which stays in the curve, so the summary is written with `stopped` naming the signal."""
  import signal
  from ebrl_jax.runtime import errors
  from experiments.bench import brax_ppo
  curve = []
  progress = brax_ppo.progress_recorder(curve, start_unix=0.0, target=3000.0)
  with errors.deferred_stops():
    progress(0, {'eval/episode_reward': -5.0})
    os.kill(os.getpid(), signal.SIGTERM)  # held: no KeyboardInterrupt here
    with pytest.raises(brax_ppo._Stopped, match='SIGTERM'):  # pylint: disable=protected-access
      progress(1000, {'eval/episode_reward': 10.0})
  assert [c['return'] for c in curve] == [-5.0, 10.0]
  with pytest.raises(brax_ppo._TargetReached):  # pylint: disable=protected-access
    brax_ppo.progress_recorder([], 0.0, 3000.0)(2000, {'eval/episode_reward': 3001.0})


def test_brax_on_warp_batches_the_very_env_our_warp_runs_step(monkeypatch):
  """Brax's PPO on --backend=mjx_warp: the env it trains is the unbatched env under our mjx_warp chain, and its
  wrap_env_fn hands back that chain (Warp-aware vmap and auto-reset), refusing any other env. Builds the Warp env
  on Warp's CPU kernels (no physics runs)."""
  pytest.importorskip('warp')
  from ebrl_jax.sim import mjx_env
  from experiments.bench import brax_ppo
  monkeypatch.setenv('EBRL_WARP_ALLOW_CPU', '1')
  env, wrap = brax_ppo.warp_env('ant', 1000, 1)
  ours = mjx_env.make_mjx_env('ant', 1000, 1, impl='warp')
  assert env is ours.unwrapped and mjx_env.env_impl(env) == 'warp'
  assert wrap(env, episode_length=1000, action_repeat=1) is ours
  assert isinstance(ours, mjx_env.WhereAutoResetWrapper)
  with pytest.raises(ValueError, match='not the Warp env'):
    wrap(mjx_env.make_mjx_env('ant', 1000, 1).unwrapped, episode_length=1000, action_repeat=1)
  with pytest.raises(ValueError, match='randomization_fn'):
    wrap(env, episode_length=1000, action_repeat=1, randomization_fn=lambda sys, rng: (sys, sys))


def test_merging_seed_files_gives_the_figures_of_one_invocation(quick_result, tmp_path):
  from experiments.bench import run as bench_run
  result = _with_second_seed(quick_result[1])
  parts = []
  for i, seed in enumerate(result['seeds']):
    part = dict(result, seeds=[seed], runs={k: [v[i]] for k, v in result['runs'].items()})
    parts.append(tmp_path / f'part{seed}.json')
    parts[-1].write_text(json.dumps(part))
  merged = bench_run.merge([str(p) for p in parts])
  assert merged['seeds'] == result['seeds']
  for label, f in result['figures'].items():
    assert merged['figures'][label]['env_steps_per_s'] == pytest.approx(f['env_steps_per_s'])
  other = dict(result, extra_flags=['--num_groups=4'])
  (tmp_path / 'other.json').write_text(json.dumps(other))
  with pytest.raises(ValueError, match='other.json has extra_flags='):
    bench_run.merge([str(parts[0]), str(tmp_path / 'other.json')])
  # Labels run in separate invocations: the union, each label's figures its own; a label whose flags differ
  # between the files is refused by name.
  only_async = dict(result, labels={'async': result['labels']['async']}, runs={'async': result['runs']['async']})
  only_fused = dict(result, labels={'fused': result['labels']['fused']}, runs={'fused': result['runs']['fused']})
  (tmp_path / 'a.json').write_text(json.dumps(only_fused))
  (tmp_path / 'b.json').write_text(json.dumps(only_async))
  joined = bench_run.merge([str(tmp_path / 'a.json'), str(tmp_path / 'b.json')])
  assert list(joined['labels']) == ['fused', 'async']
  assert joined['ratios_vs_fused']['async']['env_steps_per_s'] == pytest.approx(
      result['ratios_vs_fused']['async']['env_steps_per_s'])
  clash = dict(only_async, labels={'async': dict(result['labels']['async'], flags=['--use_mps'])})
  (tmp_path / 'c.json').write_text(json.dumps(clash))
  with pytest.raises(ValueError, match=r'c.json has labels.async='):
    bench_run.merge([str(tmp_path / 'b.json'), str(tmp_path / 'c.json')])


def test_a_rerun_replaces_its_failed_attempt_when_merged(quick_result, tmp_path):
  """A seed stopped by its time limit and run again in a later invocation: the finished rerun takes the failed
  attempt's place (recorded under `replaced`, carried through a second merge); the same seed finished twice is
  refused by name; a failed rerun of a finished seed leaves it alone."""
  from experiments.bench import run as bench_run
  _, result = quick_result
  label = next(iter(result['runs']))
  good = result['runs'][label][0]
  seed = bench_run.run_seed(good)
  assert seed == result['seeds'][0]
  cut = {k: v for k, v in good.items() if k != 'summary'}
  cut.update(returncode=-15, error_tail='...\n[bench] stopped after --timeout_s=285')
  first = dict(result, runs=dict(result['runs'], **{label: [cut] + result['runs'][label][1:]}))
  rerun = dict(result, seeds=[seed], runs={label: [good]}, labels={label: result['labels'][label]})
  (tmp_path / 'first.json').write_text(json.dumps(first))
  (tmp_path / 'rerun.json').write_text(json.dumps(rerun))
  merged = bench_run.merge([str(tmp_path / 'first.json'), str(tmp_path / 'rerun.json')])
  assert merged['runs'][label] == result['runs'][label]  # the rerun in the failed attempt's place
  assert merged['figures'][label]['seeds_finished'] == len(result['seeds'])
  assert merged['replaced'] == [{
      'label': label,
      'seed': seed,
      'by_file': 'rerun.json',
      'returncode': -15,
      'why': '[bench] stopped after --timeout_s=285'
  }]
  (tmp_path / 'merged.json').write_text(json.dumps(merged))
  failed_again = dict(rerun, runs={label: [cut]})
  (tmp_path / 'again.json').write_text(json.dumps(failed_again))
  twice = bench_run.merge([str(tmp_path / 'merged.json'), str(tmp_path / 'again.json')])
  assert twice['runs'][label] == result['runs'][label] and twice['replaced'] == merged['replaced']
  assert [p['file'] for p in twice['merged_from']] == ['first.json', 'rerun.json', 'again.json']
  with pytest.raises(ValueError, match=f'rerun.json has {label} seed {seed} finished, and so does a run merged before'):
    bench_run.merge([str(tmp_path / 'merged.json'), str(tmp_path / 'rerun.json')])


def test_report_plots_sm_activity_and_a_stage_timeline(tmp_path):
  """The telemetry and trace plots from small synthetic files; a trace without spans is refused by name."""
  result = {
      'runs': {
          'async': [
              {
                  'gpu': '0',
                  'start_unix': 100.0,
                  'end_unix': 103.0,
                  'gpm': {
                      'sm_activity_pct': 40.0
                  },
                  'summary': {
                      'env_steps': 10,
                      'env_steps_per_s': 5.0,
                      'eval_curve': [{
                          'env_steps': 0,
                          'wall_s': 1.0,
                          'return': 1.0
                      }]
                  }
              },
              # a run stopped by its time limit: on the timeline, not in the means
              {
                  'gpu': '0',
                  'start_unix': 103.0,
                  'end_unix': 104.0,
                  'gpm': {
                      'sm_activity_pct': 90.0
                  },
                  'error_tail': '[bench] stopped after --timeout_s=1'
              }
          ]
      }
  }
  (tmp_path / 'r.json').write_text(json.dumps(result))
  tel = tmp_path / 'telemetry_gpu0.jsonl'
  tel.write_text(''.join(
      json.dumps({
          't': 99.0 + 0.1 * i,
          'sm_activity_pct': i % 50,
          'sm_occupancy_pct': 5
      }) + '\n' for i in range(60)))
  trace = {
      'traceEvents': [{
          'name': 'process_name',
          'ph': 'M',
          'pid': 1,
          'args': {
              'name': 'trainer'
          }
      }, {
          'name': 'train/train_step',
          'ph': 'X',
          'pid': 1,
          'ts': 0,
          'dur': 500_000
      }, {
          'name': 'rollout/collect',
          'ph': 'X',
          'pid': 2,
          'ts': 100_000,
          'dur': 2_000_000
      }]
  }
  (tmp_path / 'trace.json').write_text(json.dumps(trace))
  proc = subprocess.run([
      sys.executable, '-m', 'experiments.bench.report',
      str(tmp_path / 'r.json'), '--telemetry',
      str(tel), '--trace',
      str(tmp_path / 'trace.json')
  ],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr
  assert '| 40.0 |' in proc.stdout  # the finished run's SM activity in the table
  for name in ('r_sm.png', 'trace_timeline.png'):
    assert os.path.getsize(tmp_path / name) > 5_000
  (tmp_path / 'empty_trace.json').write_text(json.dumps({'traceEvents': trace['traceEvents'][:1]}))
  proc = subprocess.run([
      sys.executable, '-m', 'experiments.bench.report',
      str(tmp_path / 'r.json'), '--trace',
      str(tmp_path / 'empty_trace.json')
  ],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2 and 'empty_trace.json: no complete ("X") span events' in proc.stderr


def test_planner_prediction_from_the_kept_w2_results(tmp_path):
  out = tmp_path / 'plan.json'
  proc = subprocess.run([sys.executable, 'experiments/plan_from_results.py', f'--out={out}'],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr
  plans = json.load(open(out))['plans']
  for schedule, p in plans.items():
    assert p['predicted_env_steps_per_s'] > 0 and sum(
        p['quotas'].values()) <= (100 + (p['num_groups'] - 1) * p['quotas']['rollout'] if schedule == 'async' else 200)
  # The kept profiles make W2 training-bound: the trainer gets the larger share in either schedule.
  assert all(p['quotas']['trainer'] > p['quotas']['rollout'] for p in plans.values())


def test_steady_pace_is_taken_between_the_second_and_the_last_evaluation():
  from experiments.bench.figures import steady_env_steps_per_s
  curve = [
      {
          'env_steps': 0,
          'wall_s': 40.0,
          'return': 1.0
      },  # after a long start-up
      {
          'env_steps': 1000,
          'wall_s': 50.0,
          'return': 1.0
      },
      {
          'env_steps': 2000,
          'wall_s': 55.0,
          'return': 1.0
      },
      {
          'env_steps': 4000,
          'wall_s': 70.0,
          'return': 1.0
      }
  ]
  assert steady_env_steps_per_s({'eval_curve': curve}) == pytest.approx(3000 / 20.0)
  assert steady_env_steps_per_s({'eval_curve': curve[:2]}) is None


def test_steady_pace_runs_between_the_versions_reached_not_their_evaluations_ends():
  """An evaluator process that lags at the second evaluated version (its compile) ends it late: the pace runs from
  when training reached each version, as the curve records it (`reached_s`); its SM window too."""
  from experiments.bench import figures
  curve = [
      {
          'env_steps': 0,
          'wall_s': 40.0,
          'reached_s': 40.0
      },
      {
          'env_steps': 1000,
          'wall_s': 65.0,
          'reached_s': 50.0
      },  # 15 s late
      {
          'env_steps': 4000,
          'wall_s': 71.0,
          'reached_s': 70.0
      }
  ]
  assert figures.steady_env_steps_per_s({'eval_curve': curve}) == pytest.approx(3000 / 20.0)  # not 3000 / 6
  exact = [dict(p, unix=2000.0 + p['wall_s']) for p in curve]
  assert figures.steady_window({'summary': {'eval_curve': exact}}) == (2050.0, 2070.0, 'exact')
  kept = {'end_unix': 1072.0, 'summary': {'wall_s': 72.0, 'eval_curve': curve}}  # its clock started at 1000
  assert figures.steady_window(kept) == (1050.0, 1070.0, 'end-anchored')


def test_end_to_end_is_not_averaged_across_its_two_definitions():
  from experiments.bench import figures
  old = {'env_steps_per_s': 70.0, 'extra': {'segments_consumed': 8}}  # a process run kept before 29df545
  new = [{
      'env_steps_per_s': 80.0,
      'extra': {
          'segments_consumed': 8,
          'startup_s': 3.0
      }
  }, {
      'env_steps_per_s': 90.0,
      'extra': {
          'segments_consumed': 8,
          'startup_s': 1.0
      }
  }]
  fused = {'env_steps_per_s': 100.0, 'extra': {}}  # compiles ahead: one definition throughout
  assert figures.counts_first_iteration(old) and not figures.counts_first_iteration(new[0])
  assert not figures.counts_first_iteration(fused)
  mixed = figures.end_to_end([old] + new)
  assert mixed['mean'] == pytest.approx(85.0) and mixed['seeds'] == 2 and not mixed['counts_first_iteration']
  assert mixed['sd'] == pytest.approx(50**0.5)
  only_old = figures.end_to_end([old])
  assert only_old == {'mean': 70.0, 'sd': None, 'seeds': 1, 'counts_first_iteration': True}
  assert figures.end_to_end([])['mean'] is None
  curve = [{'env_steps': 0, 'wall_s': 5.0}, {'env_steps': 100, 'wall_s': 10.0}, {'env_steps': 300, 'wall_s': 12.0}]
  pace = figures.steady([dict(old, eval_curve=curve), dict(new[0], eval_curve=curve[:2])])
  assert pace == {'mean': 100.0, 'sd': None, 'seeds': 1}


def test_steady_sm_activity_over_the_steady_window(tmp_path):
  """SM activity over the second-to-last-evaluation window: exact where the evaluations carry Unix times,
  placed from the process's end time where a kept run's do not; kept runs get it from the telemetry log of
  their GPU when merged, and the report shows it."""
  from experiments.bench import figures
  from experiments.bench import report
  from experiments.bench import run as bench_run
  curve = [{
      'env_steps': 0,
      'wall_s': 5.0,
      'return': 1.0
  }, {
      'env_steps': 100,
      'wall_s': 10.0,
      'return': 2.0
  }, {
      'env_steps': 300,
      'wall_s': 20.0,
      'return': 3.0
  }]
  kept = {
      'gpu': '0',
      'start_unix': 990.0,
      'end_unix': 1022.0,
      'gpm': {
          'sm_activity_pct': 10.0
      },
      'summary': {
          'env_steps': 300,
          'env_steps_per_s': 30.0,
          'wall_s': 21.0,
          'eval_curve': curve
      }
  }
  # its clock started 21 s before the end, at 1001: the window is 1011 .. 1021
  assert figures.steady_window(kept) == (1011.0, 1021.0, 'end-anchored')
  exact = [dict(p, unix=2000.0 + p['wall_s']) for p in curve]
  assert figures.steady_window({'summary': {'eval_curve': exact}}) == (2010.0, 2020.0, 'exact')
  assert figures.steady_window({'summary': {'eval_curve': curve[:2]}}) is None
  # GPU 0's log: 0 % before the window, 80 % inside it, 0 % after; GPU 1's log says 50 %. A sample is the mean
  # since the one before, so those inside the window 1011..1021 are 1012..1021 (10; 1011's covers 1010..1011).
  tel0 = [{'t': 1000.0 + i, 'sm_activity_pct': 80.0 if 11 <= i <= 21 else 0.0} for i in range(30)]
  tel1 = [{'t': 1000.0 + i, 'sm_activity_pct': 50.0} for i in range(30)]
  for name, records in (('telemetry_gpu0.jsonl', tel0), ('telemetry_gpu1.jsonl', tel1)):
    (tmp_path / name).write_text(''.join(json.dumps(r) + '\n' for r in records))
  assert figures.window_mean(tel0, 1011.0, 1021.0) == (80.0, 10)
  # 100 % from 2000 on, idle before, sampled every 0.1 s: the window 2000..2002 reads 100 (the sample at 2000 is
  # of the idle interval before it)
  busy = [{'t': 1999.0 + 0.1 * i, 'sm_activity_pct': 100.0 if i > 10 else 0.0} for i in range(40)]
  assert figures.window_mean(busy, 1999.0 + 0.1 * 10, 1999.0 + 0.1 * 30) == (100.0, 20)
  runs = {'async': [dict(kept)]}
  logs = [str(tmp_path / 'telemetry_gpu1.jsonl'), str(tmp_path / 'telemetry_gpu0.jsonl')]
  assert bench_run.backfill_steady_gpm(runs, logs) == 1
  assert runs['async'][0]['gpm_steady'] == {
      'sm_activity_pct': 80.0,
      'samples': 10,
      'window_s': 10.0,
      'window': 'end-anchored'
  }
  assert bench_run.backfill_steady_gpm(runs, logs) == 0  # kept as it is
  assert bench_run.aggregate(runs)['async']['steady_sm_activity_pct'] == 80.0
  (tmp_path / 'r.json').write_text(json.dumps({'runs': runs}))
  md = report.table({'r.json': {
      'async': [runs['async'][0]['summary']]
  }}, {'r.json': report.run_extras(str(tmp_path / 'r.json'))})
  row = next(line.split(' | ') for line in md.splitlines() if line.startswith('| r.json'))
  assert row[11:13] == ['10.0', '80.0']  # SM activity over the whole run, then over the steady window
  (tmp_path / 'bad.jsonl').write_text('{not json')
  with pytest.raises(ValueError, match='bad.jsonl as JSON lines'):
    bench_run.backfill_steady_gpm(runs, [str(tmp_path / 'bad.jsonl')])


def test_report_table_marks_seed_counts_and_the_older_definition():
  from experiments.bench import report
  curve = [{
      'env_steps': 0,
      'wall_s': 5.0,
      'return': 1.0
  }, {
      'env_steps': 100,
      'wall_s': 10.0,
      'return': 2.0
  }, {
      'env_steps': 300,
      'wall_s': 12.0,
      'return': 3.0
  }]
  old = {'env_steps': 300, 'env_steps_per_s': 70.0, 'eval_curve': curve, 'extra': {'segments_consumed': 8}}
  new = {
      'env_steps': 300,
      'env_steps_per_s': 80.0,
      'eval_curve': curve,
      'extra': {
          'segments_consumed': 8,
          'startup_s': 3.0
      }
  }
  md = report.table({'r.json': {'sync': [old, dict(new), dict(new, env_steps_per_s=90.0)], 'async': [old]}})
  rows = {line.split(' | ')[1]: line.split(' | ') for line in md.splitlines()[2:] if line.startswith('| r.json')}
  assert rows['sync'][3] == '85 ± 7 (2 of 3 seeds)'
  assert rows['sync'][4] == '100 ± 0'  # steady over all three seeds
  assert rows['async'][3] == '70 †'
  assert '† ' in md  # the footnote saying what the mark means


def test_source_tree_is_the_commits_tree_and_sees_uncommitted_files(tmp_path, monkeypatch):
  """The harness's `tree` names the files a run used, where a copied checkout's HEAD may be stale."""
  from experiments.bench import run as bench_run  # pylint: disable=g-import-not-at-top

  def git(*args):
    return subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@example.com', *args],
                          cwd=tmp_path,
                          check=True,
                          capture_output=True,
                          text=True).stdout.strip()

  git('init', '-q')
  (tmp_path / 'a.txt').write_text('a')
  (tmp_path / '.gitignore').write_text('ignored/\n')
  (tmp_path / 'ignored').mkdir()
  (tmp_path / 'ignored' / 'x').write_text('x')
  git('add', '-A')
  git('commit', '-qm', 'one')
  monkeypatch.chdir(tmp_path)
  assert bench_run.source_tree() == git('rev-parse', 'HEAD^{tree}')
  (tmp_path / 'b.txt').write_text('b')  # untracked, not ignored: part of what a run uses
  changed = bench_run.source_tree()
  assert changed != git('rev-parse', 'HEAD^{tree}')
  assert git('status', '--porcelain') == '?? b.txt'  # the real index was not touched
  git('add', '-A')
  git('commit', '-qm', 'two')
  assert changed == git('rev-parse', 'HEAD^{tree}')


def test_each_label_gets_its_own_cold_cache_unless_a_flag_says_otherwise():
  from experiments.bench import run as bench_run  # pylint: disable=g-import-not-at-top
  job = bench_run.Job('sync_mps', 'sync', '0', ('--use_mps',))
  per_label = bench_run.cache_flags('per_label', 'out/w1_runs', 'sync_mps')
  assert per_label == [f'--compilation_cache_dir={os.path.abspath("out/w1_runs")}/cache/sync_mps']
  assert bench_run.cache_flags('per_label', 'out/w1_runs', 'fused') != per_label
  assert bench_run.cache_flags('off', 'r', 'fused') == ['--compilation_cache_dir=']
  assert bench_run.cache_flags('shared', 'r', 'fused') == []
  command = bench_run._command('w.flags', job, ['--compilation_cache_dir=/mine'], 'run', per_label)
  cache_args = [a for a in command if a.startswith('--compilation_cache_dir=')]
  assert cache_args == per_label + ['--compilation_cache_dir=/mine']  # the last one (--extra's) wins in absl
  assert command.index('--use_mps') > command.index('--compilation_cache_dir=/mine')


def _kept(seed, **summary):
  return {
      'command': f'ebrl_jax.main --seed={seed}',
      'gpm': {},
      'summary': {
          'train_wall_s': 10.0,
          'env_steps_per_s': 1e5,
          **summary
      }
  }


def test_time_to_target_speedup_pairs_the_seeds_both_reached():
  """The base reached the target on seeds 0-2 at 100, 120, 140 s; the other only on seed 0, at 80 s: the speedup
  is 100 / 80 over seed 0 (not the 120 s mean of three seeds over one seed's 80), and names the seed."""
  from experiments.bench import run as bench_run
  runs = {
      'sync': [_kept(0, wall_s_to_target=100.0),
               _kept(1, wall_s_to_target=120.0),
               _kept(2, wall_s_to_target=140.0)],
      'async': [_kept(0, wall_s_to_target=80.0), _kept(1), _kept(2)],
      'brax': [_kept(1)],
  }
  ratios = bench_run.ratios(bench_run.aggregate(runs), 'sync', runs)
  assert ratios['async']['wall_s_to_target_speedup'] == pytest.approx(1.25)
  assert ratios['async']['wall_s_to_target_seeds'] == ['0']
  assert 'wall_s_to_target_speedup' not in ratios['brax']  # no seed in common that reached it


def test_a_run_without_a_counted_iteration_stays_out_of_the_means_whatever_its_exit_code():
  """`auto` whose calibration took the whole --max_wall_s exits 0 with a summary of no training (rate 0): the
  harness's means and the report's table both leave it out."""
  from experiments.bench import figures as figures_lib
  from experiments.bench import report
  from experiments.bench import run as bench_run
  empty = {
      'command': 'x --seed=1',
      'returncode': 0,
      'gpm': {},
      'summary': {
          'train_wall_s': 0.0,
          'env_steps_per_s': 0.0
      }
  }
  runs = {'auto': [_kept(0), empty]}
  figures = bench_run.aggregate(runs)['auto']
  assert figures['env_steps_per_s'] == 1e5 and figures['seeds_finished'] == 1
  md = report.table({'r.json': {'auto': [r['summary'] for r in runs['auto']]}})
  row = next(line.split(' | ') for line in md.splitlines() if line.startswith('| r.json'))
  assert row[2] == '1' and row[3] == report._rate_cell(figures_lib.end_to_end([runs['auto'][0]['summary']]), 1)


def test_curve_agreement_keys_runs_by_their_seed_not_their_position():
  """A merged result holds sync's seeds 0 and 1 but overlap's seed 1 only: overlap's run is compared with sync's
  seed 1 (identical), not with seed 0."""
  from experiments.bench import curve_agreement
  same, other = [{'version': 0, 'return': 1.0}, {'version': 5, 'return': 2.0}], [{'version': 0, 'return': 7.0}]
  result = {
      'seeds': ['0', '1'],
      'runs': {
          'sync': [
              dict(command='--seed=0', summary={'eval_curve': other}),
              dict(command='--seed=1', summary={'eval_curve': same})
          ],
          'overlap': [dict(command='--seed=1', summary={'eval_curve': same})],
      }
  }
  rows = curve_agreement.agreement(result)
  assert [(r['seed'], r['identical']) for r in rows] == [(1, True)]
