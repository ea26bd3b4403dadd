"""Autoregressive action-token policy (OpenVLA-style): each action value is one of `num_bins` discrete tokens.

Sequence layout (positions along the decoder's time axis T):

  [obs_0 .. obs_{N-1}, BOS, t_0, t_1, .., t_{M-1}]     prefix length P = N + 1,  M = K * A action tokens

t_m is the token of chunk step k = m // A, action dimension a = m % A (row-major over [K, A]). The output at
position P - 1 + m predicts t_m: BOS predicts t_0, t_m's own position predicts t_{m+1}; the output at
t_{M-1}'s position is unused (it is fed anyway, so decoding and the teacher-forced pass see the same sequence
of length P + M). The value head reads the BOS output, which sees the whole observation and no action
(`critic='shared'`), or a separate MLP critic reads the normalised state (`critic='mlp'`, config_generation).

Attention is prefix-LM: query i sees key j when j <= i or j < P, i.e. observation tokens (and BOS) attend to
each other both ways (patch tokens have no natural order), action tokens are causal. Decoding prefills the
prefix into a fixed-length `KVCache` (T = P + M, so it jits) and then feeds one token per `lax.scan` step.

Functions (the module is static under jit, as in `stages.act`):
  init(policy, key, obs) -> variables
  decode(policy, variables, obs, key, deterministic) -> DecodeOutput (tokens, actions, log_probs, values)
  full_forward(policy, variables, obs, tokens) -> (logits [B, M, num_bins] float32, values [B])
  evaluate(policy, variables, obs, tokens) -> stages.EvalOutput
  log_prob_and_entropy(logits, tokens) -> ([B], [B])

`obs` is whatever `policy.tokenizer` maps to tokens `[B, N, D_in]` (`StateTokenizer` for a state `[B, O]`,
`vision.PixelTokenizer` for a `PixelObs`); with no tokenizer it is those tokens already.

`generation.stages` runs a `TokenPolicy` through `TokenPolicy.policy_head` (see `stages.head_of`): `act` returns
the bin centres as actions and the token ids, as float32, as `raw_actions`; they travel in
`Transition.raw_action` (float32 like every other record field; ids below 2^24 are exact) and `evaluate` turns
them back into int32.

Axis names: B batch, N obs tokens, P prefix, M = K * A action tokens, L layers, H heads, Dh head width.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Optional, Sequence, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ebrl_jax import types
from ebrl_jax.generation import layers
from ebrl_jax.generation import stages
from ebrl_jax.types import ActOutput, Array, Params, PRNGKey

Dtype = Any
_EMBED_INIT, _HEAD_INIT = layers.EMBED_INIT, layers.HEAD_INIT  # the transformer policies' inits


class KVCache(NamedTuple):
  """Keys and values of every layer, k/v [L, B, H, T, Dh] (compute dtype); length [] int32 = positions written
  (0 .. length-1 hold valid entries, the rest is zeros and masked)."""
  k: Array
  v: Array
  length: Array


class DecodeOutput(NamedTuple):
  """tokens [B, K, A] int32 bin ids; actions [B, K, A] float32 bin centres in [-1, 1]; token_log_probs [B, K, A]
  float32; log_probs [B] (sum over K and A); values [B] float32."""
  tokens: Array
  actions: Array
  token_log_probs: Array
  log_probs: Array
  values: Array


def actions_to_bins(actions: Array, num_bins: int) -> Array:
  """[-1, 1] -> int32 bins of width 2 / num_bins: floor((a + 1) / 2 * num_bins), clipped to [0, num_bins - 1]
  (so -1 is bin 0 and +1 is the last bin; out-of-range values go to the edge bins)."""
  bins = jnp.floor((actions + 1.0) * (0.5 * num_bins))
  return jnp.clip(bins, 0, num_bins - 1).astype(jnp.int32)


def bins_to_actions(bins: Array, num_bins: int) -> Array:
  """int bins -> float32 bin centres -1 + (2 b + 1) / num_bins (for 4 bins: -0.75, -0.25, 0.25, 0.75)."""
  return -1.0 + (2.0 * bins.astype(jnp.float32) + 1.0) / num_bins


def token_log_probs(logits: Array, tokens: Array) -> Array:
  """logits [..., num_bins], tokens [...] int -> log softmax(logits)[token], float32 [...]."""
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_p, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def log_prob_and_entropy(logits: Array, tokens: Array) -> Tuple[Array, Array]:
  """logits [B, M, num_bins], tokens [B, M] (or [B, K, A], flattened) -> (log_prob [B], entropy [B]).

  log_prob is the sequence's log-probability, sum_m log p(t_m | t_<m). entropy is sum_m H(p(. | t_<m)), the exact
  per-step entropies along the given sequence; by the chain rule its expectation over sequences drawn from the
  policy is the joint entropy, so it is a one-sample estimate of that (like the Gaussian head's estimate).
  """
  chex.assert_rank(logits, 3)
  tokens = tokens.reshape(logits.shape[:2])
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(log_p, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  return jnp.sum(chosen, axis=-1), jnp.sum(entropy, axis=-1)


def attention_mask(query_pos: Array, key_pos: Array, prefix_length: int) -> Array:
  """Prefix-LM mask [S, T]: query i sees key j iff j <= i or j < prefix_length (prefix_length 0: causal)."""
  q, k = query_pos[:, None], key_pos[None, :]
  return (k <= q) | (k < prefix_length)


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """Scaled dot-product attention. q [B, H, S, Dh], k/v [B, H, T, Dh], mask [S, T] or [B, 1, S, T] bool ->
  [B, H, S, Dh]. Scores and softmax in float32 whatever the compute dtype; masked keys get weight exactly 0."""
  scale = q.shape[-1]**-0.5
  scores = jnp.einsum('bhsd,bhtd->bhst', q, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum('bhst,bhtd->bhsd', weights, v)


class CachedSelfAttention(nn.Module):
  """Multi-head self-attention over `x [B, S, D]` at absolute positions `cache_length + arange(S)`.

  layer_cache None: the keys are x's own (one full pass). Otherwise (k, v) [B, H, T, Dh]: x's keys and values
  are written at [cache_length, cache_length + S) and the queries attend over the whole (masked) cache.
  Returns (out [B, S, D], updated (k, v) or None).
  """
  num_heads: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, prefix_length: int, layer_cache: Optional[Tuple[Array, Array]],
               cache_length: Array) -> Tuple[Array, Optional[Tuple[Array, Array]]]:
    batch, s, d = x.shape
    head_dim = d // self.num_heads
    qkv = nn.DenseGeneral((3, self.num_heads, head_dim), dtype=self.dtype, name='qkv')(x)  # [B, S, 3, H, Dh]
    q, k, v = (jnp.swapaxes(qkv[:, :, i], 1, 2) for i in range(3))  # each [B, H, S, Dh]
    query_pos = cache_length + jnp.arange(s)
    if layer_cache is None:
      keys, values, key_pos, new_cache = k, v, query_pos, None
    else:
      ck, cv = layer_cache
      start = (0, 0, cache_length, 0)
      keys = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), start)
      values = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), start)
      key_pos, new_cache = jnp.arange(ck.shape[2]), (keys, values)
    mask = attention_mask(query_pos, key_pos, prefix_length) & (key_pos < cache_length + s)[None, :]
    out = jnp.swapaxes(attend(q, keys, values, mask), 1, 2)  # [B, S, H, Dh]
    out = nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name='out')(out)
    return out, new_cache


class DecoderBlock(nn.Module):
  """Pre-LN block: x + Attn(LN(x)), x + MLP(LN(x)); passes the layer's cache through (see CachedSelfAttention)."""
  num_heads: int
  mlp_ratio: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, prefix_length, layer_cache, cache_length):
    d = x.shape[-1]
    h, layer_cache = CachedSelfAttention(self.num_heads, self.dtype,
                                         name='attn')(nn.LayerNorm(dtype=self.dtype, name='ln_attn')(x), prefix_length,
                                                      layer_cache, cache_length)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name='ln_mlp')(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * d, dtype=self.dtype, name='mlp_in')(h))
    return x + nn.Dense(d, dtype=self.dtype, name='mlp_out')(h), layer_cache


