"""Network output shapes, parameter counts (computed by hand), init and dtypes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import types
from ebrl_jax.config import PolicyConfig
from ebrl_jax.generation import policies

OBS, ACT = 27, 8  # Ant


def transformer_param_count(d, layers, r, s, obs_dim, k, a):
  """Per block: LN 2x2d; attention q,k,v,out 4(d^2 + d); MLP d*rd + rd + rd*d + d.
  Outside: token embed s*d + d; positions ceil(O/s)*d; K queries K*d; value token d; final LN 2d;
  action head d*2A + 2A; value head d + 1."""
  block = 4 * d + 4 * (d * d + d) + 2 * r * d * d + r * d + d
  n_tok = -(-obs_dim // s)
  return layers * block + (s * d + d) + n_tok * d + k * d + d + 2 * d + (d * 2 * a + 2 * a) + (d + 1)


def test_mlp_shapes_and_count():
  net = policies.make_network(PolicyConfig(kind='mlp'), OBS, ACT)
  params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, OBS)))
  dist_params, value = jax.jit(net.apply)(params, jnp.ones((5, OBS)))
  assert dist_params.shape == (5, 1, 2 * ACT) and value.shape == (5,)
  # policy 27*32+32 + 3*(32*32+32) + 32*16+16 = 896 + 3168 + 528 = 4592
  # value 27*256+256 + 4*(256*256+256) + 256+1 = 7168 + 263168 + 257 = 270593
  assert policies.count_params(params) == 4592 + 270593 == 275185


def test_mlp_init_is_lecun_uniform_with_zero_bias():
  net = policies.MLPActorCritic((32,) * 4, (256,) * 5, ACT)
  params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, OBS)))['params']
  k = params['value']['hidden_1']['kernel']  # fan_in 256: U(-sqrt(3/256), sqrt(3/256)), var 1/256
  assert float(jnp.max(jnp.abs(k))) <= np.sqrt(3.0 / 256)
  np.testing.assert_allclose(float(jnp.var(k)), 1.0 / 256, rtol=0.05)
  assert not np.any(params['policy']['hidden_0']['bias'])


@pytest.mark.parametrize(
    'd,layers,k,expected',
    [
        # ~1M: blocks 5*(12*128^2 + 13*128) = 991,360; + 640 + 7*128 + 128 + 128 + 256 + 2064 + 129 = 995,601.
        (128, 5, 1, 995_601),
        # ~25M: blocks 8*(12*512^2 + 13*512) = 25,219,072; + 2560 + 3584 + 4*512 + 512 + 1024 + 8208 + 513.
        (512, 8, 4, 25_237_521),
        # ~100M: blocks 8*(12*1024^2 + 13*1024) = 100,769,792; + 5120 + 7168 + 8192 + 1024 + 2048 + 16400 + 1025.
        (1024, 8, 8, 100_810_769),
    ])
@pytest.mark.parametrize('critic', ['shared', 'mlp', 'auto'])
def test_transformer_param_counts(d, layers, k, expected, critic):
  cfg = PolicyConfig(kind='transformer',
                     d_model=d,
                     num_layers=layers,
                     num_heads=8,
                     mlp_ratio=4,
                     obs_token_size=4,
                     action_chunk=k,
                     critic=critic)
  net = policies.make_network(cfg, OBS, ACT)
  shapes = jax.eval_shape(net.init, jax.random.PRNGKey(0), jnp.zeros((1, OBS)))  # no allocation
  assert transformer_param_count(d, layers, 4, 4, OBS, k, ACT) == expected
  if critic != 'shared':  # auto is mlp on state: no value token (d) or value head (d + 1); Brax's 5x256 value MLP
    expected += -d - (d + 1) + 270593
    assert 'value_token' not in shapes['params'] and 'value' in shapes['params']
  assert policies.count_params(shapes) == expected


def test_transformer_mlp_critic_value_loss_moves_no_policy_parameter():
  """--critic=mlp: the value depends on the critic's own params only; the policy's outputs on none of them."""
  cfg = PolicyConfig(kind='transformer', d_model=16, num_layers=1, num_heads=2, critic='mlp', value_hidden_sizes=(8,))
  net = policies.make_network(cfg, OBS, ACT)
  obs = jax.random.normal(jax.random.PRNGKey(1), (6, OBS))
  params = jax.jit(net.init)(jax.random.PRNGKey(0), obs[:1])
  both = jax.jit(lambda p: (jax.grad(lambda q: jnp.sum(net.apply(q, obs)[1]))
                            (p), jax.grad(lambda q: jnp.sum(net.apply(q, obs)[0]))(p)))
  value_grads, policy_grads = (g['params'] for g in both(params))
  for name, tree in value_grads.items():
    norm = sum(float(jnp.sum(jnp.abs(x))) for x in jax.tree_util.tree_leaves(tree))
    assert (norm > 0) == (name == 'value'), (name, norm)
  assert not any(np.any(x) for x in jax.tree_util.tree_leaves(policy_grads['value']))


def test_critic_flag_checks():
  with pytest.raises(ValueError, match='--critic=shared needs --policy=transformer or token'):
    PolicyConfig(kind='mlp', critic='shared')
  with pytest.raises(ValueError, match="--critic='big' is not valid; allowed values: auto, shared, mlp"):
    PolicyConfig(kind='transformer', critic='big')


@pytest.mark.parametrize('critic', ['mlp', 'auto'])
def test_pixel_transformer_critic_reads_the_state_only_with_mlp(critic):
  """With --obs=pixels, auto is the shared value token; --critic=mlp an asymmetric critic of the state alone."""
  cfg = PolicyConfig(kind='transformer',
                     d_model=16,
                     num_layers=1,
                     num_heads=2,
                     patch_size=8,
                     critic=critic,
                     value_hidden_sizes=(8,),
                     vision_encoder='patches')
  net = policies.make_network(cfg, OBS, ACT, pixel_shape=(16, 16, 3))
  obs = types.PixelObs(pixels=jnp.zeros((3, 16, 16, 3), jnp.uint8), state=jnp.ones((3, OBS)))
  params = jax.jit(net.init)(jax.random.PRNGKey(0), obs)
  assert ('value_token' in params['params']) == (critic == 'auto')
  other = obs._replace(pixels=jnp.full((3, 16, 16, 3), 200, jnp.uint8))
  apply = jax.jit(net.apply)
  dist, value = apply(params, obs)
  dist_other, value_other = apply(params, other)
  assert dist.shape == (3, 1, 2 * ACT) and value.shape == (3,)
  assert not np.allclose(dist, dist_other)  # the policy sees the pixels
  assert np.allclose(value, value_other) == (critic == 'mlp')  # the MLP critic does not


def test_transformer_shapes_and_bf16_compute():
  net = policies.TransformerActorCritic(d_model=32,
                                        num_layers=2,
                                        num_heads=4,
                                        mlp_ratio=2,
                                        obs_token_size=5,
                                        action_dim=3,
                                        action_chunk=4,
                                        dtype=jnp.bfloat16)
  params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, 11)))  # 11 -> padded to 15 -> 3 tokens
  assert params['params']['obs_pos_embed'].shape == (3, 32)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  dist_params, value = jax.jit(net.apply)(params, jax.random.normal(jax.random.PRNGKey(1), (6, 11)))
  assert dist_params.shape == (6, 4, 6) and value.shape == (6,)
  assert dist_params.dtype == jnp.float32 and value.dtype == jnp.float32
  assert np.all(np.isfinite(dist_params))
  # The 4 action queries produce different per-step outputs.
  assert float(jnp.max(jnp.abs(dist_params[:, 0] - dist_params[:, 1]))) > 0


def test_make_network_rejects_chunked_mlp():
  with pytest.raises(ValueError, match='action_chunk'):
    policies.MLPActorCritic((4,), (4,), 2, action_chunk=2).init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
