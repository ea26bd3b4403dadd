"""Camera observations through the records and the policies: `types.PixelObs` in the segment template (uint8
pixels beside the state, byte counts by hand), the normaliser on the state only, and the pixel network of each
`--policy` kind behind `generation.stages`."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import transport
from ebrl_jax import types
from ebrl_jax.generation import normalization
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages
from ebrl_jax.generation import vision
from ebrl_jax.resources import memory

O, A = 31, 3  # push_cube's state and action sizes
PIXELS = (32, 32, 6)  # 32 x 32 RGB, 2 frames stacked


def test_segment_template_carries_uint8_pixels_and_the_spec_counts_them_by_hand():
  spec = transport.spec_of(types.segment_template(5, 2, O, 1, A, PIXELS))
  assert spec['transition.obs.pixels'].shape == (5, 2, 32, 32, 6) and spec['transition.obs.pixels'].dtype == 'uint8'
  assert spec['transition.next_obs.state'].shape == (5, 2, O) and spec['transition.obs.state'].dtype == 'float32'
  # Every field starts on a 64-byte line. Pixels: 5 x 2 x 32 x 32 x 6 = 61,440 bytes (a multiple of 64); the
  # state: 5 x 2 x 31 x 4 = 1,240 -> 1,280; obs and next_obs each: 62,720. raw_action 5 x 2 x 1 x 3 x 4 = 120 ->
  # 128; six [5, 2] fields (reward .. policy_version) 40 -> 64 each = 384; group, iteration, incarnation and the
  # three episode sums 6 x 64 = 384. 2 x 62,720 + 128 + 384 + 384 = 126,336.
  assert spec.nbytes == 126_336
  state_only = transport.spec_of(types.segment_template(5, 2, O, 1, A))
  assert spec.nbytes - state_only.nbytes == 2 * 61_440  # the pixels of obs and of next_obs, nothing else
  # The memory plan's transition bytes are the template's (no alignment): the same pixels, unpadded sums.
  assert memory._transition_bytes(5, 2, O, 1, A, PIXELS) == memory._transition_bytes(5, 2, O, 1, A) + 2 * 61_440


def test_obs_template_and_the_state_part():
  obs = types.obs_template((4,), O, PIXELS)
  assert isinstance(obs, types.PixelObs) and obs.pixels.shape == (4, 32, 32, 6) and obs.pixels.dtype == jnp.uint8
  assert types.obs_template((4,), O).shape == (4, O)  # no pixels: the state itself
  state = np.ones((4, O), np.float32)
  pixel_obs = types.PixelObs(np.zeros((4,) + PIXELS, np.uint8), state)
  assert types.proprioception(pixel_obs) is state and types.proprioception(state) is state
  assert types.with_state(pixel_obs, 2 * state).pixels is pixel_obs.pixels
  assert vision.PixelObs is types.PixelObs  # one class: the one the records carry


def _policy(kind, encoder='cnn'):
  return config_lib.PolicyConfig(kind=kind,
                                 vision_encoder=encoder,
                                 cnn_channels=(4,),
                                 cnn_blocks=0,
                                 d_model=16,
                                 num_layers=1,
                                 num_heads=2,
                                 mlp_ratio=2,
                                 patch_size=4,
                                 num_bins=8,
                                 policy_hidden_sizes=(16,),
                                 value_hidden_sizes=(16,))


def _pixel_obs(batch=2, key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  pixels = jax.random.randint(k1, (batch, 8, 8, 6), 0, 256, jnp.int32).astype(jnp.uint8)
  return types.PixelObs(pixels=pixels, state=3.0 + 2.0 * jax.random.normal(k2, (batch, O)))


def test_normaliser_applies_to_the_state_only():
  network = policies.make_network(_policy('mlp'), O, A, (8, 8, 6))
  assert isinstance(network, vision.CNNActorCritic)
  params = stages.init_policy_params(network, jax.random.PRNGKey(0), O, pixel_shape=(8, 8, 6))
  obs = _pixel_obs()
  stats = normalization.update_stats(params.normalizer, obs.state)
  assert stats.mean.shape == (O,)  # statistics of the state: no pixel dimension
  params = params.replace(normalizer=stats)
  key = jax.random.PRNGKey(1)
  act = jax.jit(lambda p, o: stages.act(network, p, o, key))
  by_hand = params.replace(normalize_observations=False)
  pre_normalised = obs._replace(state=normalization.normalize(stats, obs.state))  # pixels as they are, uint8
  np.testing.assert_allclose(act(params, obs).log_probs, act(by_hand, pre_normalised).log_probs, rtol=1e-5)


@pytest.mark.parametrize('kind,encoder,network_class', [('transformer', 'cnn', vision.VisionTransformerActorCritic),
                                                        ('token', 'patches', None)])
def test_pixel_networks_act_and_evaluate_through_the_stages(kind, encoder, network_class):
  network = policies.make_network(_policy(kind, encoder), O, A, (8, 8, 6))
  if network_class is not None:
    assert isinstance(network, network_class)
  params = stages.init_policy_params(network, jax.random.PRNGKey(0), O, pixel_shape=(8, 8, 6))
  obs, key = _pixel_obs(), jax.random.PRNGKey(2)
  out = jax.jit(lambda p, o: stages.act(network, p, o, key))(params, obs)
  assert out.actions.shape == (2, 1, A) and out.log_probs.shape == (2,)
  scored = jax.jit(lambda p, o, r: stages.evaluate(network, p, o, r, key))(params, obs, out.raw_actions)
  np.testing.assert_allclose(scored.log_probs, out.log_probs, rtol=1e-4, atol=1e-4)


def test_cnn_tokens_one_per_cell_of_the_last_feature_map():
  tokens = vision.CNNTokens(d_model=8, stage_channels=(4, 4), num_blocks=0)
  pixels = jnp.zeros((2, 16, 16, 3), jnp.uint8)
  out, variables = jax.jit(tokens.init_with_output)(jax.random.PRNGKey(0), pixels)
  # Two stride-2 pools: 16 -> 8 -> 4, so 4 x 4 = 16 tokens of width 8.
  assert out.shape == (2, 16, 8) and variables['params']['pos_embed'].shape == (16, 8)


def test_memory_plan_counts_the_pixels_in_the_trainers_batch_and_the_act_rows():
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='push_cube',
                                                   obs='pixels',
                                                   image_size=32,
                                                   frame_stack=2,
                                                   num_envs=2),
                          policy=_policy('mlp'),
                          algo=config_lib.AlgoConfig(batch_size=2, num_minibatches=1, unroll_length=5),
                          schedule=config_lib.ScheduleConfig(name='async', num_groups=1))
  spec = types.EnvSpec('push_cube', O, A, 250, 0.02, PIXELS)
  fp = memory.footprints(cfg, spec)
  # The iteration's [5, 2] batch twice (as collected, and shuffled) with its pixels, plus four [5, 2] float arrays.
  assert fp['trainer'].parts['batch'] == 2 * memory._transition_bytes(5, 2, O, 1, A, PIXELS) + 4 * 4 * 5 * 2
  state_only = memory.footprints(dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, obs='state', frame_stack=1)),
                                 spec._replace(pixel_shape=()))
  # Acting on the group's 2 envs reads their observations, pixels included (and the CNN's rows are wider): at
  # least 2 x 6,144 bytes more than with the state alone.
  assert fp['rollout'].parts['act'] - state_only['rollout'].parts['act'] >= 2 * 32 * 32 * 6
