"""--max_update_kl: a step that takes the approx KL past the bound is undone and the iteration's later steps are
skipped; far from the bound the guarded step is the plain one, bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from ebrl_jax.config import AlgoConfig
from ebrl_jax.trainer import stages

import test_trainer_stages as tts  # pylint: disable=g-bad-import-order


@struct.dataclass
class _Params:
  network: jax.Array


def test_the_step_past_the_bound_is_undone_and_the_rest_skipped():
  """SGD at rate 1 on gradients 1, 2, 3, 4, 5: w = -1, -3, -6, ... The KL measured before step 3 (after step 2,
  at w = -6) is 0.4 above the first step's: step 2 is undone (w back to -3) and steps 3 and 4 are skipped."""
  algo = AlgoConfig(max_update_kl=0.1)
  optimizer = optax.sgd(1.0)
  params, opt_state = _Params(jnp.zeros(())), optimizer.init(jnp.zeros(()))
  guard = stages.init_kl_guard(params.network)
  trace = []
  for grad, kl in zip([1.0, 2.0, 3.0, 4.0, 5.0], [0.5, 0.52, 0.56, 0.9, 0.6]):
    params, opt_state, guard = stages._guarded_update(algo, optimizer, params, opt_state, guard, jnp.array(grad),
                                                      jnp.array(kl))
    trace.append(float(params.network))
  assert trace == [-1.0, -3.0, -6.0, -3.0, -3.0]
  assert (int(guard.applied), bool(guard.stopped), float(guard.base_kl)) == (2, True, 0.5)


def test_no_stop_within_the_bound():
  algo = AlgoConfig(max_update_kl=0.1)
  optimizer = optax.sgd(1.0)
  params, opt_state = _Params(jnp.zeros(())), optimizer.init(jnp.zeros(()))
  guard = stages.init_kl_guard(params.network)
  for grad, kl in zip([1.0, 2.0, 3.0], [0.5, 0.55, 0.599]):
    params, opt_state, guard = stages._guarded_update(algo, optimizer, params, opt_state, guard, jnp.array(grad),
                                                      jnp.array(kl))
  assert (float(params.network), int(guard.applied), bool(guard.stopped)) == (-6.0, 3, False)


def test_an_undone_first_adam_step_does_not_freeze_training():
  """Adam's first step moves a parameter by the whole learning rate whatever its gradient's size; later steps on a
  noisy gradient (its sign alternating from iteration to iteration here) are smaller. Iterations of two steps,
  the KL a step causes standing in as (its change / lr)^2, bound 0.5: the first iteration's first step (a move of
  1.0) is undone and its second skipped, but the optimizer's statistics take in both gradients, so the next
  iterations' steps are small and kept. Had the undo restored them with the network, every iteration would start
  from a fresh Adam and be undone (W2 froze for 42.7 M env steps so)."""
  algo = AlgoConfig(max_update_kl=0.5)
  optimizer = optax.adam(1.0)
  params, opt_state = _Params(jnp.zeros(())), optimizer.init(jnp.zeros(()))
  kept = []
  for i in range(5):
    start = float(params.network)
    guard = stages.init_kl_guard(params.network)
    for step in range(2):
      kl = jnp.array(0.0 if step == 0 else (float(params.network) - start)**2)
      params, opt_state, guard = stages._guarded_update(algo, optimizer, params, opt_state, guard, jnp.array((-1.0)**i),
                                                        kl)
    kept.append(int(guard.applied))
  assert kept == [0, 2, 2, 2, 2], kept
  assert abs(float(params.network)) > 0.1
  assert int(opt_state[0].count) == 10  # every step's gradient, undone and skipped ones included


def _train(algo, lr=3e-3):
  optimizer = stages.make_optimizer(algo)
  state = stages.init_train_state(tts.NET, optimizer, jax.random.PRNGKey(0), tts.OBS)
  initial = jax.tree_util.tree_map(np.asarray, state.params.network)
  batch = tts._batch(tts.NET, state.params, jax.random.PRNGKey(1))
  state, metrics = tts.train_jit(tts.NET, optimizer, algo, 0.001, state, batch, jax.random.PRNGKey(2))
  return initial, state, metrics


_ALGO = dict(batch_size=4,
             num_minibatches=2,
             num_updates_per_batch=3,
             unroll_length=tts.T,
             learning_rate=3e-2,
             max_grad_norm=1.0)


def test_far_bound_is_the_unguarded_step_bit_for_bit():
  _, plain, _ = _train(AlgoConfig(**_ALGO))
  _, guarded, metrics = _train(AlgoConfig(max_update_kl=1e9, **_ALGO))
  chex_equal = jax.tree_util.tree_map(np.array_equal, plain.params.network, guarded.params.network)
  assert all(jax.tree_util.tree_leaves(chex_equal))
  assert float(metrics['updates_applied']) == 1.0


def test_a_tiny_bound_undoes_the_first_step_and_keeps_the_rest_from_moving():
  """At rate 3e-2 every step moves the policy: the KL after the first step is past a 1e-9 bound, so it is undone
  and nothing else is applied to the network; the normaliser still took the batch in (it is not a gradient step)
  and Adam every gradient."""
  initial, state, metrics = _train(AlgoConfig(max_update_kl=1e-9, **_ALGO))
  same = jax.tree_util.tree_map(np.array_equal, initial, jax.tree_util.tree_map(np.asarray, state.params.network))
  assert all(jax.tree_util.tree_leaves(same))
  assert float(metrics['updates_applied']) == 0.0
  assert float(state.params.normalizer.count) == tts.T * tts.S
  # Adam took in all 3 x 2 steps' gradients (its first moment is no longer zero) without moving the network.
  adam = state.opt_state[1][0]
  assert int(adam.count) == 6
  assert any(float(jnp.abs(m).max()) > 0 for m in jax.tree_util.tree_leaves(adam.mu))


def test_bound_must_be_positive():
  with pytest.raises(ValueError, match='--max_update_kl=0'):
    AlgoConfig(max_update_kl=0.0)