def state_tokens(state: Array, token_size: int) -> Array:
  """state [B, O] -> [B, ceil(O / token_size), token_size], zero-padded (as `TransformerActorCritic` cuts it)."""
  chex.assert_rank(state, 2)
  batch, obs_dim = state.shape
  num_tokens = -(-obs_dim // token_size)
  pad = num_tokens * token_size - obs_dim
  return jnp.pad(state, ((0, 0), (0, pad))).reshape(batch, num_tokens, token_size)


class StateTokenizer(nn.Module):
  """state [B, O] -> tokens [B, ceil(O / token_size), token_size] (`state_tokens`; no parameters: the policy's
  own embedding and positions follow). As a tokenizer module the policy takes the same `obs [B, O]` as every
  other network, so `stages` and the workers need no token size, and a pixel tokenizer takes its place."""
  token_size: int = 4

  def __call__(self, state: Array) -> Array:
    return state_tokens(state, self.token_size)


class _ObsEmbed(nn.Module):
  """obs tokens [B, N, D_in] -> prefix [B, N + 1, D]: dense embed + learned positions, then a learned BOS."""
  d_model: int
  dtype: Dtype

  @nn.compact
  def __call__(self, tokens: Array) -> Array:
    chex.assert_rank(tokens, 3)
    batch, n, _ = tokens.shape
    x = nn.Dense(self.d_model, dtype=self.dtype, name='embed')(tokens.astype(self.dtype))
    x = x + self.param('pos_embed', _EMBED_INIT, (n, self.d_model)).astype(self.dtype)
    bos = jnp.broadcast_to(self.param('bos', _EMBED_INIT, (1, 1, self.d_model)), (batch, 1, self.d_model))
    return jnp.concatenate([x, bos.astype(self.dtype)], axis=1)


class TokenPolicy(layers.PolicyNetwork):
  """Decoder over [obs tokens, BOS, action tokens] with a categorical head over `num_bins` and a value head.

  Params are float32; `dtype` is the compute dtype of the trunk and the KV cache; logits and values are float32.
  Methods (called through `apply(..., method=...)` by the module-level functions): `__call__` (teacher-forced),
  `prefill`, `step`, `value`. `policy_head`: how `generation.stages` runs it (set below the functions it uses).
  """
  policy_head: ClassVar[stages.PolicyHead]
  action_dim: int
  action_chunk: int = 1
  num_bins: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_ratio: int = 4
  dtype: Dtype = jnp.float32
  tokenizer: Optional[nn.Module] = None
  critic: str = 'shared'  # or 'mlp': a separate MLP of `value_hidden_sizes` on the state (module doc)
  value_hidden_sizes: Sequence[int] = (256, 256, 256, 256, 256)

  @property
  def num_action_tokens(self) -> int:
    return self.action_chunk * self.action_dim

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} must be a multiple of num_heads={self.num_heads}.')
    self.obs_embed = _ObsEmbed(self.d_model, self.dtype)
    self.token_embed = nn.Embed(self.num_bins, self.d_model, embedding_init=_EMBED_INIT, dtype=self.dtype)
    self.slot_embed = self.param('slot_embed', _EMBED_INIT, (self.num_action_tokens, self.d_model))
    self.blocks = [DecoderBlock(self.num_heads, self.mlp_ratio, self.dtype) for _ in range(self.num_layers)]
    self.ln_final = nn.LayerNorm(dtype=jnp.float32)
    self.action_head = nn.Dense(self.num_bins, kernel_init=_HEAD_INIT)
    if self.critic == 'shared':
      self.value_head = nn.Dense(1, kernel_init=_HEAD_INIT)
    else:
      self.value_mlp = layers.MLP(tuple(self.value_hidden_sizes) + (1,))

  def _value(self, h_bos: Array, obs) -> Array:
    """value [B] float32: the shared head on BOS's output h_bos [B, D], or the MLP critic on obs's state."""
    if self.critic == 'shared':
      return self.value_head(h_bos)[:, 0]
    state = types.proprioception(obs)  # [B, O] (or pre-cut tokens [B, N, S] without a tokenizer)
    return self.value_mlp(state.reshape(state.shape[0], -1).astype(jnp.float32))[:, 0]

  def _prefix(self, obs) -> Array:
    tokens = obs if self.tokenizer is None else self.tokenizer(obs)
    return self.obs_embed(tokens)  # [B, P, D]

  def _embed_tokens(self, tokens: Array, first_slot) -> Array:
    """tokens [B, S] int -> [B, S, D]: bin embedding + the embedding of slots first_slot .. first_slot + S - 1."""
    slots = jax.lax.dynamic_slice_in_dim(self.slot_embed, first_slot, tokens.shape[1], axis=0)
    return self.token_embed(tokens) + slots.astype(self.dtype)[None]

  def _trunk(self, x: Array, prefix_length: int, cache: Optional[KVCache]) -> Tuple[Array, Optional[KVCache]]:
    """x [B, S, D] -> (normed hidden [B, S, D] float32, cache advanced by S or None)."""
    length = jnp.zeros((), jnp.int32) if cache is None else cache.length
    ks, vs = [], []
    for i, block in enumerate(self.blocks):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i])
      x, layer_cache = block(x, prefix_length, layer_cache, length)
      if cache is not None:
        ks.append(layer_cache[0])
        vs.append(layer_cache[1])
    h = self.ln_final(x.astype(jnp.float32))
    if cache is None:
      return h, None
    return h, KVCache(k=jnp.stack(ks), v=jnp.stack(vs), length=length + x.shape[1])

  def __call__(self, obs, tokens: Array) -> Tuple[Array, Array]:
    """Teacher-forced pass: tokens [B, K, A] -> (logits [B, M, num_bins] float32, value [B] float32);
    logits[:, m] is the distribution of t_m given the observation and t_<m."""
    x = self._prefix(obs)
    batch, p, _ = x.shape
    chex.assert_shape(tokens, (batch, self.action_chunk, self.action_dim))
    x = jnp.concatenate([x, self._embed_tokens(tokens.reshape(batch, -1), 0)], axis=1)  # [B, P + M, D]
    h, _ = self._trunk(x, p, None)
    logits = self.action_head(h[:, p - 1:-1])
    return logits, self._value(h[:, p - 1], obs)

  def prefill(self, obs) -> Tuple[Array, Array, KVCache]:
    """obs -> (logits of t_0 [B, num_bins], value [B], cache holding the P prefix positions of P + M)."""
    x = self._prefix(obs)
    batch, p, _ = x.shape
    shape = (self.num_layers, batch, self.num_heads, p + self.num_action_tokens, self.d_model // self.num_heads)
    empty = KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype), length=jnp.zeros((), jnp.int32))
    h, cache = self._trunk(x, p, empty)
    return self.action_head(h[:, -1]), self._value(h[:, -1], obs), cache

  def step(self, token: Array, slot: Array, cache: KVCache) -> Tuple[Array, KVCache]:
    """Feeds t_slot (token [B] int) at position cache.length -> (logits of t_{slot+1} [B, num_bins], cache)."""
    x = self._embed_tokens(token[:, None], slot)
    h, cache = self._trunk(x, 0, cache)  # every cached key is at or before the query: plain causal
    return self.action_head(h[:, 0]), cache

  def value(self, obs) -> Array:
    """obs -> value [B] from the prefix alone (the bootstrap value; no action tokens needed)."""
    if self.critic != 'shared':
      return self._value(None, obs)  # the MLP critic needs no trunk pass
    x = self._prefix(obs)
    h, _ = self._trunk(x, x.shape[1], None)
    return self._value(h[:, -1], obs)


