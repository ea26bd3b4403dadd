"""Contract tests for config validation: every bad value names its flag and the allowed values."""
import dataclasses
import re

import pytest

from ebrl_jax import config as config_lib


@pytest.mark.parametrize('ctor,kwargs,pattern', [
    (config_lib.SimConfig, {
        'task': 'antt'
    }, r'--task=.antt. is not valid; allowed values: ant, halfcheetah'),
    (config_lib.SimConfig, {
        'backend': 'gpu'
    }, r'--backend=.gpu. is not valid; allowed values: mujoco_cpu, mjx'),
    (config_lib.SimConfig, {
        'num_envs': 0
    }, r'--num_envs=0 must be > 0'),
    (config_lib.SimConfig, {
        'num_envs': 10,
        'group_size': 4
    }, r'--num_envs=10 must be a multiple of --group_size=4'),
    (config_lib.PolicyConfig, {
        'kind': 'cnn'
    }, r'--policy=.cnn. is not valid; allowed values: mlp, transformer'),
    (config_lib.PolicyConfig, {
        'd_model': 100,
        'num_heads': 3
    }, r'--d_model=100 must be a multiple of --num_heads=3'),
    (config_lib.PolicyConfig, {
        'action_chunk': 4
    }, r'--action_chunk=4 needs --policy=transformer'),
    (config_lib.PolicyConfig, {
        'policy_hidden_sizes': ()
    }, r'--policy_hidden_sizes=\[\] must be non-empty'),
    (config_lib.AlgoConfig, {
        'name': 'sac'
    }, r'--algo=.sac. is not valid; allowed values: ppo, grpo'),
    (config_lib.AlgoConfig, {
        'discount': 1.5
    }, r'--discount=1.5 must lie in \[0.0, 1.0\]'),
    (config_lib.AlgoConfig, {
        'max_grad_norm': -1.0
    }, r'--max_grad_norm=-1.0 must be > 0'),
    (config_lib.ScheduleConfig, {
        'name': 'warp'
    }, r'--schedule=.warp. is not valid; allowed values: fused, sync, async'),
    (config_lib.ScheduleConfig, {
        'num_timesteps': 0
    }, r'--num_timesteps=0 must be > 0'),
    (config_lib.ScheduleConfig, {
        'env_slices': 0
    }, r'--env_slices=0 must be > 0'),
    (config_lib.AlgoConfig, {
        'learning_rate': float('inf')
    }, r'--learning_rate=inf must be a finite number'),
    (config_lib.AlgoConfig, {
        'learning_rate': float('nan')
    }, r'--learning_rate=nan must be a finite number'),
    (config_lib.ScheduleConfig, {
        'max_wall_s': float('inf')
    }, r'--max_wall_s=inf must be a finite number'),
    (config_lib.ResourceConfig, {
        'sm_quotas': 'trainer=x',
        'use_mps': True
    }, r"--sm_quotas: 'trainer=x' must read role=percent"),
    (config_lib.ResourceConfig, {
        'memory_fractions': 'sim=0.2'
    }, r"--memory_fractions: role 'sim' is not valid; allowed roles: trainer, rollout, generation, evaluator"),
    (config_lib.ResourceConfig, {
        'memory_fractions': 'trainer=x'
    }, r"--memory_fractions: 'trainer=x' must read role=fraction, e.g. trainer=0.4"),
    (config_lib.ResourceConfig, {
        'memory_fractions': 'trainer=1.5'
    }, r'--memory_fractions: trainer=1.5 must lie in \(0, 1\]'),
    (config_lib.ResourceConfig, {
        'memory_headroom': 0.5
    }, r'--memory_headroom=0.5 must be >= 1'),
])
def test_component_validation(ctor, kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    ctor(**kwargs)


@pytest.mark.parametrize('value', [float('nan'), float('inf'), float('-inf')])
def test_target_return_must_be_finite(value):
  """A target of nan is never reached and inf never either: the run would train to its end without saying why."""
  with pytest.raises(ValueError, match=r'--target_return=.* must be a finite number'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(target_return=value))


def test_batch_must_divide_into_env_segments():
  # 3 x 5 = 15 segments per iteration cannot be split into whole segments of 4 envs.
  with pytest.raises(ValueError, match=re.escape('--batch_size=3 x --num_minibatches=5 = 15 segments')):
    config_lib.Config(sim=config_lib.SimConfig(num_envs=4), algo=config_lib.AlgoConfig(batch_size=3, num_minibatches=5))


def test_grpo_needs_groups_and_divisible_minibatches():
  with pytest.raises(ValueError, match='--algo=grpo needs --group_size >= 2'):
    config_lib.Config(algo=config_lib.AlgoConfig(name='grpo'))
  with pytest.raises(ValueError, match='--num_envs=8 must be a multiple of --num_minibatches=3'):
    config_lib.Config(sim=config_lib.SimConfig(num_envs=8, group_size=4),
                      algo=config_lib.AlgoConfig(name='grpo', num_minibatches=3))


def test_unroll_must_hold_whole_chunks():
  with pytest.raises(ValueError, match='--unroll_length=5 must be a multiple of --action_chunk=2'):
    config_lib.Config(policy=config_lib.PolicyConfig(kind='transformer', action_chunk=2),
                      algo=config_lib.AlgoConfig(unroll_length=5))


def test_env_slices_need_a_separate_cpu_generation_worker_and_must_divide_the_groups():

  def make(sim=None, **schedule):
    schedule = {'name': 'async', 'num_groups': 2, 'colocate_generation': False, **schedule}
    return config_lib.Config(sim=sim or config_lib.SimConfig(num_envs=32),
                             algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                             schedule=config_lib.ScheduleConfig(**schedule))

  assert make(env_slices=4).slice_envs == 4  # 32 envs / 2 groups / 4 slices
  needs = '--env_slices=2 splits the env groups that a separate generation worker serves: it needs'
  with pytest.raises(ValueError, match=needs + '.*got --schedule=async, --colocate_generation=True'):
    make(env_slices=2, colocate_generation=True)
  with pytest.raises(ValueError, match=needs + '.*got --schedule=fused'):
    make(env_slices=2, name='fused')
  with pytest.raises(ValueError,
                     match=re.escape('--env_slices=3 must divide the 16 envs of each env group '
                                     '(--num_envs=32 / --num_groups=2)')):
    make(env_slices=3)


def test_derived_sizes():
  cfg = config_lib.Config(sim=config_lib.SimConfig(num_envs=16),
                          algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=4, unroll_length=5))
  # 32 * 4 = 128 segments of 5 steps = 640 env steps; 128 / 16 envs = 8 unrolls per env.
  assert cfg.env_steps_per_iteration == 640
  assert cfg.unrolls_per_env == 8
  grpo = config_lib.Config(sim=config_lib.SimConfig(num_envs=8, group_size=4, episode_length=50),
                           algo=config_lib.AlgoConfig(name='grpo', num_minibatches=2))
  assert grpo.env_steps_per_iteration == 8 * 50


