"""The GPU memory plan: footprints by hand, plans that fit and that do not, worker variables, NVML (faked)."""
import json
import os
import subprocess
import sys

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax.controller import supervisor
from ebrl_jax.controller import topology
from ebrl_jax.resources import calibrate
from ebrl_jax.resources import memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB, GIB = 2**20, 2**30
PENDULUM = sim.env_spec('inverted_pendulum', 1000, 1)  # obs 4, action 1
ROLES = ['trainer', 'rollout/0', 'rollout/1']


@pytest.fixture(autouse=True)
def _small_allowances(monkeypatch):
  # The hand computations below use a 16 GiB device with 500 MiB per process outside XLA's pool and a 256 MiB
  # pool floor; the shipped values (memory.CONTEXT_BYTES, MIN_POOL_BYTES) are the H200-measured, larger ones.
  monkeypatch.setattr(memory, 'CONTEXT_BYTES', 500 * MIB)
  monkeypatch.setattr(memory, 'MIN_POOL_BYTES', 256 * MIB)


def _config(num_envs=32, batch_size=32, hidden=(4,), colocate_generation=True, evaluator='trainer', **resources):
  return config_lib.Config(sim=config_lib.SimConfig(num_envs=num_envs, num_eval_envs=16),
                           policy=config_lib.PolicyConfig(policy_hidden_sizes=hidden, value_hidden_sizes=hidden),
                           algo=config_lib.AlgoConfig(batch_size=batch_size, num_minibatches=8),
                           schedule=config_lib.ScheduleConfig(name='async',
                                                              num_groups=2,
                                                              colocate_generation=colocate_generation,
                                                              evaluator=evaluator),
                           resources=config_lib.ResourceConfig(**resources))


def test_footprint_parts_by_hand():
  fp = memory.footprints(_config(), PENDULUM)
  trainer, rollout = fp['trainer'].parts, fp['rollout'].parts
  # Network: policy 4 -> 4 -> 2 (20 + 10 scalars), value 4 -> 4 -> 1 (20 + 5): 55 float32 = 220 B. Normaliser:
  # count, mean [4], summed variance [4], std [4]: 13 float32 = 52 B. Adam: count (int32) + two moments.
  assert trainer['train_state'] == (220 + 52) + (4 + 2 * 220) + 4 + 4  # + num_updates, policy_version
  assert trainer['gradients'] == 2 * 220
  # 32 x 8 = 256 segments of T = 5 steps; a transition holds 2 x 4 obs + 1 action + 6 scalars, 4 B each; twice
  # (as collected, and shuffled), plus four [T, S] float arrays.
  assert trainer['batch'] == 2 * 4 * 5 * 256 * 15 + 4 * 4 * 5 * 256
  saved, largest = memory.row_bytes(*_network_and_params(_config()), 4, 1, 1)
  assert largest == 4 * 4  # the widest value per row: a hidden layer of 4 float32
  # Minibatch: (5 + 1) x 256 / 8 = 192 rows; the proximal pass: 5 x 256 rows, two of the largest live.
  assert trainer['activations'] == max(192 * (saved + 2 * largest), 2 * largest * 5 * 256)
  assert trainer['evaluation'] == 16 * (4 * 4 + 2 * largest)
  # Native MuJoCo rollout: the policy twice and act on its 16 envs; envs and segments stay in host memory.
  assert rollout == {'params': 2 * (220 + 52), 'act': 16 * (4 * 4 + 2 * largest)}
  assert fp['trainer'].source == 'estimate' and set(fp) == {'trainer', 'rollout'}


def _network_and_params(cfg):
  import jax  # pylint: disable=g-import-not-at-top
  from ebrl_jax.generation import policies  # pylint: disable=g-import-not-at-top
  from ebrl_jax.generation import stages as gen_stages  # pylint: disable=g-import-not-at-top
  network = policies.make_network(cfg.policy, 4, 1)
  return network, jax.eval_shape(lambda: gen_stages.init_policy_params(network, jax.random.PRNGKey(0), 4))


