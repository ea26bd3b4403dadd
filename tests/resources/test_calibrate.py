"""The calibration in this process on native MuJoCo at tiny sizes: the training batch made of the stages' own output
(shapes, rows, the policy's log-probs), and a whole `profile_stages` with its phases and warm-up seconds. The
calibration process of a real run (spawned, then a run on the plan) is test_autoplan's opt-in e2e test."""
import dataclasses

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.resources import calibrate
from ebrl_jax.resources import profiles
from ebrl_jax.trainer import stages as trainer_stages


def _cfg():
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=8,
                                                    num_eval_envs=2,
                                                    num_threads=1),
                           policy=config_lib.PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)),
                           algo=config_lib.AlgoConfig(unroll_length=4,
                                                      batch_size=8,
                                                      num_minibatches=2,
                                                      num_updates_per_batch=1),
                           schedule=config_lib.ScheduleConfig(name='fused', compilation_cache_dir=''))


def test_the_training_batch_is_the_policys_output_on_the_observed_envs_in_the_iterations_shapes():
  cfg = _cfg()  # 8 x 2 minibatches = 16 segments of 8 envs: 2 unrolls per env per iteration
  unrolls, steps = cfg.segment_shape
  assert unrolls == 2 and steps == 4
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  state = trainer_stages.init_train_state(network, trainer_stages.make_optimizer(cfg.algo), jax.random.PRNGKey(0),
                                          spec.obs_dim, True)
  act = gen_stages.make_act(network, cfg.policy.min_std)
  observed = np.random.default_rng(0).normal(size=(3, spec.obs_dim)).astype(np.float32)  # 3 envs seen, 8 run
  batch = calibrate.train_batch(cfg, spec, act, state.params, state.policy_version, observed)
  template = types.transition_template(steps, unrolls * 8, spec.obs_dim, 1, spec.action_dim)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == jax.tree.map(lambda t: (t.shape, t.dtype), template)
  rows = np.resize(observed, (8, spec.obs_dim))  # env e sees observed[e % 3]
  out = act(state.params, rows, jax.random.PRNGKey(4), 0)
  for t in range(steps):
    for u in range(unrolls):
      segment = slice(u * 8, (u + 1) * 8)
      np.testing.assert_array_equal(batch.obs[t, segment], rows)
      np.testing.assert_array_equal(batch.raw_action[t, segment], out.raw_actions)
      np.testing.assert_allclose(batch.behaviour_log_prob[t, segment], out.log_probs)
  assert np.all(batch.mask == 1) and np.all(batch.termination == 0) and np.all(batch.policy_version == 0)
  assert np.all(np.isfinite(batch.reward)) and np.std(batch.reward) > 0.5
  with pytest.raises(ValueError, match='do not match the env spec'):  # state rows for a camera spec
    calibrate.train_batch(cfg, spec._replace(pixel_shape=(8, 8, 3)), act, state.params, 0, observed)


def test_grpo_training_batch_is_one_whole_episode_per_env_and_trains():
  """--algo=grpo (auto and --plan calibrate it too): the batch is the iteration's [episode steps, envs], and
  train_step takes it with the run's GRPO groups."""
  base = _cfg()
  cfg = dataclasses.replace(base,
                            sim=dataclasses.replace(base.sim, episode_length=6, group_size=4),
                            algo=dataclasses.replace(base.algo, name='grpo'))
  assert cfg.segment_shape == (1, 6)
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  optimizer = trainer_stages.make_optimizer(cfg.algo)
  state = trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), spec.obs_dim, True)
  act = gen_stages.make_act(network, cfg.policy.min_std)
  observed = np.random.default_rng(0).normal(size=(8, spec.obs_dim)).astype(np.float32)
  batch = calibrate.train_batch(cfg, spec, act, state.params, state.policy_version, observed)
  assert batch.reward.shape == (6, 8) and batch.obs.shape == (6, 8, spec.obs_dim)
  timed = calibrate._train(cfg, network, optimizer, state, batch, repeats=1)  # pylint: disable=protected-access
  assert timed.warmup_s > 0 and len(timed.samples_s) == 1 and timed.samples_s[0] > 0