def test_configs_are_frozen():
  cfg = config_lib.Config()
  with pytest.raises(Exception):
    cfg.sim.num_envs = 3  # type: ignore[misc]


def test_token_policy_and_compute_dtype_fields_validate_and_name_their_flags():
  token = config_lib.PolicyConfig(kind='token', action_chunk=2, compute_dtype='bfloat16')
  assert token.num_bins == 256 and 'token' in config_lib.POLICIES  # the default of 256 bins
  assert config_lib.PolicyConfig(kind='transformer', compute_dtype='bfloat16').compute_dtype == 'bfloat16'
  with pytest.raises(ValueError, match=r'--num_bins=1 must lie in \[2, 2\^24\]'):
    config_lib.PolicyConfig(kind='token', num_bins=1)
  with pytest.raises(ValueError, match=r'--num_bins=16777217 must lie in \[2, 2\^24\] \(token ids travel as float32'):
    config_lib.PolicyConfig(kind='token', num_bins=2**24 + 1)
  assert config_lib.PolicyConfig(kind='token', num_bins=2**24).num_bins == 2**24  # the largest exact id is 2^24 - 1
  with pytest.raises(ValueError, match=r"--compute_dtype='float16' is not valid; allowed values: float32, bfloat16"):
    config_lib.PolicyConfig(kind='token', compute_dtype='float16')
  mlp_bf16 = config_lib.PolicyConfig(kind='mlp', compute_dtype='bfloat16')  # the CNN encoder's, with pixels
  with pytest.raises(ValueError,
                     match=r'--compute_dtype=bfloat16 needs --policy=transformer or token, or '
                     r"--obs=pixels \(where it is the MLP policy's CNN encoder's"):
    config_lib.Config(policy=mlp_bf16)
  pixels = config_lib.SimConfig(task='push_cube', obs='pixels', num_envs=4)
  assert config_lib.Config(sim=pixels, policy=mlp_bf16,
                           algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1)).policy == mlp_bf16
  with pytest.raises(ValueError, match='--unroll_length=5 must be a multiple of --action_chunk=2'):
    config_lib.Config(policy=token, algo=config_lib.AlgoConfig(unroll_length=5))


def test_every_float_setting_refuses_nan():
  """A NaN passes a check written `value < bound` (NaN compares False): every float field of every section is
  refused with NaN, before a run starts (--max_behaviour_ratio=nan made every loss NaN)."""
  cfg, accepted, checked = config_lib.Config(), [], 0
  for section in dataclasses.fields(cfg):
    part = getattr(cfg, section.name)
    if not dataclasses.is_dataclass(part):
      continue
    for field in dataclasses.fields(part):
      if isinstance(getattr(part, field.name), float) or 'float' in str(field.type):
        checked += 1
        try:
          config_lib.Config(**{section.name: dataclasses.replace(part, **{field.name: float('nan')})})
          accepted.append(f'{section.name}.{field.name}')
        except ValueError:
          pass
  assert checked >= 20 and not accepted, accepted
