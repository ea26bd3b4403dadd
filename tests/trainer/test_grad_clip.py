"""--grad_clip_scope: which parameters are the critic's, the policy's and critic's gradients clipped apart, the
Adam step-size effect it removes, the gradient-norm metrics, and the configurations it refuses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import main
from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import policies
from ebrl_jax.trainer import critic
from ebrl_jax.trainer import stages

OBS, ACT = 6, 2


def _leaf_labels(network, **policy):
  net = policies.make_network(PolicyConfig(**policy), OBS, ACT) if network is None else network
  params = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS))))
  paths = jax.tree_util.tree_flatten_with_path(critic.critic_labels(params))[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): label for path, label in paths}


def test_the_critic_is_the_value_module_only():
  mlp = _leaf_labels(None, policy_hidden_sizes=(8,), value_hidden_sizes=(8,))
  assert {k for k, v in mlp.items() if v == 'critic'} == {k for k in mlp if k.startswith('params/value/')}
  assert any(k.startswith('params/policy/') for k in mlp)
  transformer = _leaf_labels(None,
                             kind='transformer',
                             d_model=16,
                             num_layers=1,
                             num_heads=2,
                             critic='mlp',
                             value_hidden_sizes=(8,))
  critic_leaves = {k for k, v in transformer.items() if v == 'critic'}
  assert critic_leaves and all(k.startswith('params/value/') for k in critic_leaves)
  # The attention's own 'value' projection inside a block is the policy's.
  inner = [k for k in transformer if '/value/' in k and not k.startswith('params/value/')]
  assert inner and all(transformer[k] == 'policy' for k in inner)


def _policy_steps(scope: str, lr: float = 1e-3):
  """Policy-parameter Adam steps with a constant policy gradient (norm 0.2, under the clip) while the critic's
  gradient is 1000 for 50 steps (a loss spike) and then 0.1 for 20."""
  optimizer = stages.make_optimizer(AlgoConfig(learning_rate=lr, max_grad_norm=0.5, grad_clip_scope=scope))
  params = {'params': {'policy': {'w': jnp.zeros(4)}, 'value': {'w': jnp.zeros(4)}}}
  state = optimizer.init(params)
  steps = []
  for i in range(70):
    critic_grad = 1000.0 if i < 50 else 0.1
    grads = {'params': {'policy': {'w': jnp.full(4, 0.1)}, 'value': {'w': jnp.full(4, critic_grad)}}}
    updates, state = optimizer.update(grads, state, params)
    steps.append(-float(updates['params']['policy']['w'][0]))
  return np.array(steps)


def test_per_network_clip_keeps_the_policy_step_from_the_critic_spike():
  lr = 1e-3
  per_network = _policy_steps('per_network', lr)
  np.testing.assert_allclose(per_network, lr, rtol=1e-4)  # constant gradient, Adam's step = lr throughout
  global_clip = _policy_steps('global', lr)
  np.testing.assert_allclose(global_clip[:50], lr, rtol=1e-3)  # scaled down, but steadily
  # Once the spike passes, the policy's clipped gradient grows 4000x; Adam's second moment remembers the small
  # ones: steps well over the learning rate.
  assert global_clip[50:].max() > 1.4 * lr, global_clip[50:]


def test_train_step_reports_the_norms_of_both_parts():
  net = policies.make_network(PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)), OBS, ACT)
  grads = jax.tree_util.tree_map(jnp.ones_like, net.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS))))
  labels = jax.tree_util.tree_leaves(critic.critic_labels(grads))
  sizes = [x.size for x in jax.tree_util.tree_leaves(grads)]
  norms = stages.grad_norms(grads)
  critic_size = sum(s for s, l in zip(sizes, labels) if l == 'critic')
  np.testing.assert_allclose(float(norms['critic_grad_norm']), np.sqrt(critic_size), rtol=1e-6)
  np.testing.assert_allclose(float(norms['policy_grad_norm']), np.sqrt(sum(sizes) - critic_size), rtol=1e-6)
  np.testing.assert_allclose(float(norms['grad_norm']), np.sqrt(sum(sizes)), rtol=1e-6)


def test_no_critic_parameters_is_an_error():
  optimizer = stages.make_optimizer(AlgoConfig(max_grad_norm=0.5, grad_clip_scope='per_network'))
  with pytest.raises(ValueError, match='no critic parameters'):
    optimizer.init({'params': {'policy': {'w': jnp.zeros(2)}}})


@pytest.mark.parametrize('kwargs,match', [
    (dict(algo=dict(grad_clip_scope='per_network')), '--max_grad_norm'),
    (dict(algo=dict(grad_clip_scope='apart', max_grad_norm=0.5)), '--grad_clip_scope='),
    (dict(algo=dict(grad_clip_scope='per_network', max_grad_norm=0.5),
          policy=dict(kind='transformer', d_model=16, num_layers=1, num_heads=2, critic='shared')), '--critic=shared'),
])
def test_bad_scopes_name_their_flags(kwargs, match):
  with pytest.raises(ValueError, match=match):
    config_lib.Config(sim=config_lib.SimConfig(num_envs=8),
                      policy=PolicyConfig(**kwargs.get('policy', {})),
                      algo=AlgoConfig(batch_size=8, num_minibatches=2, **kwargs['algo']))


def test_flag_reaches_the_config():
  values = main.FLAGS.__class__()
  main.define_flags(values)
  values(['prog', '--grad_clip_scope=per_network', '--max_grad_norm=0.5', '--num_envs=8', '--batch_size=8'])
  cfg = main.config_from_flags(values)
  assert (cfg.algo.grad_clip_scope, cfg.algo.max_grad_norm) == ('per_network', 0.5)
