"""PPO (with GAE and a decoupled behaviour/proximal correction) and GRPO losses, as pure functions.

With `mask` all ones and proximal == behaviour log-probs, `ppo_loss` equals Brax's `compute_ppo_loss`
(value_cost = Brax's 0.5 * vf_loss_coefficient). Axis names: T time, B segments (or envs), O obs dim,
K action chunk, A action dim.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ebrl_jax.config import AlgoConfig
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.trainer import critic
from ebrl_jax.types import Array, PRNGKey, Transition

Metrics = Dict[str, Array]
ADVANTAGE_EPS = 1e-8


def masked_mean(x: Array, mask: Array, axis_name: Optional[str] = None) -> Array:
  """Weighted mean sum(x * mask) / sum(mask) (0 if the mask is empty). With `axis_name` (data-parallel ranks under
  `shard_map`) both sums run over every rank's shard, so the mean is the one of the global batch."""
  if axis_name is None:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return jax.lax.psum(jnp.sum(x * mask), axis_name) / jnp.maximum(jax.lax.psum(jnp.sum(mask), axis_name), 1.0)


def compute_gae(reward: Array, value: Array, bootstrap_value: Array, termination: Array, truncation: Array,
                discount: float, gae_lambda: float) -> Tuple[Array, Array]:
  """Generalised advantage estimation with Brax's truncation semantics.

  Args:
    reward, value, termination, truncation: [T, B]; bootstrap_value: [B] = V(next_obs[T-1]).
  Returns:
    (vs [T, B] value targets, advantages [T, B]), both without gradient.
  Termination stops bootstrapping (the next value is multiplied by 1 - termination). At a truncated step the
  TD error and the advantage are zeroed and the recursion restarts, so a time-limit cut contributes nothing
  and earlier steps bootstrap from V(obs) of the cut step.
  """
  chex.assert_equal_shape([reward, value, termination, truncation])
  chex.assert_shape(bootstrap_value, reward.shape[1:])
  keep = 1.0 - truncation
  not_done = 1.0 - termination
  next_value = jnp.concatenate([value[1:], bootstrap_value[None]], axis=0)
  deltas = (reward + discount * not_done * next_value - value) * keep

  def backward(acc, xs):
    delta, nd, kp = xs
    acc = delta + discount * gae_lambda * nd * kp * acc
    return acc, acc

  _, vs_minus_v = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value), (deltas, not_done, keep), reverse=True)
  vs = vs_minus_v + value
  next_vs = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
  advantages = (reward + discount * not_done * next_vs - value) * keep
  return jax.lax.stop_gradient(vs), jax.lax.stop_gradient(advantages)


def grpo_advantages(episode_returns: Array, group_size: int, eps: float = 1e-6) -> Array:
  """[B] returns -> [B] advantages (R - group mean) / (group std + eps) over consecutive groups of `group_size`
  (population std)."""
  chex.assert_rank(episode_returns, 1)
  if episode_returns.shape[0] % group_size:
    raise ValueError(f'{episode_returns.shape[0]} returns do not split into groups of group_size={group_size}.')
  groups = episode_returns.reshape(-1, group_size)
  mean = jnp.mean(groups, axis=1, keepdims=True)
  std = jnp.std(groups, axis=1, keepdims=True)
  return ((groups - mean) / (std + eps)).reshape(-1)


def merge_time(obs):
  """Observations [T, B, ...] (the state, or each leaf of a `PixelObs`) -> [T * B, ...]."""
  return jax.tree_util.tree_map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), obs)


def _evaluate_segments(network: nn.Module, params: gen_stages.PolicyParams, batch: Transition, key: PRNGKey,
                       min_std: float) -> gen_stages.EvalOutput:
  """Flattens [T, B] to the network's batch axis and back: EvalOutput with [T, B] fields. `gen_stages.evaluate`
  dispatches on the network (Gaussian raw actions or float32 token ids in `batch.raw_action`)."""
  t, b = batch.reward.shape
  out = gen_stages.evaluate(network, params, merge_time(batch.obs),
                            batch.raw_action.reshape((t * b,) + batch.raw_action.shape[2:]), key, min_std)
  return jax.tree_util.tree_map(lambda x: x.reshape(t, b), out)