def test_footprint_scales_with_envs_batch_and_params():
  base = memory.footprints(_config(), PENDULUM)
  more_envs = memory.footprints(_config(num_envs=64), PENDULUM)  # 32 envs per group instead of 16
  assert more_envs['rollout'].parts['act'] == 2 * base['rollout'].parts['act']
  assert more_envs['trainer'].parts['batch'] == base['trainer'].parts['batch']  # same segments per iteration
  bigger_batch = memory.footprints(_config(batch_size=64), PENDULUM)
  assert bigger_batch['trainer'].parts['batch'] == 2 * base['trainer'].parts['batch']
  assert bigger_batch['trainer'].parts['activations'] == 2 * base['trainer'].parts['activations']
  wider = memory.footprints(_config(hidden=(8,)), PENDULUM)
  # Network 4 -> 8 -> 2 and 4 -> 8 -> 1: 58 + 49 = 107 scalars, 52 more than 55: params, two Adam moments,
  # and twice again for gradients and updates.
  assert wider['trainer'].parts['train_state'] - base['trainer'].parts['train_state'] == 3 * 4 * 52
  assert wider['trainer'].parts['gradients'] - base['trainer'].parts['gradients'] == 2 * 4 * 52
  separate = memory.footprints(_config(colocate_generation=False), PENDULUM)
  assert separate['rollout'].parts == {} and separate['generation'].parts['act'] == 32 * (4 * 4 + 2 * 16)


def test_mjx_footprint_traces_envs_in_a_child_and_starts_no_accelerator_client():
  """MJX env state grows with the group's envs; the controller's JAX never starts a backend (on a GPU it would
  preallocate most of the memory the workers are to get)."""
  code = ('import json, sys\n'
          'sys.path.insert(0, sys.argv[1])\n'
          'from jax._src import xla_bridge\n'
          'from ebrl_jax import config, sim\n'
          'from ebrl_jax.resources import memory\n'
          'spec = sim.env_spec("inverted_pendulum", 1000, 1)\n'
          'out = {}\n'
          'for n in (32, 64, 128):\n'
          '  cfg = config.Config(sim=config.SimConfig(num_envs=n, backend="mjx"), algo=config.AlgoConfig(\n'
          '      batch_size=128, num_minibatches=8), schedule=config.ScheduleConfig(name="async", num_groups=2))\n'
          '  out[n] = memory.footprints(cfg, spec)["rollout"].parts\n'
          'print(json.dumps({"parts": out, "backend": xla_bridge.backends_are_initialized()}))\n')
  proc = subprocess.run([sys.executable, '-c', code, ROOT],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS=''))
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result['backend'] is False
  state = {int(n): p['env_state'] for n, p in result['parts'].items()}
  assert state[32] > 0 and state[128] - state[64] == 2 * (state[64] - state[32])  # per env + fixed
  # 128 x 8 segments an iteration, however many envs: each of 2 groups sends half, 512 segments of 5 steps.
  assert {p['segment'] for p in result['parts'].values()} == {4 * 5 * 512 * (2 * 4 + 1 + 6)}


def _fp(mib):
  return memory.Footprint({'all': mib * MIB})


def test_a_plan_that_fits():
  plan = memory.make_plan(_config(), ROLES, 16 * GIB, {'trainer': _fp(2048), 'rollout': _fp(1024)})
  # Headroom 1.5: trainer 3072 MiB = 0.1875 of 16 GiB, each rollout 1536 MiB = 0.09375; with three 500 MiB
  # contexts 7.5 GiB of the 15.2 GiB cap.
  assert plan.roles['trainer'] == memory.RoleBudget(2048 * MIB, 3072 * MIB, 0.1875, 'estimate')
  assert plan.roles['rollout/1'] == memory.RoleBudget(1024 * MIB, 1536 * MIB, 0.09375, 'estimate')
  tiny = memory.make_plan(_config(), ROLES, 16 * GIB, {'trainer': _fp(1), 'rollout': _fp(1)})
  assert tiny.roles['trainer'].budget == memory.MIN_POOL_BYTES  # 1.5 MiB: XLA's pool gets its floor
  summary = plan.summary()
  assert summary['device_total_mib'] == 16384 and summary['context_mib'] == 500
  assert summary['roles']['trainer'] == {
      'footprint_mib': 2048,
      'budget_mib': 3072,
      'fraction': 0.1875,
      'source': 'estimate'
  }


