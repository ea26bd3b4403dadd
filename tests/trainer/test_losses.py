"""GAE, the clipped surrogate with the behaviour weight, GRPO advantages/loss; PPO loss parity with Brax."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import normalization, policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.trainer import losses
from ebrl_jax.types import Transition

import brax_testlib  # pylint: disable=g-bad-import-order


def _gae_example():
  # T = 3, B = 2; discount 0.5, lambda 0.5 (so discount * lambda = 0.25). Column 0 terminates at t = 1,
  # column 1 is truncated at t = 1. rewards [1, 2, 3], values [10, 20, 30], bootstrap 40 in both columns.
  reward = jnp.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
  value = jnp.array([[10.0, 10.0], [20.0, 20.0], [30.0, 30.0]])
  bootstrap = jnp.array([40.0, 40.0])
  termination = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
  truncation = jnp.array([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
  return reward, value, bootstrap, termination, truncation


def test_gae_hand_computed():
  vs, adv = losses.compute_gae(*_gae_example(), discount=0.5, gae_lambda=0.5)
  # Column 0 (termination at t=1). next values [20, 30, 40].
  #   deltas: t0 1 + 0.5*20 - 10 = 1; t1 2 + 0 - 20 = -18 (no bootstrap); t2 3 + 0.5*40 - 30 = -7.
  #   backward: acc2 = -7; acc1 = -18 + 0.25*(1-1)*(-7) = -18; acc0 = 1 + 0.25*(-18) = -3.5.
  #   vs = acc + v = [6.5, 2, 23]; advantages use vs_{t+1} = [2, 23, 40]:
  #   t0 1 + 0.5*2 - 10 = -8; t1 2 - 20 = -18; t2 3 + 20 - 30 = -7.
  # Column 1 (truncation at t=1): deltas [1, (2 + 0.5*30 - 20 = -3) * 0 = 0, -7].
  #   acc2 = -7; acc1 = 0 + 0.25*(1-1)*(-7) = 0 (truncation mask); acc0 = 1 + 0.25*0 = 1.
  #   vs = [11, 20, 23]; advantages with vs_{t+1} = [20, 23, 40]: t0 1 + 10 - 10 = 1; t1 zeroed; t2 -7.
  np.testing.assert_allclose(vs, [[6.5, 11.0], [2.0, 20.0], [23.0, 23.0]], rtol=1e-6)
  np.testing.assert_allclose(adv, [[-8.0, 1.0], [-18.0, 0.0], [-7.0, -7.0]], rtol=1e-6)


def test_gae_matches_brax():
  brax_losses = pytest.importorskip('brax.training.agents.ppo.losses')
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  reward, value = jax.random.normal(k[0], (6, 4)), jax.random.normal(k[1], (6, 4))
  bootstrap = jax.random.normal(k[2], (4,))
  termination = (jax.random.uniform(k[3], (6, 4)) < 0.2).astype(jnp.float32)
  truncation = (jax.random.uniform(k[4], (6, 4)) < 0.2).astype(jnp.float32) * (1 - termination)
  ours = losses.compute_gae(reward, value, bootstrap, termination, truncation, 0.97, 0.95)
  theirs = brax_losses.compute_gae(truncation, termination, reward, value, bootstrap, 0.95, 0.97)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


ALGO = AlgoConfig(clip_epsilon=0.2, max_behaviour_ratio=2.0)
# Four samples: (ratio, advantage) = (1.5, +2), (0.5, +2), (1.5, -1), (1.1, -1); eps = 0.2.
#   min(r A, clip(r) A): min(3, 1.2*2) = 2.4; min(1, 0.8*2) = 1.0; min(-1.5, -1.2) = -1.5; min(-1.1, -1.1) = -1.1.
RATIOS = jnp.array([1.5, 0.5, 1.5, 1.1])
ADV = jnp.array([2.0, 2.0, -1.0, -1.0])
PROX = jnp.zeros(4)
LOGP = jnp.log(RATIOS)


def test_clipped_surrogate_hand_computed():
  loss, m = losses.clipped_surrogate(LOGP, PROX, PROX, ADV, jnp.ones(4), ALGO)
  # mean(2.4, 1.0, -1.5, -1.1) = 0.8 / 4 = 0.2 -> loss -0.2. |r - 1| > 0.2 for 3 of 4.
  np.testing.assert_allclose(loss, -0.2, rtol=1e-5)
  np.testing.assert_allclose(m['clip_fraction'], 0.75)
  np.testing.assert_allclose(m['behaviour_weight'], 1.0)  # proximal == behaviour: w = 1 exactly
  # approx_kl = mean(r - 1 - log r): (0.5 - 0.4054651) + (-0.5 + 0.6931472) + (0.5 - 0.4054651)
  #   + (0.1 - 0.0953102) = 0.0945349 + 0.1931472 + 0.0945349 + 0.0046898 = 0.3869068 -> / 4 = 0.0967267.
  np.testing.assert_allclose(m['approx_kl'], 0.0967267, rtol=1e-5)
  # Masking the last sample: (2.4 + 1.0 - 1.5) / 3 = 0.6333333.
  loss, m = losses.clipped_surrogate(LOGP, PROX, PROX, ADV, jnp.array([1.0, 1.0, 1.0, 0.0]), ALGO)
  np.testing.assert_allclose(loss, -0.6333333, rtol=1e-5)
  np.testing.assert_allclose(m['clip_fraction'], 1.0)


def test_behaviour_weight_is_clipped():
  # behaviour log-probs below proximal by log 3 and log 1.5 / above by log 2 and 0:
  # w = clip([3, 1.5, 0.5, 1], 0, 2) = [2, 1.5, 0.5, 1];
  # loss = -mean(2*2.4, 1.5*1.0, 0.5*(-1.5), 1*(-1.1)) = -(4.8 + 1.5 - 0.75 - 1.1)/4 = -4.45/4 = -1.1125.
  behaviour = -jnp.log(jnp.array([3.0, 1.5, 0.5, 1.0]))
  loss, m = losses.clipped_surrogate(LOGP, PROX, behaviour, ADV, jnp.ones(4), ALGO)
  np.testing.assert_allclose(loss, -1.1125, rtol=1e-5)
  np.testing.assert_allclose(m['behaviour_weight'], (2 + 1.5 + 0.5 + 1) / 4, rtol=1e-6)
  # The weight is a constant; d r / d logp = r. d loss / d logp_i = -(1/4) w_i (r_i A_i if that branch is the min,
  # else 0 for the clipped constant): i=0 clipped -> 0; i=1 -(1/4)*1.5*(0.5*2) = -0.375;
  # i=2 -(1/4)*0.5*(1.5*-1) = 0.1875; i=3 -(1/4)*1*(1.1*-1) = 0.275.
  g = jax.grad(lambda lp: losses.clipped_surrogate(lp, PROX, behaviour, ADV, jnp.ones(4), ALGO)[0])(LOGP)
  np.testing.assert_allclose(g, [0.0, -0.375, 0.1875, 0.275], rtol=1e-5, atol=1e-7)


def test_extreme_log_ratios_give_finite_loss_and_gradient():
  # A sample whose log-prob moved by 5000 nats (a mean shift of 0.1 at scale 0.001): exp(5000) is inf in float32
  # and the unclamped gradient NaN. With the clamp at 20 the loss is finite and that sample has no gradient.
  logp = jnp.array([5000.0, 0.0, -5000.0, 0.0])
  prox = jnp.zeros(4)
  behaviour = jnp.array([-5000.0, 0.0, 0.0, 0.0])  # its weight exp(5000) is clipped to max_behaviour_ratio
  adv = jnp.array([-1.0, 1.0, 1.0, 1.0])
  loss, m = losses.clipped_surrogate(logp, prox, behaviour, adv, jnp.ones(4), ALGO)
  assert np.isfinite(loss) and all(np.isfinite(float(v)) for v in m.values())
  g = jax.grad(lambda lp: losses.clipped_surrogate(lp, prox, behaviour, adv, jnp.ones(4), ALGO)[0])(logp)
  assert np.all(np.isfinite(g))
  # Samples 0 and 2 sit beyond the clamp: zero gradient. Sample 1 (r = 1, A = 1, w = 1): -(1/4) * 1 * 1 = -0.25.
  np.testing.assert_allclose(g, [0.0, -0.25, 0.0, -0.25], atol=1e-6)


def test_grpo_advantages_two_groups():
  # Group [1, 2, 3]: mean 2, std sqrt(2/3) = 0.8164966 -> [-1.2247449, 0, 1.2247449].
  # Group [10, 10, 40]: mean 20, std sqrt((100 + 100 + 400)/3) = 14.1421356 -> [-0.7071068, -0.7071068, 1.4142136].
  adv = losses.grpo_advantages(jnp.array([1.0, 2.0, 3.0, 10.0, 10.0, 40.0]), group_size=3)
  np.testing.assert_allclose(adv, [-1.2247449, 0.0, 1.2247449, -0.7071068, -0.7071068, 1.4142136], rtol=1e-5)
  with pytest.raises(ValueError, match='group_size'):
    losses.grpo_advantages(jnp.ones(5), group_size=2)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _batch(net, params, key, t, b, obs_dim=5):
  k = jax.random.split(key, 5)
  obs = jax.random.normal(k[0], (t, b, obs_dim))
  flat = gen_stages.act(net, params, obs.reshape(t * b, obs_dim), k[1])
  done = (jax.random.uniform(k[3], (t, b)) < 0.2).astype(jnp.float32)
  truncation = done * (jax.random.uniform(k[4], (t, b)) < 0.5)
  return Transition(obs=obs,
                    raw_action=flat.raw_actions.reshape(t, b, 1, -1),
                    reward=jax.random.normal(k[2], (t, b)),
                    termination=done * (1 - truncation),
                    truncation=truncation,
                    next_obs=obs + 0.1,
                    behaviour_log_prob=flat.log_probs.reshape(t, b),
                    mask=jnp.ones((t, b)),
                    policy_version=jnp.zeros((t, b), jnp.int32))


def test_grpo_loss_hand_case_at_ratio_one():
  net = policies.make_network(PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)), 5, 2)
  params = gen_stages.init_policy_params(net, jax.random.PRNGKey(0), 5)
  batch = _batch(net, params, jax.random.PRNGKey(1), 2, 2)._replace(mask=jnp.array([[1.0, 1.0], [1.0, 0.0]]))
  algo = AlgoConfig(name='grpo', entropy_cost=0.0)
  # proximal = the current log-probs, so ratio = 1 and the loss is -masked_mean(adv broadcast over T):
  # adv [1, -3] -> entries [[1, -3], [1, (masked)]] -> -(1 - 3 + 1)/3 = 1/3.
  loss, m = jax.jit(losses.grpo_loss, static_argnums=(0, 6, 7))(net, params, batch,
                                                                jnp.array([1.0, -3.0]), batch.behaviour_log_prob,
                                                                jax.random.PRNGKey(2), algo, 0.001)
  np.testing.assert_allclose(loss, 1.0 / 3.0, rtol=1e-4)
  assert float(m['value_loss']) == 0.0


def test_ppo_loss_equals_brax_on_policy():
  brax_losses = pytest.importorskip('brax.training.agents.ppo.losses')
  brax_networks = pytest.importorskip('brax.training.agents.ppo.networks')
  rs = pytest.importorskip('brax.training.acme.running_statistics')
  obs_dim, act_dim, t, b = 5, 2, 4, 6
  net = policies.make_network(PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(32, 32)), obs_dim, act_dim)
  params = gen_stages.init_policy_params(net, jax.random.PRNGKey(0), obs_dim)
  batch = _batch(net, params, jax.random.PRNGKey(1), t, b, obs_dim)
  ours_stats = jax.jit(normalization.update_stats)(params.normalizer, batch.obs)
  params = params.replace(normalizer=ours_stats)
  algo = AlgoConfig(entropy_cost=0.0)  # the entropy sample is drawn with differently shaped keys
  loss, m = jax.jit(losses.ppo_loss, static_argnums=(0, 5, 6))(net, params, batch, batch.behaviour_log_prob,
                                                               jax.random.PRNGKey(3), algo, 0.001)

  brax_net = brax_networks.make_ppo_networks(obs_dim, act_dim, rs.normalize, (16, 16), (32, 32))
  brax_params = brax_losses.PPONetworkParams(policy={'params': params.network['params']['policy']},
                                             value={'params': params.network['params']['value']})
  brax_stats = jax.jit(rs.update)(rs.init_state(jnp.zeros((obs_dim,))), batch.obs)
  dist_params = jax.jit(net.apply)(params.network, rs.normalize(batch.obs.reshape(t * b, obs_dim), brax_stats))[0]
  data = brax_testlib.to_brax_transition(brax_losses.types, batch, jnp.swapaxes(dist_params.reshape(t, b, -1), 0, 1))
  brax_loss, bm = jax.jit(
      functools.partial(brax_losses.compute_ppo_loss,
                        ppo_network=brax_net,
                        entropy_cost=0.0,
                        discounting=algo.discount,
                        reward_scaling=algo.reward_scaling,
                        gae_lambda=algo.gae_lambda,
                        clipping_epsilon=algo.clip_epsilon,
                        normalize_advantage=True,
                        vf_coefficient=0.5))(brax_params, brax_stats, data, jax.random.PRNGKey(3))
  np.testing.assert_allclose(m['policy_loss'], bm['policy_loss'], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m['value_loss'], bm['v_loss'], rtol=1e-4)
  np.testing.assert_allclose(loss, brax_loss, rtol=1e-4)
  assert math.isclose(float(m['behaviour_weight']), 1.0, rel_tol=1e-6)


def test_geometric_ratio_is_the_per_value_mean_of_the_joint_log_ratio():
  """--policy_ratio=geometric: a step of 4 action values whose joint log-ratios are 4 x log([1.5, 0.5, 1.5, 1.1])
  has per-value ratios [1.5, 0.5, 1.5, 1.1], so the loss and metrics equal the joint ratio's of the hand-computed
  case above; the behaviour weight is per value too (joint weights 3^4, 1.5^4, 0.5^4, 1 -> w = clip([3, 1.5,
  0.5, 1], 0, 2), loss -1.1125 as in test_behaviour_weight_is_clipped). With one value per step, as joint."""
  geometric = dataclasses.replace(ALGO, policy_ratio='geometric')
  loss, m = losses.clipped_surrogate(4 * LOGP, PROX, PROX, ADV, jnp.ones(4), geometric, values_per_step=4)
  np.testing.assert_allclose(loss, -0.2, rtol=1e-5)
  np.testing.assert_allclose(m['clip_fraction'], 0.75)
  np.testing.assert_allclose(m['approx_kl'], 0.0967267, rtol=1e-5)
  behaviour = -4 * jnp.log(jnp.array([3.0, 1.5, 0.5, 1.0]))
  loss, m = losses.clipped_surrogate(4 * LOGP, PROX, behaviour, ADV, jnp.ones(4), geometric, values_per_step=4)
  np.testing.assert_allclose(loss, -1.1125, rtol=1e-5)
  joint, _ = losses.clipped_surrogate(4 * LOGP, PROX, PROX, ADV, jnp.ones(4), ALGO, values_per_step=4)
  assert not np.isclose(joint, -0.2)  # the joint ratio of the same log-probs is another objective
  one, _ = losses.clipped_surrogate(LOGP, PROX, PROX, ADV, jnp.ones(4), geometric, values_per_step=1)
  np.testing.assert_allclose(one, -0.2, rtol=1e-5)
  with pytest.raises(ValueError, match='policy_ratio'):
    AlgoConfig(policy_ratio="token")