LOG_RATIO_LIMIT = 20.0


def values_per_step(batch: Transition) -> int:
  """Action values one policy step's log-prob sums over: chunk x action size (raw_action [T, B, K, A])."""
  return int(math.prod(batch.raw_action.shape[2:]))


def clipped_surrogate(log_probs: Array,
                      proximal_log_prob: Array,
                      behaviour_log_prob: Array,
                      advantages: Array,
                      mask: Array,
                      algo: AlgoConfig,
                      axis_name: Optional[str] = None,
                      values_per_step: int = 1) -> Tuple[Array, Metrics]:
  """Decoupled PPO objective -mean(w * min(r A, clip(r) A)), r = pi/pi_prox, w = clip(pi_prox/pi_behav).

  With `algo.policy_ratio='geometric'` both ratios are per action value: the log-ratios (of log-probs summed over
  the step's `values_per_step` = chunk x action values, or tokens) are divided by it, the geometric mean of the
  per-value ratios (GSPO's length-normalised sequence ratio). A joint ratio over many values moves by their product:
  12 tokens that each move 2 % move it 27 %, past the clip range, so the token policy's updates clip most samples.

  NOTE: log-ratios are clamped to +-LOG_RATIO_LIMIT before `exp`. With a tanh-Gaussian whose scale can shrink to
  `min_std`, a small move of the mean (or of the observation normaliser between acting and training) can change
  a log-prob by thousands of nats; exp() would then overflow to inf and the gradient turn NaN (seen with
  16-env async runs). Past e^20 the clipped surrogate carries no useful gradient anyway, so such samples just
  stop contributing one, and everywhere else the objective is unchanged.
  """
  per = 1.0 / values_per_step if algo.policy_ratio == 'geometric' else 1.0
  log_ratio = jnp.clip((log_probs - proximal_log_prob) * per, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  ratio = jnp.exp(log_ratio)
  log_weight = jnp.clip((proximal_log_prob - behaviour_log_prob) * per, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  weight = jax.lax.stop_gradient(jnp.clip(jnp.exp(log_weight), 0.0, algo.max_behaviour_ratio))
  clipped = jnp.clip(ratio, 1.0 - algo.clip_epsilon, 1.0 + algo.clip_epsilon)
  surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
  mean = functools.partial(masked_mean, mask=mask, axis_name=axis_name)
  policy_loss = -mean(weight * surrogate)
  metrics = {
      'policy_loss': policy_loss,
      'approx_kl': mean((ratio - 1.0) - log_ratio),  # k3 estimator of KL(prox || pi)
      'clip_fraction': mean((jnp.abs(ratio - 1.0) > algo.clip_epsilon).astype(jnp.float32)),
      'behaviour_weight': mean(weight),
  }
  return policy_loss, metrics


def batch_gae(batch: Transition,
              algo: AlgoConfig,
              values: Array,
              bootstrap_value: Array,
              value_stats: Optional[critic.ValueStats] = None) -> Tuple[Array, Array]:
  """`compute_gae` on a batch [T, B] with the network's `values` [T, B] and `bootstrap_value` [B] (denormalised
  with `value_stats` under PopArt) and the batch's rewards scaled by `algo.reward_scaling`: (vs, advantages)."""
  return compute_gae(batch.reward * algo.reward_scaling, critic.denormalize(value_stats, values),
                     critic.denormalize(value_stats, bootstrap_value), batch.termination, batch.truncation,
                     algo.discount, algo.gae_lambda)


def ppo_loss(network: nn.Module,
             params: gen_stages.PolicyParams,
             batch: Transition,
             proximal_log_prob: Array,
             key: PRNGKey,
             algo: AlgoConfig,
             min_std: float,
             axis_name: Optional[str] = None,
             value_stats: Optional[critic.ValueStats] = None) -> Tuple[Array, Metrics]:
  """PPO loss on a minibatch of segments (with `axis_name`, this rank's share of a minibatch spread over the
  data-parallel ranks: every mean, the advantage normalisation's included, is over the whole minibatch).

  Args:
    batch: Transition with leading [T, B]; obs/next_obs [T, B, O] (or `PixelObs` of [T, B, ...]), raw_action
      [T, B, K, A].
    proximal_log_prob: [T, B] log-probs of the proximal policy (params at the start of the train step).
    key: for the entropy estimate.
  Returns:
    (total loss, metrics: total_loss, policy_loss, value_loss, entropy_loss, entropy, approx_kl,
     clip_fraction, behaviour_weight).
  Values are recomputed with `params` for obs and for the last next_obs (the bootstrap). With `value_stats` (a
  `critic.ValueStats`: `--value_norm_rate`, PopArt) the network's values are normalised: GAE runs on
  `value * std + mean`, and the critic regresses `(target - mean) / std` (value_loss in those units).
  """
  chex.assert_equal_shape([batch.reward, proximal_log_prob, batch.mask, batch.termination, batch.truncation])
  out = _evaluate_segments(network, params, batch, key, min_std)
  bootstrap_value = gen_stages.value(network, params, jax.tree_util.tree_map(lambda x: x[-1], batch.next_obs))
  vs, advantages = batch_gae(batch, algo, out.values, bootstrap_value, value_stats)
  mask = batch.mask.astype(jnp.float32)
  if algo.normalize_advantage:
    mean = masked_mean(advantages, mask, axis_name)
    std = jnp.sqrt(masked_mean(jnp.square(advantages - mean), mask, axis_name))
    advantages = (advantages - mean) / (std + ADVANTAGE_EPS)
  policy_loss, metrics = clipped_surrogate(out.log_probs, proximal_log_prob, batch.behaviour_log_prob, advantages, mask,
                                           algo, axis_name, values_per_step(batch))
  value_loss = algo.value_cost * masked_mean(jnp.square(critic.normalize(value_stats, vs) - out.values), mask,
                                             axis_name)
  entropy = masked_mean(out.entropy, mask, axis_name)
  entropy_loss = -algo.entropy_cost * entropy
  total = policy_loss + value_loss + entropy_loss
  metrics.update(total_loss=total, value_loss=value_loss, entropy_loss=entropy_loss, entropy=entropy)
  return total, metrics


def grpo_loss(network: nn.Module,
              params: gen_stages.PolicyParams,
              batch: Transition,
              advantages: Array,
              proximal_log_prob: Array,
              key: PRNGKey,
              algo: AlgoConfig,
              min_std: float,
              axis_name: Optional[str] = None) -> Tuple[Array, Metrics]:
  """GRPO loss: the clipped surrogate with per-episode advantages [B] broadcast over T, masked, plus the
  entropy bonus; no critic (value_loss reported as 0). Same metrics (and `axis_name`) as `ppo_loss`."""
  chex.assert_equal_shape([batch.reward, proximal_log_prob, batch.mask])
  chex.assert_shape(advantages, batch.reward.shape[1:])
  out = _evaluate_segments(network, params, batch, key, min_std)
  mask = batch.mask.astype(jnp.float32)
  adv = jnp.broadcast_to(advantages[None], batch.reward.shape)
  policy_loss, metrics = clipped_surrogate(out.log_probs, proximal_log_prob, batch.behaviour_log_prob, adv, mask, algo,
                                           axis_name, values_per_step(batch))
  entropy = masked_mean(out.entropy, mask, axis_name)
  entropy_loss = -algo.entropy_cost * entropy
  total = policy_loss + entropy_loss
  metrics.update(total_loss=total, value_loss=jnp.zeros(()), entropy_loss=entropy_loss, entropy=entropy)
  return total, metrics
