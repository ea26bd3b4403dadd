"""trainer.stages' unrolled epoch and minibatch loops (`train_step(..., unroll=True)`: on XLA:CPU a convolution
inside a loop runs ~27x slower, results/cpu_conv_loop_2cpu.json): `_scan` with `unroll` (the steps traced one after
the other, no loop) computes what `lax.scan` computes, a pixel train step unrolled equals the rolled one, and
`train_step` stays rolled unless asked (unrolled memory grows with the steps)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax.generation import policies
from ebrl_jax.trainer import stages
from experiments import cpu_conv_loop


def test_unrolled_scan_equals_lax_scan():

  def step(carry, x):
    total, last = carry
    return (total + x['a'] * x['b'], x['b']), {'sq': x['a']**2, 'pair': (x['a'], -x['b'])}

  xs = {'a': jnp.arange(5.0), 'b': jnp.arange(5.0, 10.0)}
  carry = (jnp.zeros(()), jnp.zeros(()))
  want = jax.lax.scan(step, carry, xs)
  got = stages._scan(step, carry, xs, unroll=True)  # pylint: disable=protected-access
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(g, w)


def _setup(obs_dim=5, shape=(16, 16, 6), pixels=True):
  policy = config_lib.PolicyConfig(kind='mlp',
                                   cnn_channels=(4, 8),
                                   cnn_blocks=1,
                                   d_model=16,
                                   policy_hidden_sizes=(16,),
                                   value_hidden_sizes=(16,))
  algo = config_lib.AlgoConfig(batch_size=2, num_minibatches=2, num_updates_per_batch=2, unroll_length=4)
  shape = shape if pixels else ()
  network = policies.make_network(policy, obs_dim, 2, shape)
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), obs_dim, True, shape)
  batch = cpu_conv_loop.random_batch(4, 4, obs_dim, 2, shape)
  return network, optimizer, algo, state, batch


def _step(network, optimizer, algo, unroll):
  return jax.jit(functools.partial(stages.train_step, network, optimizer, algo, 1e-3, unroll=unroll))


def test_pixel_train_step_unrolled_equals_rolled():
  network, optimizer, algo, state, batch = _setup()
  key = jax.random.PRNGKey(3)
  rolled, rolled_metrics = _step(network, optimizer, algo, False)(state, batch, key)
  unrolled, unrolled_metrics = _step(network, optimizer, algo, True)(state, batch, key)
  assert int(unrolled.num_updates) == int(rolled.num_updates) == 4  # 2 epochs x 2 minibatches
  for g, w in zip(jax.tree_util.tree_leaves(unrolled.params), jax.tree_util.tree_leaves(rolled.params)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert not np.array_equal(
      jax.tree_util.tree_leaves(unrolled.params.network)[0],
      jax.tree_util.tree_leaves(state.params.network)[0])  # the step moved the network
  for name in ('total_loss', 'approx_kl', 'grad_norm'):
    np.testing.assert_allclose(unrolled_metrics[name], rolled_metrics[name], rtol=1e-5, atol=1e-6)


def test_train_step_is_rolled_unless_asked():
  key = jax.random.PRNGKey(3)
  for pixels in (True, False):
    network, optimizer, algo, state, batch = _setup(pixels=pixels)
    default = jax.jit(functools.partial(stages.train_step, network, optimizer, algo, 1e-3))
    text = {u: _step(network, optimizer, algo, u).lower(state, batch, key).as_text() for u in (True, False)}
    assert default.lower(state, batch, key).as_text() == text[False] != text[True], pixels
