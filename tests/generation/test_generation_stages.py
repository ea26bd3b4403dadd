"""The act/evaluate stages: shapes, consistency of log-probs, determinism, normalisation, jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax.config import PolicyConfig
from ebrl_jax.generation import distribution, normalization, policies
from ebrl_jax.generation import stages

act_jit = jax.jit(stages.act, static_argnums=(0,), static_argnames=('deterministic', 'min_std'))
evaluate_jit = jax.jit(stages.evaluate, static_argnums=(0, 5))
apply_jit = jax.jit(lambda net, variables, obs: net.apply(variables, obs), static_argnums=(0,))
init_jit = jax.jit(stages.init_policy_params, static_argnums=(0, 2, 3))


def _setup(kind='mlp', k=1, normalize=True):
  cfg = PolicyConfig(kind=kind, d_model=16, num_layers=1, num_heads=2, action_chunk=k, normalize_observations=normalize)
  net = policies.make_network(cfg, 7, 3)
  return net, init_jit(net, jax.random.PRNGKey(0), 7, normalize)


def test_act_shapes_and_log_probs_match_evaluate():
  for kind, k in (('mlp', 1), ('transformer', 2)):
    net, params = _setup(kind, k)
    obs = jax.random.normal(jax.random.PRNGKey(1), (5, 7))
    out = act_jit(net, params, obs, jax.random.PRNGKey(2))
    assert out.actions.shape == out.raw_actions.shape == (5, k, 3)
    assert out.log_probs.shape == out.values.shape == (5,)
    np.testing.assert_allclose(out.actions, jnp.tanh(out.raw_actions), rtol=1e-6)
    ev = evaluate_jit(net, params, obs, out.raw_actions, jax.random.PRNGKey(3), 0.001)
    np.testing.assert_allclose(ev.log_probs, out.log_probs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ev.values, out.values, rtol=1e-5, atol=1e-6)
    # log_probs sum over K and A: recompute by hand from the network output.
    dp, _ = apply_jit(net, params.network, obs)
    loc, scale = distribution.split_params(dp, 0.001)
    manual = jnp.sum(distribution.log_prob(loc, scale, out.raw_actions), axis=-1)
    np.testing.assert_allclose(out.log_probs, manual, rtol=1e-5, atol=1e-5)


def test_deterministic_is_tanh_of_mean_and_key_independent():
  net, params = _setup()
  obs = jnp.ones((2, 7))
  a = act_jit(net, params, obs, jax.random.PRNGKey(0), deterministic=True)
  b = act_jit(net, params, obs, jax.random.PRNGKey(1), deterministic=True)
  np.testing.assert_array_equal(a.actions, b.actions)
  dp, _ = apply_jit(net, params.network, obs)
  np.testing.assert_allclose(a.actions, jnp.tanh(dp[..., :3]), rtol=1e-6)


def test_normalizer_is_applied_only_when_enabled():
  obs = jax.random.normal(jax.random.PRNGKey(1), (4, 7)) * 5 + 2
  stats = normalization.update_stats(normalization.init_stats(7), obs)
  for enabled in (True, False):
    net, params = _setup(normalize=enabled)
    params = params.replace(normalizer=stats)
    out = act_jit(net, params, obs, jax.random.PRNGKey(0), deterministic=True)
    net_in = normalization.normalize(stats, obs) if enabled else obs
    np.testing.assert_allclose(out.values, apply_jit(net, params.network, net_in)[1], rtol=1e-5)


def test_init_policy_params_takes_normalize_observations_from_the_policy_config():
  """Before the fix the params of a network made from PolicyConfig(normalize_observations=False) normalised."""
  raw = policies.make_network(PolicyConfig(normalize_observations=False), 7, 3)
  params = jax.eval_shape(lambda: stages.init_policy_params(raw, jax.random.PRNGKey(0), 7))
  assert params.normalize_observations is False
  assert raw.normalize_observations is False and policies.make_network(PolicyConfig(), 7, 3).normalize_observations
  assert stages.normalizes_observations(raw) is False and stages.normalizes_observations(raw, False) is False
  with pytest.raises(ValueError, match='normalize_observations=True contradicts'):
    stages.normalizes_observations(raw, True)
