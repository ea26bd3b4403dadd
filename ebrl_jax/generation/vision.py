"""Vision encoders and a pixel actor-critic (flax.linen) for camera observations.

Camera frames travel as uint8 `pixels [B, H, W, C]` (4x smaller than float32 through transport and replay) and
become float in [0, 1] inside the modules. `C = frame_stack * 3` for RGB, `frame_stack * 4` with a depth
channel per frame (depth quantised to uint8 by the simulator); `stack_frames` builds that layout.

* `ImpalaCNN`: IMPALA-style residual CNN -> feature vector `[B, F]`. Chosen over the Nature-DQN CNN because
  its 3x3 'SAME' convolutions and stride-2 pools work at any resolution down to 8x8 (the DQN's 8x8/4 first
  layer assumes 84x84 frames and collapses small renders to nothing), and its residual stages train better
  (Espeholt et al. 2018; Cobbe et al. 2019 on Procgen).
* `PatchEmbed`: ViT patchify (a conv with kernel = stride = patch) + learned positions -> tokens `[B, P, D]`.
* `CNNTokens`: the IMPALA CNN's last feature map, one token per cell (RT-1-style) -> tokens `[B, P, D]`.
* `PixelTokenizer`: `PixelObs` -> image tokens (`encoder='patches'` or `'cnn'`) followed by proprioception tokens
  `[B, P + N, D]`; the prefix both `VisionTransformerActorCritic` and `token_policy.TokenPolicy` consume.
* `VisionTransformerActorCritic`: `PixelTokenizer` tokens + K action queries + a value token through
  `layers.EncoderBlock`s, ending in the Gaussian heads of `policies.TransformerActorCritic`.
* `CNNActorCritic`: `ImpalaCNN` features concatenated with the state, then Brax-style policy/value MLPs.

Params are float32; `dtype` is the compute dtype of the trunks (jnp.bfloat16 halves activation memory); heads
and their outputs are float32. Axis names: B batch, H/W image, C channels, P patches, N state tokens,
O state dim, D model width, F feature width, K action chunk, A action dim.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import chex
import flax.linen as nn
import jax.numpy as jnp

from ebrl_jax import types
from ebrl_jax.generation import layers
from ebrl_jax.generation import token_policy
from ebrl_jax.types import Array

Dtype = Any
_EMBED_INIT = layers.EMBED_INIT  # the transformer policies' embedding init

# A camera observation: pixels [B, H, W, C] uint8 (frames stacked on C, oldest first) beside the proprioceptive
# state [B, O] float32 (O may be 0). Defined in `types`, since it travels in `Transition` records.
PixelObs = types.PixelObs


def pixel_channels(frame_stack: int, depth: bool = False) -> int:
  """Channels of a stacked observation: 3 (RGB) or 4 (RGB-D) per frame."""
  return frame_stack * (4 if depth else 3)


def stack_frames(frames: Array) -> Array:
  """frames [B, S, H, W, c] (S frames, oldest first) -> [B, H, W, S * c]; channel s * c + i is frame s's i."""
  chex.assert_rank(frames, 5)
  b, s, h, w, c = frames.shape
  return jnp.transpose(frames, (0, 2, 3, 1, 4)).reshape(b, h, w, s * c)


def pixels_to_float(pixels: Array, dtype: Dtype = jnp.float32) -> Array:
  """uint8 [..., C] in [0, 255] -> `dtype` in [0, 1]. Rejects float input so a double conversion cannot hide."""
  if pixels.dtype != jnp.uint8:
    raise TypeError(f'pixels must be uint8 (converted inside the network); got {pixels.dtype}.')
  return pixels.astype(dtype) * (1.0 / 255.0)


# state [B, O] -> [B, ceil(O / token_size), token_size]: one definition, beside the token policy's StateTokenizer.
state_tokens = token_policy.state_tokens


class ResidualBlock(nn.Module):
  """x + conv(relu(conv(relu(x)))), 3x3 'SAME' convolutions keeping the channel count. [B, H, W, C] -> same."""
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    channels = x.shape[-1]
    h = nn.Conv(channels, (3, 3), padding='SAME', dtype=self.dtype, name='conv_0')(nn.relu(x))
    h = nn.Conv(channels, (3, 3), padding='SAME', dtype=self.dtype, name='conv_1')(nn.relu(h))
    return x + h