def test_profile_stages_on_native_mujoco_times_every_stage_and_says_where_its_time_went():
  cfg = _cfg()
  profile = calibrate.profile_stages(cfg, [4, 8], repeats=2)
  assert list(profile['phase_s']) == ['setup', 'group_size_4', 'group_size_8', 'train_batch', 'train']
  assert all(s > 0 for s in profile['phase_s'].values())  # no MJX env is built for a native-MuJoCo run
  assert profile['quota'] == 100 and profile['steps_per_iteration'] == cfg.env_steps_per_iteration == 64
  for entry in [profile['train'], *(g[name] for g in profile['groups'].values() for name in ('sim', 'generation'))]:
    assert len(entry['samples_s']) == 2 and all(s > 0 for s in entry['samples_s']) and entry['warmup_s'] > 0
  assert profile['groups']['8']['sim']['env_steps'] == 8 * 4
  store = profiles.ProfileStore('machine', 'workload')
  calibrate.add_to_store(store, profile)
  assert sorted({b for b, _, _ in store['sim'].samples}) == [4, 8] and len(store['train'].samples) == 2


def test_profile_stages_with_pixels_renders_and_trains_on_camera_observations():
  """--obs=pixels (push_cube on native MuJoCo): the sim stage is timed with the pool rendering as the run's does,
  generation on the `PixelObs` it ended on, and training on a batch of those observations."""
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='push_cube',
                                                   obs='pixels',
                                                   image_size=16,
                                                   frame_stack=2,
                                                   num_envs=4,
                                                   num_eval_envs=2,
                                                   num_threads=1),
                          policy=config_lib.PolicyConfig(policy_hidden_sizes=(8,),
                                                         value_hidden_sizes=(8,),
                                                         d_model=8,
                                                         cnn_channels=(4,),
                                                         cnn_blocks=0),
                          algo=config_lib.AlgoConfig(unroll_length=2,
                                                     batch_size=4,
                                                     num_minibatches=1,
                                                     num_updates_per_batch=1),
                          schedule=config_lib.ScheduleConfig(name='fused', compilation_cache_dir=''))
  spec = sim.env_spec('push_cube', cfg.sim.episode_length, 1, config_lib.pixel_shape(cfg.sim))
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  state = trainer_stages.init_train_state(network, trainer_stages.make_optimizer(cfg.algo), jax.random.PRNGKey(0),
                                          spec.obs_dim, True, spec.pixel_shape)
  act = gen_stages.make_act(network, cfg.policy.min_std)
  timed = calibrate._cpu_sim_gen(cfg, act, state.params, 4, repeats=1, threads=1)  # pylint: disable=protected-access
  obs = timed['obs']
  assert isinstance(obs, types.PixelObs) and obs.pixels.shape == (4, 16, 16, 6) and obs.pixels.dtype == np.uint8
  assert obs.pixels.std() > 0  # rendered frames, not zeros
  batch = calibrate.train_batch(cfg, spec, act, state.params, 0, obs)
  assert batch.obs.pixels.shape == (2, 4, 16, 16, 6) and batch.next_obs.pixels.dtype == np.uint8  # [T, S, ...]
  for t in range(2):
    np.testing.assert_array_equal(batch.obs.pixels[t], obs.pixels)
    np.testing.assert_array_equal(batch.obs.state[t], obs.state)
  with pytest.raises(ValueError, match='do not match the env spec'):
    calibrate.train_batch(cfg, spec, act, state.params, 0, obs.state)
  profile = calibrate.profile_stages(cfg, [4], repeats=1)
  for entry in (profile['train'], profile['groups']['4']['sim'], profile['groups']['4']['generation']):
    assert entry['median_s'] > 0 and entry['warmup_s'] > 0
