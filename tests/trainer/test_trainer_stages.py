"""train_step: runs jitted, learns on a tiny batch, bookkeeping, GRPO, and one-step parity with Brax's SGD."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ebrl_jax import config_checks
from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.trainer import stages
from ebrl_jax.types import Transition

import brax_testlib  # pylint: disable=g-bad-import-order

OBS, ACT, T, S = 5, 2, 4, 8
NET = policies.make_network(PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(32, 32)), OBS, ACT)
RAW_NET = policies.make_network(
    PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(32, 32), normalize_observations=False), OBS, ACT)
train_jit = jax.jit(stages.train_step,
                    static_argnums=(0, 1, 2, 3),
                    static_argnames=('group_size', 'recompute_proximal'),
                    donate_argnums=(4,))


@functools.partial(jax.jit, static_argnums=(0,))
def _batch(net, params, key):
  k = jax.random.split(key, 4)
  obs = jax.random.normal(k[0], (T, S, OBS)) * 3.0 + 1.0
  out = gen_stages.act(net, params, obs.reshape(T * S, OBS), k[1])
  truncation = (jax.random.uniform(k[3], (T, S)) < 0.1).astype(jnp.float32)
  return Transition(obs=obs,
                    raw_action=out.raw_actions.reshape(T, S, 1, ACT),
                    reward=jax.random.normal(k[2], (T, S)),
                    termination=jnp.zeros((T, S)),
                    truncation=truncation,
                    next_obs=obs + 0.1,
                    behaviour_log_prob=out.log_probs.reshape(T, S),
                    mask=jnp.ones((T, S)),
                    policy_version=jnp.zeros((T, S), jnp.int32))


def _shapes(tree):
  return jax.tree_util.tree_structure(tree), [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(tree)]


def test_ppo_train_step_learns_and_keeps_bookkeeping():
  algo = AlgoConfig(batch_size=4,
                    num_minibatches=2,
                    num_updates_per_batch=2,
                    unroll_length=T,
                    max_grad_norm=1.0,
                    learning_rate=3e-3,
                    reward_scaling=1.0)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(NET, optimizer, jax.random.PRNGKey(0), OBS)
  # Every step terminates with reward 1: value targets are exactly vs = 1 (no bootstrap), so the
  # value-dominated loss must fall.
  batch = _batch(NET, state.params, jax.random.PRNGKey(1))._replace(reward=jnp.ones((T, S)),
                                                                    termination=jnp.ones((T, S)))
  before = _shapes(state)
  losses = []
  for i in range(8):
    state, metrics = train_jit(NET, optimizer, algo, 0.001, state, batch, jax.random.PRNGKey(10 + i))
    losses.append(float(metrics['total_loss']))
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses  # mostly the value loss on a fixed batch
  assert _shapes(state) == before
  assert int(state.policy_version) == 8
  assert int(state.num_updates) == 8 * 2 * 2  # steps x epochs x minibatches
  # The normaliser took in every observation once per step, before SGD: 8 x T x S.
  assert float(state.params.normalizer.count) == 8 * T * S
  np.testing.assert_allclose(state.params.normalizer.mean, batch.obs.reshape(-1, OBS).mean(0), rtol=1e-4)
  assert set(metrics) >= {
      'total_loss', 'policy_loss', 'value_loss', 'entropy_loss', 'approx_kl', 'clip_fraction', 'behaviour_weight',
      'grad_norm'
  }


def test_first_step_is_on_policy():
  algo = AlgoConfig(batch_size=4, num_minibatches=2, num_updates_per_batch=1, unroll_length=T)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(NET, optimizer, jax.random.PRNGKey(0), OBS)
  batch = _batch(NET, state.params, jax.random.PRNGKey(1))
  _, metrics = train_jit(NET, optimizer, algo, 0.001, state, batch, jax.random.PRNGKey(2))
  # The proximal log-probs are recomputed with the params that produced the batch: w = 1 (to rounding).
  np.testing.assert_allclose(metrics['behaviour_weight'], 1.0, rtol=1e-5)


def test_minibatch_shuffle_is_one_permutation_of_segments():
  x = jnp.arange(3)[:, None] * 100 + jnp.arange(8)[None, :]  # [T=3, S=8], x[t, s] = 100 t + s
  (mb,), seg = stages._shuffle_into_minibatches(jax.random.PRNGKey(0), (x,), jnp.arange(8), 4)
  assert mb.shape == (4, 3, 2) and seg.shape == (4, 2)
  np.testing.assert_array_equal(np.sort(seg.reshape(-1)), np.arange(8))  # every segment exactly once
  np.testing.assert_array_equal(mb, jnp.arange(3)[None, :, None] * 100 + seg[:, None, :])  # same permutation
  assert not np.array_equal(seg.reshape(-1), np.arange(8))  # actually shuffled (for this key)


def test_grpo_train_step_leaves_the_critic_alone():
  algo = AlgoConfig(name='grpo', batch_size=4, num_minibatches=2, num_updates_per_batch=2)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(RAW_NET, optimizer, jax.random.PRNGKey(0), OBS, normalize_observations=False)
  batch = _batch(RAW_NET, state.params, jax.random.PRNGKey(1))
  value_before = jax.tree_util.tree_map(np.asarray, state.params.network['params']['value'])
  policy_before = jax.tree_util.tree_map(np.asarray, state.params.network['params']['policy'])
  state, metrics = train_jit(RAW_NET, optimizer, algo, 0.001, state, batch, jax.random.PRNGKey(2), group_size=2)
  assert int(state.policy_version) == 1 and float(metrics['value_loss']) == 0.0
  jax.tree_util.tree_map(np.testing.assert_array_equal, state.params.network['params']['value'], value_before)
  changed = jax.tree_util.tree_map(lambda a, b: not np.array_equal(a, b), state.params.network['params']['policy'],
                                   policy_before)
  assert all(jax.tree_util.tree_leaves(changed))
  assert float(state.params.normalizer.count) == 0.0  # normalisation disabled: statistics untouched


def test_one_sgd_step_matches_brax():
  brax_losses = pytest.importorskip('brax.training.agents.ppo.losses')
  brax_networks = pytest.importorskip('brax.training.agents.ppo.networks')
  rs = pytest.importorskip('brax.training.acme.running_statistics')
  # One epoch, one minibatch, no entropy term (its sample depends on key handling): Brax's update is
  # normaliser update, then grad of compute_ppo_loss, then Adam.
  algo = AlgoConfig(batch_size=S, num_minibatches=1, num_updates_per_batch=1, unroll_length=T, entropy_cost=0.0)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(NET, optimizer, jax.random.PRNGKey(0), OBS)
  batch = _batch(NET, state.params, jax.random.PRNGKey(1))
  net_params = state.params.network['params']
  brax_params = brax_losses.PPONetworkParams(policy={'params': net_params['policy']},
                                             value={'params': net_params['value']})
  new_state, _ = jax.jit(stages.train_step, static_argnums=(0, 1, 2, 3),
                         static_argnames=('recompute_proximal',))(NET,
                                                                  optimizer,
                                                                  algo,
                                                                  0.001,
                                                                  state,
                                                                  batch,
                                                                  jax.random.PRNGKey(2),
                                                                  recompute_proximal=False)

  brax_net = brax_networks.make_ppo_networks(OBS, ACT, rs.normalize, (16, 16), (32, 32))
  data = brax_testlib.to_brax_transition(brax_losses.types, batch, jnp.zeros((S, T, 2 * ACT)))

  @jax.jit
  def brax_step(params, key):
    stats = rs.update(rs.init_state(jnp.zeros((OBS,))), data.observation)
    loss = functools.partial(brax_losses.compute_ppo_loss,
                             ppo_network=brax_net,
                             entropy_cost=0.0,
                             discounting=algo.discount,
                             reward_scaling=algo.reward_scaling,
                             gae_lambda=algo.gae_lambda,
                             clipping_epsilon=algo.clip_epsilon,
                             vf_coefficient=0.5)
    grads, _ = jax.grad(loss, has_aux=True)(params, stats, data, key)
    opt = optax.adam(algo.learning_rate)
    updates, _ = opt.update(grads, opt.init(params))
    return optax.apply_updates(params, updates), stats

  brax_new, brax_stats = brax_step(brax_params, jax.random.PRNGKey(2))
  np.testing.assert_allclose(new_state.params.normalizer.mean, brax_stats.mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_state.params.normalizer.std, brax_stats.std, rtol=1e-5)
  ours = new_state.params.network['params']
  # Adam's first step moves every weight by ~lr * sign(grad): compare to 1% of the learning rate.
  for name, theirs in (('policy', brax_new.policy), ('value', brax_new.value)):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-6), ours[name], theirs['params'])


TOKEN_K, TOKEN_BINS = 2, 16
TOKEN_NET = policies.make_network(
    PolicyConfig(kind='token',
                 d_model=16,
                 num_layers=1,
                 num_heads=2,
                 mlp_ratio=2,
                 num_bins=TOKEN_BINS,
                 action_chunk=TOKEN_K), OBS, ACT)


@functools.partial(jax.jit, static_argnums=(0,))
def _token_batch(net, params, key):
  """A [T, S] batch acted by the token policy: raw_action holds its float32 token ids [T, S, K, A]."""
  k = jax.random.split(key, 3)
  obs = jax.random.normal(k[0], (T, S, OBS)) * 3.0 + 1.0
  out = gen_stages.act(net, params, obs.reshape(T * S, OBS), k[1])
  return Transition(obs=obs,
                    raw_action=out.raw_actions.reshape(T, S, TOKEN_K, ACT),
                    reward=jax.random.normal(k[2], (T, S)),
                    termination=jnp.zeros((T, S)),
                    truncation=jnp.zeros((T, S)),
                    next_obs=obs + 0.1,
                    behaviour_log_prob=out.log_probs.reshape(T, S),
                    mask=jnp.ones((T, S)),
                    policy_version=jnp.zeros((T, S), jnp.int32))


@pytest.mark.contract  # a whole train step compiled: over the unit tier's ~3 s
@pytest.mark.slow
@pytest.mark.parametrize('algo_name', ['ppo', 'grpo'])
def test_token_policy_train_step_runs_and_moves_the_params(algo_name):
  algo = AlgoConfig(name=algo_name,
                    batch_size=4,
                    num_minibatches=2,
                    num_updates_per_batch=1,
                    unroll_length=T * TOKEN_K,
                    learning_rate=1e-3)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(TOKEN_NET, optimizer, jax.random.PRNGKey(0), OBS)
  batch = _token_batch(TOKEN_NET, state.params, jax.random.PRNGKey(1))
  ids = np.asarray(batch.raw_action)
  assert batch.raw_action.dtype == jnp.float32 and np.array_equal(ids, np.round(ids))
  assert ids.min() >= 0 and ids.max() <= TOKEN_BINS - 1 and len(np.unique(ids)) > 1
  before = jax.tree_util.tree_map(np.asarray, state.params.network)
  state, metrics = train_jit(TOKEN_NET, optimizer, algo, 0.001, state, batch, jax.random.PRNGKey(2), group_size=2)
  assert int(state.policy_version) == 1
  assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
  # On-policy: the proximal log-probs recomputed from the float32 ids equal the acting ones (w = 1).
  np.testing.assert_allclose(metrics['behaviour_weight'], 1.0, rtol=1e-5)
  assert float(metrics['entropy']) > 0.0  # categorical entropy over 16 bins, K x A tokens per step
  head = state.params.network['params']['action_head']['kernel']
  assert not np.array_equal(np.asarray(head), before['params']['action_head']['kernel'])
  value_head = state.params.network['params']['value_mlp']['hidden_0']['kernel']  # --critic=auto: the MLP critic
  moved = not np.array_equal(np.asarray(value_head), before['params']['value_mlp']['hidden_0']['kernel'])
  assert moved == (algo_name == 'ppo')  # GRPO trains no critic; PPO's value loss moves the critic


@pytest.mark.parametrize('kind', ['mlp', 'transformer', 'token'])
def test_jitted_init_equals_the_op_by_op_init(kind):
  """The driver initialises through `init_fn` jitted (one program, not one dispatch per op): the same state, bit
  for bit, as `init_train_state` run eagerly."""
  policy = PolicyConfig(kind=kind,
                        d_model=32,
                        num_layers=1,
                        num_heads=2,
                        policy_hidden_sizes=(16,),
                        value_hidden_sizes=(16,))
  net = policies.make_network(policy, 12, 3)
  opt = stages.make_optimizer(AlgoConfig())
  key = jax.random.PRNGKey(5)
  eager = stages.init_train_state(net, opt, key, 12)
  jitted = jax.jit(stages.init_fn(net, opt, 12))(key)
  assert jax.tree.structure(eager) == jax.tree.structure(jitted)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_batch_whose_shapes_are_off_is_refused_naming_the_field():
  """Before the fix only next_obs's rank was checked: a [T + 1, S, O] next_obs stack bootstrapped from the wrong
  step without a word, one with fewer segments than obs left NaN parameters; an obs of the wrong width
  broadcast against the normaliser's statistics in act."""
  cfg = AlgoConfig(batch_size=2, num_minibatches=4, num_updates_per_batch=1, unroll_length=T)
  opt = stages.make_optimizer(cfg)
  state = stages.init_train_state(NET, opt, jax.random.PRNGKey(0), OBS)
  batch = _batch(NET, state.params, jax.random.PRNGKey(1))
  cases = [
      (batch._replace(next_obs=jnp.concatenate([batch.next_obs, batch.next_obs[-1:]])),
       'Transition.next_obs has shape'),
      (batch._replace(next_obs=batch.next_obs[:, :S - 4]), 'Transition.next_obs has shape (4, 4, 5); every field'),
      (batch._replace(raw_action=batch.raw_action[:, :,
                                                  0]), "Transition.raw_action has shape (4, 8, 2); a segment's is"),
      (batch._replace(mask=batch.mask[:, :1]), "Transition.mask has shape (4, 1); every field leads with reward's"),
      (batch._replace(reward=batch.reward[..., None]), 'Transition.reward must be [T, S]; got shape (4, 8, 1).'),
  ]
  for bad, words in cases:
    with pytest.raises(ValueError, match=words.replace('(', r'\(').replace(')', r'\)').replace('[', r'\[')):
      train_jit(NET, opt, cfg, 1e-3, state, bad, jax.random.PRNGKey(2))
  with pytest.raises(ValueError, match=r'obs has 1 features \(shape \(8, 1\)\); these params were initialised for 5'):
    gen_stages.act(NET, state.params, jnp.ones((8, 1)), jax.random.PRNGKey(3))