def test_a_plan_that_does_not_fit_names_each_footprint_the_total_and_the_flags():
  with pytest.raises(ValueError) as e:
    memory.make_plan(_config(), ROLES, 8 * GIB, {'trainer': _fp(4096), 'rollout': _fp(1024)})
  message = str(e.value)
  # 6144 + 2 x 1536 + 3 x 500 = 10716 MiB, over 95 % of 8192 MiB = 7782 MiB.
  for part in ('trainer: footprint 4096 MiB -> budget 6144 MiB', 'rollout/0: footprint 1024 MiB -> budget 1536 MiB',
               'rollout/1: footprint 1024 MiB', '3 CUDA contexts x 500 MiB', '10716 MiB in all',
               "device's 8192 MiB (7782 MiB)", '--num_envs (now 32)', '--num_groups (now 2)', '--batch_size (now 32)',
               '--memory_headroom (now 1.5)', '--memory_fractions'):
    assert part in message, (part, message)


def test_fractions_fixed_by_hand_and_measured_peaks():
  cfg = _config(memory_fractions='trainer=0.5')
  plan = memory.make_plan(cfg, ROLES, 16 * GIB, {
      'trainer': _fp(2048),
      'rollout': memory.Footprint({'all': 512 * MIB}, 1024 * MIB)
  })
  assert plan.roles['trainer'] == memory.RoleBudget(2048 * MIB, 8 * GIB, 0.5, '--memory_fractions')
  assert plan.roles['rollout/0'] == memory.RoleBudget(1024 * MIB, 1536 * MIB, 0.09375, 'measured')
  with pytest.raises(ValueError, match=r'trainer: footprint 2048 MiB -> budget 14746 MiB \(--memory_fractions\)'):
    memory.make_plan(_config(memory_fractions='trainer=0.9'), ROLES, 16 * GIB, {
        'trainer': _fp(2048),
        'rollout': _fp(512)
    })


