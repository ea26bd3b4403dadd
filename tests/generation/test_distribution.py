"""Tanh-Gaussian: hand values, a numerical change-of-variables check, stability, and Brax parity."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax.generation import distribution as dist


def test_log_prob_hand_values():
  # loc 0, scale 1, raw 0: log N(0; 0, 1) = -0.5 log(2 pi) = -0.9189385; log(1 - tanh(0)^2) = 0.
  np.testing.assert_allclose(dist.log_prob(jnp.zeros(1), jnp.ones(1), jnp.zeros(1)), -0.9189385, rtol=1e-6)
  # loc 0.5, scale 2, raw 1: z = 0.25, log N = -0.03125 - log 2 - 0.9189385 = -1.6433357;
  # tanh(1) = 0.7615942, log(1 - 0.5800257) = log(0.4199743) = -0.8675616; log p = -1.6433357 + 0.8675616.
  np.testing.assert_allclose(dist.log_prob(jnp.array([0.5]), jnp.array([2.0]), jnp.array([1.0])), -0.7757741, rtol=1e-5)
  # Two action dims sum: -0.9189385 + -0.7757741 = -1.6947126.
  np.testing.assert_allclose(dist.log_prob(jnp.array([0.0, 0.5]), jnp.array([1.0, 2.0]), jnp.array([0.0, 1.0])),
                             -1.6947126,
                             rtol=1e-5)


def test_log_prob_matches_numerical_change_of_variables():
  # P(tanh(U) <= y) = Phi((atanh(y) - loc) / scale); its finite-difference derivative is the density of y.
  loc, scale = 0.3, 0.7
  for y in (-0.9, -0.2, 0.0, 0.5, 0.95):
    cdf = lambda v: 0.5 * (1.0 + math.erf((math.atanh(v) - loc) / (scale * math.sqrt(2.0))))
    h = 1e-6
    density = (cdf(y + h) - cdf(y - h)) / (2 * h)
    ours = dist.log_prob(jnp.array([loc]), jnp.array([scale]), jnp.array([math.atanh(y)]))
    np.testing.assert_allclose(float(ours), math.log(density), rtol=1e-4, atol=1e-4)


def test_log_det_jacobian_is_finite_where_tanh_saturates():
  raw = jnp.array([-30.0, 20.0])
  ldj = dist.tanh_log_det_jacobian(raw)
  assert np.all(np.isfinite(ldj))
  # For large |u|: log(1 - tanh^2 u) ~ log 4 - 2|u| = 1.3862944 - 2|u|.
  np.testing.assert_allclose(ldj, [1.3862944 - 60.0, 1.3862944 - 40.0], rtol=1e-6)
  # The naive form is -inf there: this is why the stable form is used.
  with np.errstate(divide="ignore"):
    assert np.isneginf(np.log(1.0 - np.tanh(np.float32(20.0))**2))


def test_split_params_and_mode():
  loc, scale = dist.split_params(jnp.array([0.5, 0.0]), min_std=0.001)
  # softplus(0) = log 2 = 0.6931472, + 0.001.
  np.testing.assert_allclose(scale, [0.6941472], rtol=1e-6)
  np.testing.assert_allclose(dist.mode(loc), [math.tanh(0.5)], rtol=1e-6)


def test_entropy_is_gaussian_entropy_plus_sampled_jacobian():
  key = jax.random.PRNGKey(3)
  loc, scale = jnp.array([0.1, -0.2]), jnp.array([0.5, 1.5])
  raw = dist.sample_raw(loc, scale, key)
  # H = sum_a [0.5 + 0.5 log(2 pi) + log scale_a + log(1 - tanh(raw_a)^2)] with the same sample.
  expected = np.sum(0.5 + 0.9189385 + np.log(scale) + np.log(1.0 - np.tanh(raw)**2))
  np.testing.assert_allclose(dist.entropy(loc, scale, key), expected, rtol=1e-5)
  # The estimate is unbiased: its average approaches E[-log p(tanh U)] estimated from the same samples.
  keys = jax.random.split(key, 20000)
  h = jax.vmap(lambda k: dist.entropy(loc, scale, k))(keys)
  neg_logp = jax.vmap(lambda k: -dist.log_prob(loc, scale, dist.sample_raw(loc, scale, k)))(keys)
  np.testing.assert_allclose(h.mean(), neg_logp.mean(), atol=0.02)


def test_matches_brax_normal_tanh():
  brax_dist = pytest.importorskip('brax.training.distribution')
  d = brax_dist.NormalTanhDistribution(event_size=3, min_std=0.001)
  params = jax.random.normal(jax.random.PRNGKey(0), (5, 6))
  raw = jax.random.normal(jax.random.PRNGKey(1), (5, 3)) * 2
  loc, scale = dist.split_params(params, 0.001)
  np.testing.assert_allclose(dist.log_prob(loc, scale, raw), d.log_prob(params, raw), rtol=1e-5, atol=1e-5)
  key = jax.random.PRNGKey(2)
  np.testing.assert_allclose(dist.entropy(loc, scale, key), d.entropy(params, key), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dist.sample_raw(loc, scale, key),
                             d.sample_no_postprocessing(params, key),
                             rtol=1e-6,
                             atol=1e-6)