def test_a_batch_that_disagrees_with_the_algo_config_is_refused_naming_the_flag():
  """Before the fix train_step read neither --unroll_length nor --batch_size: a batch of another T, or of another
  S (minibatches of S / num_minibatches segments, not batch_size), trained as it came. Checked while tracing, so
  `eval_shape` shows it without compiling."""
  opt = stages.make_optimizer(AlgoConfig())
  state = stages.init_train_state(NET, opt, jax.random.PRNGKey(0), OBS)
  batch = _batch(NET, state.params, jax.random.PRNGKey(1))  # T = 4, S = 8, K = 1
  cases = [
      (AlgoConfig(batch_size=4, num_minibatches=2, unroll_length=5),
       '--unroll_length=5 actions a segment expects T = 5 policy steps of K=1 actions; the batch has T=4'),
      (AlgoConfig(batch_size=2, num_minibatches=2,
                  unroll_length=T), '--batch_size=2 x --num_minibatches=2 expects S=4 segments; the batch has S=8.'),
      (AlgoConfig(name='grpo', num_minibatches=3), "the batch's S=8 segments do not split into --num_minibatches=3."),
  ]
  for algo, words in cases:
    with pytest.raises(ValueError, match=re.escape(words)):
      jax.eval_shape(functools.partial(stages.train_step, NET, opt, algo, 1e-3), state, batch, jax.random.PRNGKey(2))
  # K actions per policy step: T x K env steps make the unroll (T = 8 / 2 = 4).
  chunked = AlgoConfig(batch_size=4, num_minibatches=2, unroll_length=8)
  config_checks.check_batch_shape(chunked, 4, 8, 2)
  with pytest.raises(ValueError, match=re.escape('expects T = 4 policy steps of K=2 actions; the batch has T=8')):
    config_checks.check_batch_shape(chunked, 8, 8, 2)
  # What the config does not fix is taken as it comes: GRPO's T and S (the episode's and the envs'), and a
  # data-parallel rank's share of the segments (here 2 of 8), which still splits into the minibatches.
  config_checks.check_batch_shape(AlgoConfig(name='grpo', num_minibatches=2), 7, 6, 1)
  config_checks.check_batch_shape(chunked, 4, 2, 2, rank_share=True)
  with pytest.raises(ValueError, match=re.escape("S=3 segments do not split into --num_minibatches=2")):
    config_checks.check_batch_shape(chunked, 4, 3, 2, rank_share=True)