def init(policy: TokenPolicy, key: PRNGKey, obs) -> Params:
  """Variables of `policy` for observations shaped like `obs` (any batch size; N is fixed by it)."""
  batch = jax.tree_util.tree_leaves(obs)[0].shape[0]
  tokens = jnp.zeros((batch, policy.action_chunk, policy.action_dim), jnp.int32)
  return jax.jit(policy.init)(key, obs, tokens)


def full_forward(policy: TokenPolicy, variables: Params, obs, tokens: Array) -> Tuple[Array, Array]:
  """One causal pass over [obs, BOS, tokens]: tokens [B, K, A] -> (logits [B, K*A, num_bins] float32, value [B])."""
  return policy.apply(variables, obs, tokens)


def value(policy: TokenPolicy, variables: Params, obs) -> Array:
  """Critic only: obs -> value [B] float32."""
  return policy.apply(variables, obs, method=TokenPolicy.value)


def decode(policy: TokenPolicy,
           variables: Params,
           obs,
           key: PRNGKey,
           deterministic: bool = False,
           temperature: float = 1.0,
           unroll: int = 1) -> DecodeOutput:
  """Samples the K*A action tokens one at a time with the KV cache.

  Args:
    policy: the module (static under jit); variables: its variables; obs: see the module docstring.
    key: PRNG key, split into one key per token.
    deterministic: argmax instead of sampling (static). Log-probs are then those of the argmax tokens at
      temperature 1.
    temperature: sampling temperature (static); log-probs are those of the tempered distribution that drew the
      tokens (the behaviour log-probs). Training recomputes them at temperature 1: sample at 1 for on-policy PPO.
    unroll: token steps per iteration of the decoding `lax.scan` (static; `experiments/decode_bench.py` times it).
  Returns:
    DecodeOutput; with temperature 1, token_log_probs equal those `full_forward` gives for the returned tokens.
  """
  logits, values, cache = policy.apply(variables, obs, method=TokenPolicy.prefill)
  m = policy.num_action_tokens
  scale = 1.0 if deterministic else 1.0 / temperature

  def body(carry, xs):
    cache, logits = carry
    step_key, slot = xs
    scaled = logits.astype(jnp.float32) * scale
    token = (jnp.argmax(scaled, axis=-1) if deterministic else jax.random.categorical(step_key, scaled)).astype(
        jnp.int32)
    log_p = token_log_probs(scaled, token)
    logits, cache = policy.apply(variables, token, slot, cache, method=TokenPolicy.step)
    return (cache, logits), (token, log_p)

  _, (tokens, log_ps) = jax.lax.scan(body, (cache, logits), (jax.random.split(key, m), jnp.arange(m)), unroll=unroll)
  batch = values.shape[0]
  shape = (batch, policy.action_chunk, policy.action_dim)
  tokens = jnp.swapaxes(tokens, 0, 1).reshape(shape)  # scan stacks [M, B]
  log_ps = jnp.swapaxes(log_ps, 0, 1).reshape(shape)
  chex.assert_shape(values, (batch,))
  return DecodeOutput(tokens=tokens,
                      actions=bins_to_actions(tokens, policy.num_bins),
                      token_log_probs=log_ps,
                      log_probs=jnp.sum(log_ps, axis=(1, 2)),
                      values=values.astype(jnp.float32))


