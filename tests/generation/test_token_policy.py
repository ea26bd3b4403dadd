"""Autoregressive action-token policy: bin mapping, hand-computed log-probs and entropy, masks, KV-cache decoding
equal to the teacher-forced pass, argmax decoding, sampling frequencies, a PPO step, bfloat16 compute."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ebrl_jax.config import AlgoConfig
from ebrl_jax.generation import token_policy as tp
from ebrl_jax.generation import vision
from ebrl_jax.trainer import losses

B, N, D_IN, K, A, BINS = 3, 4, 5, 2, 3, 8

decode_jit = jax.jit(tp.decode, static_argnums=(0,), static_argnames=('deterministic', 'temperature', 'unroll'))
forward_jit = jax.jit(tp.full_forward, static_argnums=(0,))
value_jit = jax.jit(tp.value, static_argnums=(0,))
evaluate_jit = jax.jit(tp.evaluate, static_argnums=(0,))


def _policy(dtype=jnp.float32, k=K, a=A, **kw):
  return tp.TokenPolicy(action_dim=a,
                        action_chunk=k,
                        num_bins=BINS,
                        d_model=16,
                        num_layers=2,
                        num_heads=2,
                        mlp_ratio=2,
                        dtype=dtype,
                        **kw)


def _setup(policy=None, batch=B, noise=0.5):
  """Params with noise added: the initial action head (scale 0.01) gives near-uniform logits, which would let a
  wrong cache or mask pass unnoticed."""
  policy = policy or _policy()
  obs = jax.random.normal(jax.random.PRNGKey(0), (batch, N, D_IN))
  variables = tp.init(policy, jax.random.PRNGKey(1), obs)
  leaves, tree = jax.tree_util.tree_flatten(variables)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  leaves = [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return policy, jax.tree_util.tree_unflatten(tree, leaves), obs


def test_bins_by_hand_and_round_trip():
  # 4 bins of width 0.5: [-1, -0.5) -> 0, [-0.5, 0) -> 1, [0, 0.5) -> 2, [0.5, 1] -> 3; outside clips.
  a = jnp.array([-1.0, -0.75, -0.5, -0.01, 0.0, 0.49, 0.5, 0.99, 1.0, 1.5, -2.0])
  np.testing.assert_array_equal(tp.actions_to_bins(a, 4), [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 0])
  assert tp.actions_to_bins(a, 4).dtype == jnp.int32
  np.testing.assert_allclose(tp.bins_to_actions(jnp.arange(4), 4), [-0.75, -0.25, 0.25, 0.75])
  bins = jnp.arange(256)
  np.testing.assert_array_equal(tp.actions_to_bins(tp.bins_to_actions(bins, 256), 256), bins)
  assert int(tp.actions_to_bins(jnp.array(-1.0), 256)) == 0 and int(tp.actions_to_bins(jnp.array(1.0), 256)) == 255
  x = jnp.linspace(-1.0, 1.0, 1001)
  err = jnp.abs(tp.bins_to_actions(tp.actions_to_bins(x, 256), 256) - x)
  assert float(jnp.max(err)) <= 1.0 / 256 + 1e-6  # at most half a bin width (2 / 256 / 2)


def test_log_prob_and_entropy_by_hand():
  # logits [0, ln 2, ln 3] -> probs [1, 2, 3] / 6. Sample 0 picks bins (2, 0): log(3/6) + log(1/6) = -2.4849;
  # sample 1 picks (1, 1): 2 log(2/6) = -2.1972. Entropy per token = (1/6) ln 6 + (2/6) ln 3 + (3/6) ln 2
  # = 0.29863 + 0.36620 + 0.34657 = 1.01140, and 2.02281 for the two tokens of a sample.
  logits = jnp.broadcast_to(jnp.log(jnp.array([1.0, 2.0, 3.0])), (2, 2, 3))
  log_prob, entropy = tp.log_prob_and_entropy(logits, jnp.array([[2, 0], [1, 1]]))
  np.testing.assert_allclose(log_prob, [np.log(3 / 6) + np.log(1 / 6), 2 * np.log(2 / 6)], rtol=1e-6)
  np.testing.assert_allclose(log_prob, [-2.484907, -2.197225], rtol=1e-5)
  np.testing.assert_allclose(entropy, [2.022809, 2.022809], rtol=1e-5)
  # Shifting the logits changes nothing (softmax invariance); [B, K, A] tokens are flattened row-major.
  shifted, _ = tp.log_prob_and_entropy(logits + 7.0, jnp.array([[[2, 0]], [[1, 1]]]))
  np.testing.assert_allclose(shifted, log_prob, rtol=1e-6)


def test_attention_mask_and_attend_by_hand():
  # Prefix of 2, then 2 causal tokens: rows are queries 0..3, columns keys 0..3.
  mask = tp.attention_mask(jnp.arange(4), jnp.arange(4), 2)
  np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(tp.attention_mask(jnp.arange(3), jnp.arange(3), 0), np.tril(np.ones((3, 3))))
  # Zero queries give equal scores, so each query averages the values it may see: query 0 sees keys 0 and 1
  # (values 1 and 2 -> 1.5), query 3 sees all four (values 1..4 -> 2.5).
  q = jnp.zeros((1, 1, 4, 1))
  v = jnp.arange(1.0, 5.0).reshape(1, 1, 4, 1)
  np.testing.assert_allclose(tp.attend(q, v, v, mask)[0, 0, :, 0], [1.5, 1.5, 2.0, 2.5], rtol=1e-6)


# Deterministic decoding through the cache: test_deterministic_decode_is_argmax_and_key_independent.
@pytest.mark.parametrize('deterministic,critic', [(False, 'shared'), (False, 'mlp')])
def test_kv_cache_decode_equals_full_causal_forward(deterministic, critic):
  policy, variables, obs = _setup(_policy(critic=critic, value_hidden_sizes=(8, 8)))
  assert ('value_mlp' in variables['params']) == (critic == 'mlp')
  out = decode_jit(policy, variables, obs, jax.random.PRNGKey(3), deterministic=deterministic)
  assert out.tokens.shape == out.actions.shape == out.token_log_probs.shape == (B, K, A)
  assert out.tokens.dtype == jnp.int32 and out.actions.dtype == jnp.float32
  assert out.log_probs.shape == out.values.shape == (B,)
  logits, values = forward_jit(policy, variables, obs, out.tokens)
  assert logits.shape == (B, K * A, BINS) and logits.dtype == jnp.float32
  per_token = tp.token_log_probs(logits, out.tokens.reshape(B, -1))
  np.testing.assert_allclose(per_token, out.token_log_probs.reshape(B, -1), atol=1e-5)
  log_prob, _ = tp.log_prob_and_entropy(logits, out.tokens)
  np.testing.assert_allclose(log_prob, out.log_probs, atol=1e-5)
  np.testing.assert_allclose(values, out.values, atol=1e-5)
  np.testing.assert_allclose(value_jit(policy, variables, obs), out.values, atol=1e-5)
  np.testing.assert_allclose(out.actions, tp.bins_to_actions(out.tokens, BINS))
  # The test has teeth: the logits are far from uniform (log(1/8) = -2.079 for every token otherwise).
  assert float(jnp.max(jnp.abs(per_token - np.log(1 / BINS)))) > 0.5


@pytest.mark.parametrize('unroll', [2, K * A])
def test_unrolled_decoding_samples_the_same_tokens(unroll):
  policy, variables, obs = _setup()
  looped = decode_jit(policy, variables, obs, jax.random.PRNGKey(3))
  unrolled = decode_jit(policy, variables, obs, jax.random.PRNGKey(3), unroll=unroll)
  np.testing.assert_array_equal(unrolled.tokens, looped.tokens)
  np.testing.assert_allclose(unrolled.token_log_probs, looped.token_log_probs, atol=1e-6)
  # Teeth: another key samples other tokens, so equal tokens above are not a constant.
  other = decode_jit(policy, variables, obs, jax.random.PRNGKey(4), unroll=unroll)
  assert not np.array_equal(other.tokens, looped.tokens)


def test_teacher_forced_pass_is_causal_in_the_action_tokens():
  policy, variables, obs = _setup()
  tokens = jnp.zeros((B, K, A), jnp.int32)
  changed = tokens.at[:, 0, 1].set(5)  # t_1 (k = 0, a = 1)
  diff = jnp.max(
      jnp.abs(forward_jit(policy, variables, obs, changed)[0] - forward_jit(policy, variables, obs, tokens)[0]),
      axis=(0, 2))
  np.testing.assert_array_equal(diff[:2], 0.0)  # logits of t_0 and t_1 cannot see t_1
  assert np.all(diff[2:] > 0)  # t_2 .. t_5 do


def test_deterministic_decode_is_argmax_and_key_independent():
  policy, variables, obs = _setup()
  a = decode_jit(policy, variables, obs, jax.random.PRNGKey(0), deterministic=True)
  b = decode_jit(policy, variables, obs, jax.random.PRNGKey(1), deterministic=True)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  logits, _ = forward_jit(policy, variables, obs, a.tokens)
  np.testing.assert_array_equal(jnp.argmax(logits, axis=-1), a.tokens.reshape(B, -1))


def test_jit_matches_eager_and_sampling_follows_the_softmax():
  policy, variables, obs = _setup(_policy(k=1, a=1), batch=4000)
  out = decode_jit(policy, variables, obs[:2], jax.random.PRNGKey(5))
  eager = tp.decode(policy, variables, obs[:2], jax.random.PRNGKey(5))
  np.testing.assert_array_equal(eager.tokens, out.tokens)
  np.testing.assert_allclose(eager.log_probs, out.log_probs, atol=1e-6)
  # One token, the same observation 4000 times: bin frequencies approach softmax(logits) (std <= 0.008).
  same = jnp.broadcast_to(obs[:1], obs.shape)
  out = decode_jit(policy, variables, same, jax.random.PRNGKey(6))
  probs = jax.nn.softmax(forward_jit(policy, variables, same[:1], out.tokens[:1])[0][0, 0])
  freq = jnp.bincount(out.tokens.reshape(-1), length=BINS) / same.shape[0]
  np.testing.assert_allclose(freq, probs, atol=0.03)


def test_pixel_tokenizer_prefix_decodes_and_matches():
  policy = _policy(tokenizer=vision.PixelTokenizer(patch_size=4, d_model=8, obs_token_size=4))
  pixels = jax.random.randint(jax.random.PRNGKey(0), (2, 16, 16, 6), 0, 256).astype(jnp.uint8)
  obs = vision.PixelObs(pixels=pixels, state=jnp.ones((2, 5)))
  variables = tp.init(policy, jax.random.PRNGKey(1), obs)
  assert 'tokenizer' in variables['params']
  out = decode_jit(policy, variables, obs, jax.random.PRNGKey(2))
  logits, _ = forward_jit(policy, variables, obs, out.tokens)
  np.testing.assert_allclose(tp.log_prob_and_entropy(logits, out.tokens)[0], out.log_probs, atol=1e-5)


def test_ppo_step_moves_the_chosen_tokens_log_prob_the_right_way():
  policy, variables, obs = _setup(noise=0.1)
  out = decode_jit(policy, variables, obs, jax.random.PRNGKey(3))
  algo = AlgoConfig()

  def loss(v, advantages):
    log_probs = tp.evaluate(policy, v, obs, out.tokens).log_probs
    return losses.clipped_surrogate(log_probs, out.log_probs, out.log_probs, advantages, jnp.ones(B), algo)[0]

  optimizer = optax.sgd(0.05)
  for sign in (1.0, -1.0):
    advantages = jnp.array([sign, 0.0, 0.0])  # only sample 0 is pushed
    grads = jax.jit(jax.grad(loss))(variables, advantages)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    updates, _ = optimizer.update(grads, optimizer.init(variables))  # plain SGD: updates = -0.05 * grads
    new = evaluate_jit(policy, optax.apply_updates(variables, updates), obs, out.tokens).log_probs
    assert sign * float(new[0] - out.log_probs[0]) > 1e-3, (sign, new, out.log_probs)


def test_bfloat16_compute_is_finite_and_close_to_float32():
  policy, variables, obs = _setup(noise=0.1)
  bf16 = _policy(jnp.bfloat16)
  tokens = decode_jit(policy, variables, obs, jax.random.PRNGKey(3)).tokens
  logits32, v32 = forward_jit(policy, variables, obs, tokens)
  logits16, v16 = forward_jit(bf16, variables, obs, tokens)
  assert logits16.dtype == v16.dtype == jnp.float32 and np.all(np.isfinite(logits16))
  np.testing.assert_allclose(logits16, logits32, atol=0.1)
  np.testing.assert_allclose(v16, v32, atol=0.1)
  out = decode_jit(bf16, variables, obs, jax.random.PRNGKey(3))
  assert np.all(np.isfinite(out.log_probs)) and out.log_probs.dtype == jnp.float32
  # The bf16 cache path and the bf16 full pass agree to bf16 rounding.
  np.testing.assert_allclose(tp.log_prob_and_entropy(forward_jit(bf16, variables, obs, out.tokens)[0], out.tokens)[0],
                             out.log_probs,
                             atol=0.1)


def test_rejects_width_not_divisible_by_heads():
  policy = tp.TokenPolicy(action_dim=2, num_bins=4, d_model=10, num_layers=1, num_heads=4)
  with pytest.raises(ValueError, match='num_heads=4'):
    tp.init(policy, jax.random.PRNGKey(0), jnp.zeros((1, 2, 3)))