def test_init_takes_normalize_observations_from_the_networks_policy_config():
  """Before the fix make_network dropped PolicyConfig.normalize_observations and init_train_state's own default
  (True) normalised a policy configured not to; the network now carries the config's value to the init, and an
  explicit argument that contradicts it is refused."""
  opt = stages.make_optimizer(AlgoConfig())
  key = jax.random.PRNGKey(0)

  def normalizes(net, **kw):
    return jax.eval_shape(lambda: stages.init_train_state(net, opt, key, OBS, **kw)).params.normalize_observations

  assert normalizes(RAW_NET) is False and normalizes(NET) is True
  assert (RAW_NET.normalize_observations, NET.normalize_observations) == (False, True)
  assert jax.eval_shape(stages.init_fn(RAW_NET, opt, OBS), key).params.normalize_observations is False
  assert normalizes(RAW_NET, normalize_observations=False) is False  # the explicit argument, agreeing
  by_hand = policies.MLPActorCritic((16,), (16,), ACT)  # no PolicyConfig behind it: the argument decides
  assert normalizes(by_hand) is True and normalizes(by_hand, normalize_observations=False) is False
  for net, value in ((RAW_NET, True), (NET, False)):
    words = f"normalize_observations={value} contradicts the network's PolicyConfig(normalize_observations={not value})"
    with pytest.raises(ValueError, match=re.escape(words)):
      normalizes(net, normalize_observations=value)
