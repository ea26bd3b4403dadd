"""--value_norm_rate (PopArt): the statistics by hand, the output-preserving rescale, the loss in normalised units,
a whole train step's statistics and learning, checkpoints, and the configurations it refuses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import main
from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import critic
from ebrl_jax.trainer import losses
from ebrl_jax.trainer import stages

import test_trainer_stages as tts  # pylint: disable=g-bad-import-order

OBS = tts.OBS


def _stats(mean, std):
  return critic.ValueStats(jnp.float32(mean), jnp.float32(std**2 + mean**2), jnp.int32(1))


def test_statistics_by_hand():
  stats = critic.init_value_stats()
  assert (float(stats.mean), float(stats.std)) == (0.0, 1.0)
  np.testing.assert_array_equal(critic.denormalize(stats, jnp.arange(3.0)), jnp.arange(3.0))
  # The first batch sets them: mean 5, second moment 29 -> std 2, whatever the rate.
  stats = critic.update_value_stats(stats, jnp.float32(5.0), jnp.float32(29.0), 0.1)
  np.testing.assert_allclose([stats.mean, stats.std, stats.updates], [5.0, 2.0, 1], rtol=1e-6)
  # Later ones move by the rate: mean 0.9 * 5 + 0.1 * 10 = 5.5, second 0.9 * 29 + 0.1 * 104 = 36.5, std 2.5.
  stats = critic.update_value_stats(stats, jnp.float32(10.0), jnp.float32(104.0), 0.1)
  np.testing.assert_allclose([stats.mean, stats.std, stats.updates], [5.5, 2.5, 2], rtol=1e-6)
  np.testing.assert_allclose(critic.normalize(stats, critic.denormalize(stats, jnp.float32(0.3))), 0.3, rtol=1e-6)
  # A batch of constant targets: std stays at its floor instead of dividing by zero.
  flat = critic.update_value_stats(critic.init_value_stats(), jnp.float32(7.0), jnp.float32(49.0), 0.1)
  assert float(flat.std) == pytest.approx(critic.STD_MIN, rel=1e-2)


@pytest.mark.parametrize('policy,layer', [
    (dict(policy_hidden_sizes=(8,), value_hidden_sizes=(8, 8)), ('params', 'value', 'hidden_2')),
    (dict(kind='transformer', d_model=16, num_layers=1, num_heads=2, critic='shared'), ('params', 'value_head')),
    (dict(kind='transformer', d_model=16, num_layers=1, num_heads=2, critic='mlp', value_hidden_sizes=(8,)),
     ('params', 'value', 'hidden_1')),
])
def test_the_output_layer_is_found(policy, layer):
  net = policies.make_network(PolicyConfig(**policy), OBS, 2)
  params = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS))))
  assert critic.output_layer(params) == layer


def test_no_or_several_output_layers_are_errors():
  with pytest.raises(ValueError, match='--value_norm_rate.*has 0'):
    critic.output_layer({'params': {'policy': {'kernel': jnp.zeros((3, 1))}}})
  two = {'params': {'value': {'a': {'kernel': jnp.zeros((3, 1))}, 'b': {'kernel': jnp.zeros((3, 1))}}}}
  with pytest.raises(ValueError, match='has 2'):
    critic.output_layer(two)


def test_the_rescale_keeps_values_in_return_units_and_the_policy():
  params = gen_stages.init_policy_params(tts.NET, jax.random.PRNGKey(0), OBS)
  obs = jax.random.normal(jax.random.PRNGKey(1), (16, OBS)) * 2.0
  old, new = _stats(3.0, 2.0), _stats(-40.0, 25.0)
  moved = params.replace(network=critic.preserve_outputs(params.network, old, new))
  before = critic.denormalize(old, gen_stages.value(tts.NET, params, obs))
  after = critic.denormalize(new, gen_stages.value(tts.NET, moved, obs))
  np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-4)
  assert not np.allclose(gen_stages.value(tts.NET, moved, obs), gen_stages.value(tts.NET, params, obs))
  key = jax.random.PRNGKey(2)
  np.testing.assert_array_equal(
      gen_stages.act(tts.NET, moved, obs, key).raw_actions,
      gen_stages.act(tts.NET, params, obs, key).raw_actions)


def test_the_loss_regresses_normalised_targets():
  algo = AlgoConfig(batch_size=4, num_minibatches=2, reward_scaling=3.0)
  params = gen_stages.init_policy_params(tts.NET, jax.random.PRNGKey(0), OBS)
  batch = tts._batch(tts.NET, params, jax.random.PRNGKey(1))
  key = jax.random.PRNGKey(3)
  plain, plain_metrics = losses.ppo_loss(tts.NET, params, batch, batch.behaviour_log_prob, key, algo, 1e-3)
  same, _ = losses.ppo_loss(tts.NET,
                            params,
                            batch,
                            batch.behaviour_log_prob,
                            key,
                            algo,
                            1e-3,
                            value_stats=critic.init_value_stats())
  np.testing.assert_allclose(same, plain, rtol=1e-6)  # mean 0, std 1: the plain loss
  stats = _stats(5.0, 4.0)
  _, metrics = losses.ppo_loss(tts.NET, params, batch, batch.behaviour_log_prob, key, algo, 1e-3, value_stats=stats)
  net_values = jax.vmap(lambda o: gen_stages.value(tts.NET, params, o))(batch.obs)
  bootstrap = gen_stages.value(tts.NET, params, batch.next_obs[-1])
  vs, _ = losses.compute_gae(batch.reward * 3.0, net_values * 4.0 + 5.0, bootstrap * 4.0 + 5.0, batch.termination,
                             batch.truncation, algo.discount, algo.gae_lambda)
  expected = algo.value_cost * np.mean(np.square((vs - 5.0) / 4.0 - net_values))
  np.testing.assert_allclose(metrics['value_loss'], expected, rtol=1e-4)
  assert not np.isclose(float(metrics['value_loss']), float(plain_metrics['value_loss']))


def _algo(rate):
  return AlgoConfig(batch_size=4,
                    num_minibatches=2,
                    num_updates_per_batch=2,
                    unroll_length=tts.T,
                    learning_rate=1e-2,
                    reward_scaling=1.0,
                    value_norm_rate=rate)


def _terminating(state, reward, noise=0.0):
  """A batch whose every step ends its episode with `reward` (plus `noise` x N(0, 1)), none cut by a time limit: the
  value targets are the rewards."""
  ones = jnp.ones((tts.T, tts.S))
  rewards = reward + noise * jax.random.normal(jax.random.PRNGKey(5), ones.shape)
  return tts._batch(tts.NET, state.params, jax.random.PRNGKey(1))._replace(reward=rewards,
                                                                           termination=ones,
                                                                           truncation=ones * 0.0)


def test_a_train_step_takes_in_the_batch_targets_and_learns_large_values():
  algo = _algo(0.5)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(0), OBS, value_norm=True)
  # Targets ~500 +- 50 whatever the critic says: the first batch sets the statistics to theirs.
  batch = _terminating(state, 500.0, noise=50.0)
  mean, std = float(jnp.mean(batch.reward)), float(jnp.std(batch.reward))
  errors, value_losses = [], []
  for i in range(8):
    state, metrics = tts.train_jit(tts.NET, optimizer, algo, 1e-3, state, batch, jax.random.PRNGKey(10 + i))
    values = critic.denormalize(state.value_stats,
                                jax.vmap(lambda o: gen_stages.value(tts.NET, state.params, o))(batch.obs))
    errors.append(float(jnp.mean(jnp.abs(values - mean))))
    value_losses.append(float(metrics['value_loss']))
    if i == 0:
      assert int(state.value_stats.updates) == 1
      np.testing.assert_allclose([state.value_stats.mean, state.value_stats.std], [mean, std], rtol=1e-4)
      np.testing.assert_allclose([metrics['value_target_mean'], metrics['value_target_std']], [mean, std], rtol=1e-4)
  assert int(state.value_stats.updates) == 8
  # The critic's values in return units close in on the targets' mean from ~0, the loss in normalised units falls.
  assert errors[-1] < 0.5 * errors[0] and value_losses[-1] < 0.5 * value_losses[0]


def test_targets_that_move_move_the_statistics_by_the_rate():
  algo = _algo(0.25)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(0), OBS, value_norm=True)
  state, _ = tts.train_jit(tts.NET, optimizer, algo, 1e-3, state, _terminating(state, 2.0), jax.random.PRNGKey(2))
  state, _ = tts.train_jit(tts.NET, optimizer, algo, 1e-3, state, _terminating(state, 10.0), jax.random.PRNGKey(3))
  np.testing.assert_allclose(state.value_stats.mean, 0.75 * 2.0 + 0.25 * 10.0, rtol=1e-6)
  np.testing.assert_allclose(state.value_stats.std, np.sqrt(0.75 * 4.0 + 0.25 * 100.0 - 4.0**2), rtol=1e-5)


def test_off_is_the_train_state_of_before(tmp_path):
  optimizer = stages.make_optimizer(AlgoConfig())
  plain = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(0), OBS)
  assert plain.value_stats is None
  normed = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(0), OBS, value_norm=True)
  normed = normed.replace(value_stats=_stats(12.0, 3.0))
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'ckpt'))
  ckpt.save(1, normed)
  ckpt.wait()
  template = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(1), OBS, value_norm=True)
  restored, _, _ = ckpt.restore(template)
  np.testing.assert_allclose([restored.value_stats.mean, restored.value_stats.std], [12.0, 3.0], rtol=1e-6)
  ckpt.close()


@pytest.mark.parametrize('algo,match', [
    (dict(name='grpo', value_norm_rate=0.1), '--algo=grpo trains no critic'),
    (dict(value_norm_rate=0.0), r'must be in \(0, 1\]'),
    (dict(value_norm_rate=1.5), r'must be in \(0, 1\]'),
])
def test_bad_settings_name_their_flags(algo, match):
  with pytest.raises(ValueError, match=match):
    AlgoConfig(**algo)


def test_flag_reaches_the_config():
  values = main.FLAGS.__class__()
  main.define_flags(values)
  values(['prog', '--value_norm_rate=0.05', '--num_envs=8', '--batch_size=8'])
  assert main.config_from_flags(values).algo.value_norm_rate == 0.05
  assert config_lib.Config(sim=config_lib.SimConfig(num_envs=8),
                           algo=AlgoConfig(batch_size=8, num_minibatches=2)).algo.value_norm_rate is None