def impala_stages(x: Array, stage_channels: Sequence[int], num_blocks: int, dtype: Dtype) -> Array:
  """Inside a compact module: per stage conv 3x3 -> max-pool 3x3 stride 2 -> `num_blocks` residual blocks,
  then relu; x [B, H, W, C] float -> [B, ceil(H / 2^s), ceil(W / 2^s), stage_channels[-1]] (s stages). The layers
  are the calling module's `stage_<i>_conv` and `stage_<i>_block_<j>`."""
  for i, channels in enumerate(stage_channels):
    x = nn.Conv(channels, (3, 3), padding='SAME', dtype=dtype, name=f'stage_{i}_conv')(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
    for j in range(num_blocks):
      x = ResidualBlock(dtype, name=f'stage_{i}_block_{j}')(x)
  return nn.relu(x)


class ImpalaCNN(nn.Module):
  """IMPALA-style encoder: per stage conv 3x3 -> max-pool 3x3 stride 2 -> `num_blocks` residual blocks; then
  relu, flatten and a dense layer. pixels [B, H, W, C] uint8 -> features [B, feature_dim] (compute dtype).

  Each stage halves H and W (rounding up): 16x16 -> 8 -> 4 -> 2 with the default three stages.
  """
  stage_channels: Sequence[int] = (16, 32, 32)
  num_blocks: int = 2
  feature_dim: int = 256
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, pixels: Array) -> Array:
    chex.assert_rank(pixels, 4)
    x = impala_stages(pixels_to_float(pixels, self.dtype), self.stage_channels, self.num_blocks, self.dtype)
    x = x.reshape(x.shape[0], -1)
    features = nn.relu(nn.Dense(self.feature_dim, dtype=self.dtype, name='project')(x))
    chex.assert_shape(features, (pixels.shape[0], self.feature_dim))
    return features


class PatchEmbed(nn.Module):
  """ViT patchify: non-overlapping `patch_size` squares, each linearly embedded (a conv with kernel = stride),
  plus a learned position embedding per patch. pixels [B, H, W, C] uint8 -> tokens [B, P, D],
  P = (H / patch_size) * (W / patch_size), row-major over the patch grid."""
  patch_size: int
  d_model: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, pixels: Array) -> Array:
    chex.assert_rank(pixels, 4)
    batch, height, width, _ = pixels.shape
    if height % self.patch_size or width % self.patch_size:
      raise ValueError(f'image {height}x{width} is not a whole number of patch_size={self.patch_size} patches.')
    x = pixels_to_float(pixels, self.dtype)
    p = self.patch_size
    x = nn.Conv(self.d_model, (p, p), strides=(p, p), padding='VALID', dtype=self.dtype, name='patchify')(x)
    num_patches = (height // p) * (width // p)
    x = x.reshape(batch, num_patches, self.d_model)
    pos = self.param('pos_embed', _EMBED_INIT, (num_patches, self.d_model))
    return x + pos.astype(self.dtype)


class CNNTokens(nn.Module):
  """`impala_stages` feature map, one token per cell: pixels [B, H, W, C] uint8 -> tokens [B, P, D],
  P = ceil(H / 2^s) * ceil(W / 2^s) (s stages), row-major; each cell's channels dense-embedded plus a learned
  position."""
  d_model: int
  stage_channels: Sequence[int] = (16, 32, 32)
  num_blocks: int = 2
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, pixels: Array) -> Array:
    chex.assert_rank(pixels, 4)
    x = impala_stages(pixels_to_float(pixels, self.dtype), self.stage_channels, self.num_blocks, self.dtype)
    batch, height, width, channels = x.shape
    x = nn.Dense(self.d_model, dtype=self.dtype, name='embed')(x.reshape(batch, height * width, channels))
    return x + self.param('pos_embed', _EMBED_INIT, (height * width, self.d_model)).astype(self.dtype)