def evaluate(policy: TokenPolicy, variables: Params, obs, tokens: Array) -> stages.EvalOutput:
  """Training-side scoring of stored tokens [B, K, A] at temperature 1: EvalOutput(log_probs [B], entropy [B]
  (see `log_prob_and_entropy`), values [B]), the same record `stages.evaluate` returns for the Gaussian heads.
  `tokens` may be int or the float32 ids `Transition.raw_action` carries (exact below 2^24): cast to int32."""
  tokens = tokens.astype(jnp.int32)
  logits, values = full_forward(policy, variables, obs, tokens)
  log_probs, entropy = log_prob_and_entropy(logits, tokens)
  return stages.EvalOutput(log_probs=log_probs, entropy=entropy, values=values)


def _head_act(policy, variables, obs, key, deterministic, min_std) -> ActOutput:
  del min_std  # a Gaussian floor; categorical tokens have none
  out = decode(policy, variables, obs, key, deterministic=deterministic)
  return ActOutput(actions=out.actions,
                   raw_actions=out.tokens.astype(jnp.float32),
                   log_probs=out.log_probs,
                   values=out.values)


def _head_evaluate(policy, variables, obs, raw_actions, key, min_std) -> stages.EvalOutput:
  del key, min_std  # the entropy is exact (no sample) and there is no scale floor
  return evaluate(policy, variables, obs, raw_actions)


TokenPolicy.policy_head = stages.PolicyHead(init=init, act=_head_act, evaluate=_head_evaluate, value=value)