def test_without_a_gpu_each_process_keeps_an_equal_share():
  plan = memory.make_plan(_config(), ROLES, None)
  assert {r: b.fraction for r, b in plan.roles.items()} == pytest.approx({r: 0.3 for r in ROLES})
  assert plan.worker_env('trainer', mps_active=True) == {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.3000'}
  fixed = memory.make_plan(_config(memory_fractions='rollout=0.2'), ROLES, None)
  assert fixed.roles['rollout/0'].fraction == 0.2 and fixed.roles['trainer'].source == 'equal share'
  with pytest.raises(ValueError, match=r'--memory_fractions=trainer=0.7: .* sum to 1.300, more than 0.95'):
    memory.make_plan(_config(memory_fractions='trainer=0.7'), ROLES, None)


class _FakeMps:
  active = True
  pipe_dir = '/run/mps/pipe'

  def worker_env(self, quota=None):
    env = {'CUDA_MPS_PIPE_DIRECTORY': self.pipe_dir}
    if quota is not None:
      env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'] = str(quota)
    return env


def test_worker_env_one_fraction_variable_and_the_mps_limit_only_under_mps():
  plan = memory.make_plan(_config(), ROLES, 16 * GIB, {'trainer': _fp(2048), 'rollout': _fp(1024)})
  cfg = _config(use_mps=True, sm_quotas='trainer=40', pin_cpus=False)

  def placement(cfg, mps_daemon, plan):
    return supervisor.Placement(cfg, topology.make_topology(cfg), mps_daemon, plan)

  with_mps = placement(cfg, _FakeMps(), plan).env('trainer')
  assert with_mps == {
      'EBRL_ROLE': 'trainer',
      'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.1875',
      'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT': '0=3572M',  # budget 3072 + 500 MiB context
      'CUDA_MPS_PIPE_DIRECTORY': '/run/mps/pipe',
      'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': '40'
  }
  without = placement(_config(pin_cpus=False), None, plan).env('rollout/1')
  assert without == {'EBRL_ROLE': 'rollout/1', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.0938'}
  for env in (with_mps, without):
    assert [k for k in env if 'MEM_FRACTION' in k] == ['XLA_PYTHON_CLIENT_MEM_FRACTION']


@pytest.fixture(name='fake_nvml')
def _fake_nvml(fake_pynvml, monkeypatch):
  fake_pynvml(16384)
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)


def test_device_total_from_nvml(fake_nvml, monkeypatch):
  del fake_nvml
  assert memory.device_total_bytes('0') == 16 * GIB
  assert memory.device_total_bytes('GPU-fake') == 16 * GIB
  assert memory.device_total_bytes('1') is None  # no such GPU
  assert sys.modules['pynvml'].calls.count('init') == sys.modules['pynvml'].calls.count('shutdown') == 3
  monkeypatch.setattr(memory, 'pynvml', None)  # an NVML that cannot be used
  assert memory.device_total_bytes('0') is None


def test_plan_for_run_on_a_faked_gpu_with_and_without_a_profile(fake_nvml, tmp_path):
  del fake_nvml
  assert memory.plan_for_run(_config(platform='cpu'), PENDULUM, ROLES).note == '--platform=cpu'
  plan = memory.plan_for_run(_config(), PENDULUM, ROLES)
  assert plan.device_total == 16 * GIB and plan.roles['trainer'].budget == memory.MIN_POOL_BYTES
  with pytest.raises(ValueError, match='--memory_profile=/no/such.json cannot be read'):
    memory.plan_for_run(_config(memory_profile='/no/such.json'), PENDULUM, ROLES)
  cfg = _config()
  profile = {
      'backend': 'mujoco_cpu',
      'num_params': 55,
      'steps_per_iteration': cfg.env_steps_per_iteration,
      'train': {
          'peak_bytes_in_use': 1024 * MIB
      },
      'groups': {
          '16': {
              'peak_bytes_in_use': 300 * MIB
          }
      }
  }
  path = tmp_path / 'profile.json'
  path.write_text(json.dumps(profile))
  measured = memory.plan_for_run(_config(memory_profile=str(path)), PENDULUM, ROLES)
  assert measured.roles['trainer'] == memory.RoleBudget(1024 * MIB, 1536 * MIB, 0.09375, 'measured')
  assert measured.roles['rollout/0'].footprint == 300 * MIB
  path.write_text(json.dumps(dict(profile, num_params=56)))  # another policy: estimates only
  assert memory.plan_for_run(_config(memory_profile=str(path)), PENDULUM, ROLES).roles['trainer'].source == 'estimate'


def test_calibration_records_no_peak_on_the_cpu():
  assert calibrate.peak_bytes_in_use() is None


def test_host_only_rollouts_run_jax_on_cpu_without_quota_or_budget():
  # Native MuJoCo rollouts with a separate generation worker: no GPU context, so no memory budget and no quota;
  # the generation worker gets its quota.
  cfg = _config(colocate_generation=False, use_mps=True, sm_quotas='generation=50,trainer=50', pin_cpus=False)
  assert cfg.rollout_on_host
  roles = ['trainer', 'generation', 'rollout/0', 'rollout/1']
  top = topology.make_topology(cfg)
  assert sorted(top.roles) == sorted(roles)
  gpu_roles = list(top.gpu_roles)
  assert gpu_roles == ['trainer', 'generation']
  plan = memory.make_plan(cfg, gpu_roles, 16 * GIB, {'trainer': _fp(2048), 'generation': _fp(1024)})
  placement = supervisor.Placement(cfg, top, _FakeMps(), plan)
  assert placement.env('rollout/1') == {'EBRL_ROLE': 'rollout/1', 'JAX_PLATFORMS': 'cpu'}
  gen = placement.env('generation')
  assert gen['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'] == '50' and 'XLA_PYTHON_CLIENT_MEM_FRACTION' in gen
  with pytest.raises(ValueError, match='rollout workers a quota, but the rollout workers simulate on CPU'):
    _config(colocate_generation=False, use_mps=True, sm_quotas='rollout=30,trainer=50')
  with pytest.raises(ValueError, match='--quota_schedule / --replan'):
    _config(colocate_generation=False, use_mps=True, quota_schedule='5:rollout=30')


def test_live_quota_changes_plan_a_warm_standby_per_group():
  # A quota change starts each group's standby while its old worker still runs: the plan budgets both.
  cfg = _config(use_mps=True, quota_schedule='5:rollout=30')
  roles = list(topology.make_topology(cfg).planned_roles)
  assert roles == ['trainer', 'rollout/0', 'rollout/1', 'standby/0', 'standby/1']
  assert list(topology.make_topology(_config()).planned_roles) == ROLES
  fps = {'trainer': _fp(2048), 'rollout': _fp(1024)}
  plan = memory.make_plan(cfg, roles, 16 * GIB, fps)
  assert plan.roles['standby/1'] == plan.roles['rollout/1'] == memory.RoleBudget(1024 * MIB, 1536 * MIB, 0.09375,
                                                                                 'estimate')
  # On 10 GiB (cap 9728 MiB): without standbys 3072 + 2 x 1536 + 3 x 500 = 7644 MiB fits; with them
  # 3072 + 4 x 1536 + 5 x 500 = 11716 MiB does not, and the message says what the standbys are.
  memory.make_plan(_config(), ROLES, 10 * GIB, fps)
  with pytest.raises(ValueError) as e:
    memory.make_plan(cfg, roles, 10 * GIB, fps)
  for part in ('the 2 standby roles are the warm standbys that --quota_schedule / --replan start',
               'standby/0: footprint 1024 MiB -> budget 1536 MiB', '5 CUDA contexts', '11716 MiB in all'):
    assert part in str(e.value), (part, str(e.value))


def test_the_evaluator_process_takes_the_evaluation_footprint_and_a_small_quota_under_mps():
  # --evaluator=process: the evaluation envs and act leave the trainer's footprint for the evaluator's (plus one
  # copy of the parameters); the evaluator is a planned GPU role, at EVALUATOR_QUOTA unless --sm_quotas names it.
  in_trainer = memory.footprints(_config(), PENDULUM)
  cfg = _config(evaluator='process', use_mps=True, pin_cpus=False)
  fp = memory.footprints(cfg, PENDULUM)
  assert 'evaluation' not in fp['trainer'].parts
  assert fp['evaluator'].parts['evaluation'] == in_trainer['trainer'].parts['evaluation']
  assert fp['evaluator'].parts['params'] == 4 * (55 + 13)  # the network and the normaliser, float32
  top = topology.make_topology(cfg)
  assert list(top.planned_roles) == ['trainer', 'evaluator', 'rollout/0', 'rollout/1']
  fps = {'trainer': _fp(2048), 'rollout': _fp(1024), 'evaluator': _fp(256)}
  plan = memory.make_plan(cfg, list(top.planned_roles), 16 * GIB, fps)
  assert plan.roles['evaluator'] == memory.RoleBudget(256 * MIB, 384 * MIB, 0.0234375, 'estimate')
  env = supervisor.Placement(cfg, top, _FakeMps(), plan).env('evaluator')
  assert env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'] == str(config_lib.EVALUATOR_QUOTA) == '10'
  given = _config(evaluator='process', use_mps=True, pin_cpus=False, sm_quotas='evaluator=5,trainer=40')
  assert supervisor.Placement(given, topology.make_topology(given), _FakeMps(),
                              plan).env('evaluator')['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'] == '5'
