"""Running observation statistics vs numpy, with masks, clipping, and Brax parity."""
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax.generation import normalization as norm


def test_init_is_identity():
  stats = norm.init_stats(3)
  x = jnp.array([[1.0, -2.0, 3.0]])
  np.testing.assert_array_equal(norm.normalize(stats, x), x)


def test_matches_numpy_over_several_batches():
  rng = np.random.default_rng(0)
  batches = [rng.normal(3.0, 2.0, size=(4, 5, 6)).astype(np.float32) for _ in range(3)]
  batches.append(rng.normal(-1.0, 0.5, size=(7, 6)).astype(np.float32))  # a different leading shape
  stats = norm.init_stats(6)
  for b in batches:
    stats = norm.update_stats(stats, jnp.asarray(b))
  everything = np.concatenate([b.reshape(-1, 6) for b in batches])
  assert float(stats.count) == 3 * 20 + 7
  np.testing.assert_allclose(stats.mean, everything.mean(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats.std, everything.std(0), rtol=1e-5)  # population std, as Brax
  x = jnp.asarray(batches[0][0])
  np.testing.assert_allclose(norm.normalize(stats, x), (batches[0][0] - everything.mean(0)) / everything.std(0),
                             rtol=1e-4,
                             atol=1e-5)


def test_mask_drops_observations():
  # Batch [[1, 2], [100, 4]] (O = 1... laid out [T=2, B=2, O=1]) with the 100 masked out:
  # kept values 1, 2, 4 -> mean 7/3 = 2.3333333, population var ((4/3)^2 + (1/3)^2 + (5/3)^2)/3 = 42/27 = 1.5555556.
  obs = jnp.array([[[1.0], [2.0]], [[100.0], [4.0]]])
  mask = jnp.array([[1.0, 1.0], [0.0, 1.0]])
  stats = norm.update_stats(norm.init_stats(1), obs, mask)
  assert float(stats.count) == 3.0
  np.testing.assert_allclose(stats.mean, [7.0 / 3.0], rtol=1e-6)
  np.testing.assert_allclose(stats.std, [np.sqrt(42.0 / 27.0)], rtol=1e-6)
  # An all-masked batch changes nothing (and produces no NaN).
  same = norm.update_stats(stats, obs, jnp.zeros((2, 2)))
  np.testing.assert_allclose(same.mean, stats.mean)
  np.testing.assert_allclose(same.std, stats.std)
  empty = norm.update_stats(norm.init_stats(1), obs, jnp.zeros((2, 2)))
  np.testing.assert_array_equal(empty.std, [1.0])
  np.testing.assert_array_equal(empty.mean, [0.0])


def test_std_is_clipped_for_constant_features():
  stats = norm.update_stats(norm.init_stats(2), jnp.array([[5.0, 1.0], [5.0, 3.0]]))
  np.testing.assert_allclose(stats.std, [1e-6, 1.0], rtol=1e-6)


def test_matches_brax_running_statistics():
  rs = pytest.importorskip('brax.training.acme.running_statistics')
  rng = np.random.default_rng(1)
  ours, theirs = norm.init_stats(4), rs.init_state(jnp.zeros((4,)))
  for _ in range(3):
    b = jnp.asarray(rng.normal(1.0, 3.0, size=(8, 5, 4)).astype(np.float32))
    ours, theirs = norm.update_stats(ours, b), rs.update(theirs, b)
  np.testing.assert_allclose(ours.mean, theirs.mean, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ours.std, theirs.std, rtol=1e-6)
  np.testing.assert_allclose(ours.summed_variance, theirs.summed_variance, rtol=1e-6)
