"""`--policy=token` wired into generation and training: make_network builds it, `stages.act` / `evaluate` /
`value` dispatch to it (token ids as float32 raw actions), bf16 compute through `--compute_dtype`, and a tiny
fused PPO run on the pendulum."""
import functools
import json
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.config import PolicyConfig
from ebrl_jax.generation import normalization, policies, stages
from ebrl_jax.generation import token_policy as tp

OBS, ACT, K, BINS, B = 7, 3, 2, 16, 6

act_jit = jax.jit(stages.act, static_argnums=(0,), static_argnames=('deterministic', 'min_std'))
evaluate_jit = jax.jit(stages.evaluate, static_argnums=(0, 5))
value_jit = jax.jit(stages.value, static_argnums=(0,))
tp_evaluate_jit = jax.jit(tp.evaluate, static_argnums=(0,))
tp_forward_jit = jax.jit(tp.full_forward, static_argnums=(0,))


def _cfg(**kw):
  values = dict(kind='token',
                d_model=16,
                num_layers=1,
                num_heads=2,
                mlp_ratio=2,
                num_bins=BINS,
                action_chunk=K,
                obs_token_size=3)
  values.update(kw)
  return PolicyConfig(**values)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _params(net, noise=0.5):
  """Params with noise (the initial action head, scale 0.01, gives near-uniform logits that would let a wrong
  dispatch pass) and a non-trivial normaliser (so a skipped normalisation shows)."""
  params = stages.init_policy_params(net, jax.random.PRNGKey(0), OBS)
  flat, unravel = jax.flatten_util.ravel_pytree(params.network)
  network = unravel(flat + noise * jax.random.normal(jax.random.PRNGKey(1), flat.shape))
  seen = jax.random.normal(jax.random.PRNGKey(2), (64, OBS)) * 3.0 + 2.0
  return params.replace(network=network, normalizer=normalization.update_stats(params.normalizer, seen))


def _obs(seed=3):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, OBS)) * 3.0 + 2.0


def test_make_network_builds_the_token_policy_from_the_config():
  net = policies.make_network(_cfg(), OBS, ACT)
  assert isinstance(net, tp.TokenPolicy)
  assert (net.action_dim, net.action_chunk, net.num_bins, net.d_model, net.num_layers, net.num_heads,
          net.mlp_ratio) == (ACT, K, BINS, 16, 1, 2, 2)
  assert net.dtype == jnp.float32 and isinstance(net.tokenizer, tp.StateTokenizer)
  assert net.tokenizer.token_size == 3
  params = stages.init_policy_params(net, jax.random.PRNGKey(0), OBS)
  p = params.network['params']
  assert p['obs_embed']['pos_embed'].shape == (3, 16)  # 7 state values in tokens of 3 -> ceil(7 / 3) = 3 tokens
  assert p['obs_embed']['embed']['kernel'].shape == (3, 16)
  assert p['token_embed']['embedding'].shape == (BINS, 16) and p['action_head']['kernel'].shape == (16, BINS)
  assert p['slot_embed'].shape == (K * ACT, 16)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params.network))
  assert stages.head_of(net) is tp.TokenPolicy.policy_head
  assert stages.head_of(policies.make_network(PolicyConfig(), OBS, ACT)) is stages.GAUSSIAN_HEAD


@pytest.mark.contract  # a whole network compiled several times: over the unit tier's ~3 s
@pytest.mark.slow
def test_act_returns_bin_centres_and_float_ids_that_evaluate_scores_to_the_same_log_probs():
  net = policies.make_network(_cfg(), OBS, ACT)
  params, obs = _params(net), _obs()
  out = act_jit(net, params, obs, jax.random.PRNGKey(4))
  assert out.actions.shape == out.raw_actions.shape == (B, K, ACT)
  assert out.raw_actions.dtype == jnp.float32 and out.log_probs.shape == out.values.shape == (B,)
  ids = np.asarray(out.raw_actions)
  assert np.array_equal(ids, np.round(ids)) and ids.min() >= 0 and ids.max() <= BINS - 1
  np.testing.assert_allclose(out.actions, -1.0 + (2.0 * ids + 1.0) / BINS, rtol=1e-6)  # bin centres
  assert np.all(np.abs(out.actions) < 1.0)
  ev = evaluate_jit(net, params, obs, out.raw_actions, jax.random.PRNGKey(5), 0.001)
  np.testing.assert_allclose(ev.log_probs, out.log_probs, atol=1e-5)
  np.testing.assert_allclose(ev.values, out.values, atol=1e-5)
  np.testing.assert_allclose(value_jit(net, params, obs), out.values, atol=1e-5)
  # Teeth: the log-probs are far from uniform (K * A * log(1/16) = -16.64 for every sample otherwise) ...
  assert float(jnp.max(jnp.abs(out.log_probs - K * ACT * math.log(1 / BINS)))) > 1.0
  # ... and evaluate is the token policy's own scoring of the normalised observation, ids cast to int32.
  normed = normalization.normalize(params.normalizer, obs)
  direct = tp_evaluate_jit(net, params.network, normed, out.raw_actions.astype(jnp.int32))
  np.testing.assert_allclose(ev.log_probs, direct.log_probs, atol=1e-5)
  np.testing.assert_allclose(ev.entropy, direct.entropy, atol=1e-5)
  raw = tp_evaluate_jit(net, params.network, obs, out.raw_actions.astype(jnp.int32))
  assert float(jnp.max(jnp.abs(raw.log_probs - ev.log_probs))) > 1e-3  # the normaliser matters here
  # Other tokens score differently: evaluate reads the ids it is given.
  other = evaluate_jit(net, params, obs, (out.raw_actions + 1.0) % BINS, jax.random.PRNGKey(5), 0.001)
  assert float(jnp.max(jnp.abs(other.log_probs - out.log_probs))) > 1e-2