class PixelTokenizer(nn.Module):
  """PixelObs -> tokens [B, P + N, D]: image tokens (`encoder`: 'patches', ViT patches of `patch_size`; 'cnn',
  `CNNTokens` of `stage_channels` and `num_blocks`), then state tokens (`state_tokens` cut, dense-embedded, own
  learned positions). The two position tables are separate, so they also tell the modalities apart.
  N = ceil(O / obs_token_size), 0 when the state is empty."""
  patch_size: int
  d_model: int
  obs_token_size: int = 4
  dtype: Dtype = jnp.float32
  encoder: str = 'patches'
  stage_channels: Sequence[int] = (16, 32, 32)
  num_blocks: int = 2

  @nn.compact
  def __call__(self, obs: PixelObs) -> Array:
    chex.assert_rank(obs.state, 2)
    chex.assert_equal_shape_prefix([obs.pixels, obs.state], 1)
    if self.encoder == 'cnn':
      tokens = CNNTokens(self.d_model, tuple(self.stage_channels), self.num_blocks, self.dtype, name='cnn')(obs.pixels)
    elif self.encoder == 'patches':
      tokens = PatchEmbed(self.patch_size, self.d_model, self.dtype, name='patches')(obs.pixels)
    else:
      raise ValueError(f'PixelTokenizer: encoder={self.encoder!r} is not one of cnn, patches.')
    if obs.state.shape[-1] == 0:
      return tokens
    state = state_tokens(obs.state, self.obs_token_size)
    x = nn.Dense(self.d_model, dtype=self.dtype, name='state_embed')(state.astype(self.dtype))
    x = x + self.param('state_pos_embed', _EMBED_INIT, (state.shape[1], self.d_model)).astype(self.dtype)
    return jnp.concatenate([tokens, x], axis=1)


class VisionTransformerActorCritic(layers.PolicyNetwork):
  """`PixelTokenizer` prefix + K action queries + 1 value token through pre-LN encoder blocks; with
  `critic='mlp'` no value token, but a separate MLP critic on the state beside the pixels (an asymmetric critic:
  `--critic=mlp`, config_generation).

  obs: PixelObs(pixels [B, H, W, C] uint8, state [B, O]) -> (dist_params [B, K, 2A] float32, value [B] float32),
  the same contract as `policies.TransformerActorCritic`, so `distribution` and the losses apply unchanged.
  """
  d_model: int
  num_layers: int
  num_heads: int
  mlp_ratio: int
  patch_size: int
  action_dim: int
  action_chunk: int = 1
  obs_token_size: int = 4
  dtype: Dtype = jnp.float32
  encoder: str = 'patches'  # or 'cnn' (see PixelTokenizer)
  stage_channels: Sequence[int] = (16, 32, 32)
  num_blocks: int = 2
  critic: str = 'shared'
  value_hidden_sizes: Sequence[int] = (256, 256, 256, 256, 256)

  @nn.compact
  def __call__(self, obs: PixelObs) -> Tuple[Array, Array]:
    x = PixelTokenizer(self.patch_size,
                       self.d_model,
                       self.obs_token_size,
                       self.dtype,
                       self.encoder,
                       tuple(self.stage_channels),
                       self.num_blocks,
                       name='tokenizer')(obs)
    return layers.encode_with_heads(self,
                                    x,
                                    obs.state,
                                    action_chunk=self.action_chunk,
                                    action_dim=self.action_dim,
                                    num_layers=self.num_layers,
                                    num_heads=self.num_heads,
                                    mlp_ratio=self.mlp_ratio,
                                    dtype=self.dtype,
                                    critic=self.critic,
                                    value_hidden_sizes=self.value_hidden_sizes)


class CNNActorCritic(layers.PolicyNetwork):
  """`ImpalaCNN` features ++ state, then separate policy and value MLPs (Brax-style heads); K = 1.

  obs: PixelObs -> (dist_params [B, 1, 2A] float32, value [B] float32). The encoder is shared by actor and critic.
  """
  action_dim: int
  stage_channels: Sequence[int] = (16, 32, 32)
  feature_dim: int = 256
  policy_hidden_sizes: Sequence[int] = (256, 256)
  value_hidden_sizes: Sequence[int] = (256, 256)
  dtype: Dtype = jnp.float32
  num_blocks: int = 2

  @nn.compact
  def __call__(self, obs: PixelObs) -> Tuple[Array, Array]:
    chex.assert_rank(obs.state, 2)
    features = ImpalaCNN(tuple(self.stage_channels),
                         self.num_blocks,
                         feature_dim=self.feature_dim,
                         dtype=self.dtype,
                         name='encoder')(obs.pixels)
    x = jnp.concatenate([features.astype(jnp.float32), obs.state.astype(jnp.float32)], axis=-1)
    dist_params = layers.MLP(tuple(self.policy_hidden_sizes) + (2 * self.action_dim,), name='policy')(x)
    value = layers.MLP(tuple(self.value_hidden_sizes) + (1,), name='value')(x)
    return dist_params[:, None, :], value[:, 0]
