"""Vision encoders and pixel actor-critics: uint8 in, float out, frame-stack channel counts, patch order, shapes,
finite gradients and bfloat16 compute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.generation import distribution, policies, vision

B, H, W = 2, 16, 16


def _pixels(key, channels, batch=B):
  return jax.random.randint(key, (batch, H, W, channels), 0, 256, jnp.int32).astype(jnp.uint8)


def _obs(channels=6, state_dim=5, key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return vision.PixelObs(pixels=_pixels(k1, channels), state=jax.random.normal(k2, (B, state_dim)))


def _vit(dtype=jnp.float32, k=2):
  return vision.VisionTransformerActorCritic(d_model=16,
                                             num_layers=1,
                                             num_heads=2,
                                             mlp_ratio=2,
                                             patch_size=4,
                                             action_dim=3,
                                             action_chunk=k,
                                             obs_token_size=4,
                                             dtype=dtype)


def test_pixels_to_float_range_and_rejects_float():
  x = jnp.array([0, 51, 255], jnp.uint8)
  np.testing.assert_allclose(vision.pixels_to_float(x), [0.0, 0.2, 1.0], rtol=1e-6)  # 51 / 255 = 0.2
  assert vision.pixels_to_float(x, jnp.bfloat16).dtype == jnp.bfloat16
  with pytest.raises(TypeError, match='uint8'):
    vision.pixels_to_float(x.astype(jnp.float32))


def test_frame_stacking_channel_layout():
  assert vision.pixel_channels(3) == 9 and vision.pixel_channels(3, depth=True) == 12
  # 2 frames of 3 channels; frame s, channel i holds the value 10 s + i.
  frames = (10 * jnp.arange(2)[:, None] + jnp.arange(3)[None]).astype(jnp.uint8)
  frames = jnp.broadcast_to(frames[None, :, None, None, :], (1, 2, 4, 4, 3))
  stacked = vision.stack_frames(frames)
  assert stacked.shape == (1, 4, 4, 6) and stacked.dtype == jnp.uint8
  np.testing.assert_array_equal(stacked[0, 1, 2], [0, 1, 2, 10, 11, 12])  # oldest frame first


@pytest.mark.parametrize('frame_stack,depth', [(1, False), (2, False), (2, True)])
def test_impala_cnn_shapes_and_channels(frame_stack, depth):
  channels = vision.pixel_channels(frame_stack, depth)
  cnn = vision.ImpalaCNN(stage_channels=(4, 8, 8), num_blocks=1, feature_dim=12)
  pixels = _pixels(jax.random.PRNGKey(0), channels)
  params = jax.jit(cnn.init)(jax.random.PRNGKey(1), pixels)
  assert params['params']['stage_0_conv']['kernel'].shape == (3, 3, channels, 4)
  # Three stride-2 pools: 16 -> 8 -> 4 -> 2, so the projection sees 2 * 2 * 8 = 32 inputs.
  assert params['params']['project']['kernel'].shape == (32, 12)
  features = jax.jit(cnn.apply)(params, pixels)
  assert features.shape == (B, 12) and features.dtype == jnp.float32
  assert np.all(np.isfinite(features))


def test_patch_embed_shapes_and_row_major_order():
  embed = vision.PatchEmbed(patch_size=4, d_model=8)
  pixels = jnp.zeros((1, H, W, 6), jnp.uint8)
  params = jax.jit(embed.init)(jax.random.PRNGKey(0), pixels)
  assert params['params']['patchify']['kernel'].shape == (4, 4, 6, 8)
  assert params['params']['pos_embed'].shape == (16, 8)  # (16 / 4) ** 2 patches
  base = jax.jit(embed.apply)(params, pixels)
  assert base.shape == (1, 16, 8) and base.dtype == jnp.float32
  # Light up only the patch at grid row 1, column 2: only token 1 * 4 + 2 = 6 changes.
  bright = pixels.at[:, 4:8, 8:12].set(255)
  changed = np.any(np.abs(np.asarray(jax.jit(embed.apply)(params, bright) - base)) > 1e-6, axis=-1)[0]
  np.testing.assert_array_equal(np.nonzero(changed)[0], [6])


def test_patch_embed_rejects_partial_patches():
  with pytest.raises(ValueError, match='patch_size=5'):
    vision.PatchEmbed(patch_size=5, d_model=8).init(jax.random.PRNGKey(0), jnp.zeros((1, H, W, 3), jnp.uint8))


@pytest.mark.parametrize('state_dim,num_tokens', [(5, 16 + 2), (0, 16)])  # ceil(5 / 4) = 2 state tokens
def test_pixel_tokenizer_token_count(state_dim, num_tokens):
  tok = vision.PixelTokenizer(patch_size=4, d_model=8, obs_token_size=4)
  obs = _obs(state_dim=state_dim)
  tokens = jax.jit(tok.apply)(jax.jit(tok.init)(jax.random.PRNGKey(0), obs), obs)
  assert tokens.shape == (B, num_tokens, 8)


def test_vit_actor_critic_contract_matches_gaussian_heads():
  net = _vit()
  obs = _obs()
  params = jax.jit(net.init)(jax.random.PRNGKey(0), obs)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  dist_params, value = jax.jit(net.apply)(params, obs)
  assert dist_params.shape == (B, 2, 6) and value.shape == (B,)
  assert dist_params.dtype == value.dtype == jnp.float32
  # The Gaussian head's helpers apply unchanged: log-probs [B] summed over K and A.
  loc, scale = distribution.split_params(dist_params, 0.001)
  raw = distribution.sample_raw(loc, scale, jax.random.PRNGKey(1))
  log_probs = jnp.sum(distribution.log_prob(loc, scale, raw), axis=-1)
  assert log_probs.shape == (B,) and np.all(np.isfinite(log_probs))
  # The pixels matter: a different image changes the output.
  other = obs._replace(pixels=255 - obs.pixels)
  assert float(jnp.max(jnp.abs(jax.jit(net.apply)(params, other)[0] - dist_params))) > 0


def test_cnn_actor_critic_shapes():
  net = vision.CNNActorCritic(action_dim=3,
                              stage_channels=(4, 8),
                              feature_dim=8,
                              policy_hidden_sizes=(8,),
                              value_hidden_sizes=(8,))
  obs = _obs(channels=vision.pixel_channels(2, depth=True))
  dist_params, value = jax.jit(net.apply)(jax.jit(net.init)(jax.random.PRNGKey(0), obs), obs)
  assert dist_params.shape == (B, 1, 6) and value.shape == (B,)


@pytest.mark.parametrize('which', ['cnn', 'vit'])
def test_gradients_finite_and_nonzero(which):
  if which == 'cnn':
    net = vision.CNNActorCritic(action_dim=3,
                                stage_channels=(4, 8),
                                feature_dim=8,
                                policy_hidden_sizes=(8,),
                                value_hidden_sizes=(8,))
  else:
    net = _vit()
  obs = _obs()
  params = jax.jit(net.init)(jax.random.PRNGKey(0), obs)

  def loss(p):
    dist_params, value = net.apply(p, obs)
    return jnp.sum(jnp.square(dist_params)) + jnp.sum(jnp.square(value - 1.0))

  grads = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree_util.tree_leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  first_conv = grads['params']['encoder']['stage_0_conv'] if which == 'cnn' else (
      grads['params']['tokenizer']['patches']['patchify'])
  assert float(jnp.sum(jnp.abs(first_conv['kernel']))) > 0  # gradient reaches the pixels' first layer


def test_bfloat16_compute_is_finite_and_close_to_float32():
  obs = _obs()
  f32, bf16 = _vit(), _vit(jnp.bfloat16)
  params = jax.jit(f32.init)(jax.random.PRNGKey(0), obs)
  # Same parameter tree and dtype (float32) whatever the compute dtype.
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
      jax.eval_shape(bf16.init, jax.random.PRNGKey(0), obs))
  dp32, v32 = jax.jit(f32.apply)(params, obs)
  dp16, v16 = jax.jit(bf16.apply)(params, obs)
  assert dp16.dtype == v16.dtype == jnp.float32
  assert np.all(np.isfinite(dp16)) and np.all(np.isfinite(v16))
  np.testing.assert_allclose(dp16, dp32, atol=0.05)
  np.testing.assert_allclose(v16, v32, atol=0.05)
  cnn32 = vision.ImpalaCNN((4, 8), num_blocks=1, feature_dim=8)
  cnn16 = vision.ImpalaCNN((4, 8), num_blocks=1, feature_dim=8, dtype=jnp.bfloat16)
  cp = jax.jit(cnn32.init)(jax.random.PRNGKey(0), obs.pixels)
  f16 = jax.jit(cnn16.apply)(cp, obs.pixels)
  assert f16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(f16, np.float32), jax.jit(cnn32.apply)(cp, obs.pixels), atol=0.05, rtol=0.05)


def test_mlp_pixel_policy_takes_the_compute_dtype_for_its_cnn_encoder():
  """--policy=mlp --obs=pixels --compute_dtype=bfloat16: make_network builds the CNN encoder in bfloat16 (the same
  float32 parameters give outputs that differ from float32 compute by rounding only), the heads' outputs stay
  float32."""
  obs = _obs()
  shape = tuple(obs.pixels.shape[1:])
  nets = [
      policies.make_network(
          config_lib.PolicyConfig(kind='mlp',
                                  compute_dtype=dtype,
                                  cnn_channels=(4, 8),
                                  cnn_blocks=1,
                                  d_model=16,
                                  policy_hidden_sizes=(16,),
                                  value_hidden_sizes=(16,)), obs.state.shape[-1], 2, shape)
      for dtype in ('float32', 'bfloat16')
  ]
  params = jax.jit(nets[0].init)(jax.random.PRNGKey(0), obs)
  (dp32, v32), (dp16, v16) = (jax.jit(net.apply)(params, obs) for net in nets)
  assert dp16.dtype == v16.dtype == jnp.float32 and np.all(np.isfinite(dp16)) and np.all(np.isfinite(v16))
  assert not np.array_equal(dp16, dp32)  # the encoder did compute in bfloat16
  np.testing.assert_allclose(dp16, dp32, atol=0.05)
  np.testing.assert_allclose(v16, v32, atol=0.05)