@pytest.mark.contract
def test_deterministic_act_is_argmax_decoding_and_key_independent():
  net = policies.make_network(_cfg(), OBS, ACT)
  params, obs = _params(net), _obs()
  a = act_jit(net, params, obs, jax.random.PRNGKey(0), deterministic=True)
  b = act_jit(net, params, obs, jax.random.PRNGKey(1), deterministic=True)
  np.testing.assert_array_equal(a.raw_actions, b.raw_actions)
  normed = normalization.normalize(params.normalizer, obs)
  logits, _ = tp_forward_jit(net, params.network, normed, a.raw_actions.astype(jnp.int32))
  np.testing.assert_array_equal(jnp.argmax(logits, axis=-1), a.raw_actions.reshape(B, -1))


@pytest.mark.contract  # a whole network compiled several times: over the unit tier's ~3 s
@pytest.mark.slow
@pytest.mark.parametrize('kind', ['token', 'transformer'])
def test_bfloat16_compute_dtype_act_and_evaluate_are_finite_and_close_to_float32(kind):
  net32 = policies.make_network(_cfg(kind=kind), OBS, ACT)
  net16 = policies.make_network(_cfg(kind=kind, compute_dtype='bfloat16'), OBS, ACT)
  assert net16.dtype == jnp.bfloat16 and net32.dtype == jnp.float32
  params, obs = _params(net32, noise=0.1), _obs()
  params16 = stages.init_policy_params(net16, jax.random.PRNGKey(0), OBS)
  # The same parameter tree, all float32, whatever the compute dtype.
  assert jax.tree_util.tree_structure(params16.network) == jax.tree_util.tree_structure(params.network)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params16.network))
  out32 = act_jit(net32, params, obs, jax.random.PRNGKey(4))
  ev32 = evaluate_jit(net32, params, obs, out32.raw_actions, jax.random.PRNGKey(5), 0.001)
  ev16 = evaluate_jit(net16, params, obs, out32.raw_actions, jax.random.PRNGKey(5), 0.001)
  for x in ev16:
    assert x.dtype == jnp.float32 and np.all(np.isfinite(x))
  # Loose: bf16 keeps 8 mantissa bits (relative rounding 2^-8 = 0.4%) through the trunk.
  np.testing.assert_allclose(ev16.log_probs, ev32.log_probs, atol=0.3)
  np.testing.assert_allclose(ev16.entropy, ev32.entropy, atol=0.3)
  np.testing.assert_allclose(ev16.values, ev32.values, atol=0.05)
  out16 = act_jit(net16, params, obs, jax.random.PRNGKey(4), deterministic=True)
  for x in out16:
    assert x.dtype == jnp.float32 and np.all(np.isfinite(x))
  np.testing.assert_allclose(out16.values, ev32.values, atol=0.05)
  if kind == 'transformer':  # deterministic Gaussian actions: tanh(loc), smooth in the params
    det32 = act_jit(net32, params, obs, jax.random.PRNGKey(4), deterministic=True)
    np.testing.assert_allclose(out16.actions, det32.actions, atol=0.05)
  # bf16 is actually in use: the outputs are not bit-identical to float32.
  assert float(jnp.max(jnp.abs(ev16.log_probs - ev32.log_probs))) > 0.0


def _run_config(run_dir, **algo):
  sim = config_lib.SimConfig(task='inverted_pendulum',
                             backend='mujoco_cpu',
                             num_envs=8,
                             episode_length=100,
                             num_eval_envs=4,
                             num_threads=1)
  policy = PolicyConfig(kind='token', d_model=16, num_layers=1, num_heads=2, mlp_ratio=2, num_bins=16)
  algo = config_lib.AlgoConfig(
      **dict(dict(batch_size=8, num_minibatches=2, unroll_length=5, num_updates_per_batch=2), **algo))
  schedule = config_lib.ScheduleConfig(num_timesteps=4 * algo.segments_per_iteration * algo.unroll_length,
                                       num_evals=2,
                                       run_dir=str(run_dir),
                                       compilation_cache_dir='',
                                       progress_bar=False)
  return config_lib.Config(sim=sim, policy=policy, algo=algo, schedule=schedule)


@pytest.mark.e2e
@pytest.mark.slow
def test_fused_ppo_run_with_the_token_policy_finishes_with_finite_losses(tmp_path):
  cfg = _run_config(tmp_path / 'token')
  summary = controller.run(cfg)
  assert summary.env_steps == 4 * 16 * 5 and summary.iterations == 4  # 8 x 2 segments of 5 steps each
  records = [json.loads(line) for line in open(tmp_path / 'token' / 'metrics.jsonl')]
  losses = [r['train/ppo/total_loss'] for r in records if 'train/ppo/total_loss' in r]
  assert losses and all(np.isfinite(losses)), records
  entropy = [r[k] for r in records for k in r if k.endswith('/entropy')]
  assert entropy and all(0 < e <= math.log(16) + 1e-4 for e in entropy)  # one token per step (K = A = 1)
  assert np.isfinite(summary.best_eval_return)
