"""Training stage: one PPO/GRPO update (several epochs of minibatch SGD) on a batch of trajectory segments.

Pure functions; jit with (network, optimizer, algo, min_std) static and the state donated:

  train_fn = jax.jit(stages.train_step, static_argnums=(0, 1, 2, 3),
                     static_argnames=('group_size', 'recompute_proximal'), donate_argnums=(4,))
  state, metrics = train_fn(network, optimizer, algo, min_std, state, batch, key)

Axis names: T time, S segments (PPO: batch_size * num_minibatches) or envs (GRPO), O obs dim, K chunk, A action.

Data-parallel ranks (`trainer/parallel.py`) run the same `train_step` under `shard_map` with `axis_name` set: the
batch is this rank's cell's, every mean and the normaliser's update are over all ranks' batches (psum), and the
gradients, as the transpose of the replicated parameters, are summed over the ranks by the same collectives, so
every rank takes the same optimizer step. `axis_name=None` is the one-rank step, unchanged.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from ebrl_jax import config_checks
from ebrl_jax.config import AlgoConfig
from ebrl_jax.generation import normalization
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax import types
from ebrl_jax.trainer import critic
from ebrl_jax.trainer import losses
from ebrl_jax.types import Array, PRNGKey, Transition


@struct.dataclass
class TrainState:
  """params: policy parameters; opt_state: optax state of params.network; num_updates: optimizer steps taken
  (int32 []); policy_version: train steps taken (int32 []), the tag attached to segments the policy produces;
  value_stats: the value targets' statistics under `--value_norm_rate` (`critic.ValueStats`), else None."""
  params: gen_stages.PolicyParams
  opt_state: Any
  num_updates: Array
  policy_version: Array
  value_stats: Optional[critic.ValueStats] = None


def grad_norms(grads: Any) -> Dict[str, Array]:
  """Global L2 norms of `grads` (a network-params tree): all of it, the policy's leaves and the critic's (each
  part's squares summed once; the whole is their sum)."""
  squares = {'policy': jnp.zeros((), jnp.float32), 'critic': jnp.zeros((), jnp.float32)}
  for g, label in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(critic.critic_labels(grads))):
    squares[label] = squares[label] + jnp.sum(jnp.square(g))
  return {
      'grad_norm': jnp.sqrt(squares['policy'] + squares['critic']),
      'policy_grad_norm': jnp.sqrt(squares['policy']),
      'critic_grad_norm': jnp.sqrt(squares['critic'])
  }


def learning_rate_schedule(algo: AlgoConfig):
  """Adam's learning rate: `algo.learning_rate` (a float), or an optax schedule over gradient steps: a linear
  warm-up from 0 over `algo.learning_rate_warmup_updates` steps, then, with `algo.learning_rate_end`, a linear
  decay to it that ends at step `algo.learning_rate_decay_updates` (the warm-up's steps count in that length), then
  held."""
  lr, warmup = algo.learning_rate, algo.learning_rate_warmup_updates
  rate = lr
  if algo.learning_rate_end is not None:
    if not algo.learning_rate_decay_updates:
      raise ValueError(f'--learning_rate_end={algo.learning_rate_end} needs the decay\'s length: a Config fills in '
                       '--learning_rate_decay_updates from the run; an AlgoConfig used on its own must set it.')
    if warmup >= algo.learning_rate_decay_updates:
      raise ValueError(f'--learning_rate_warmup_updates={warmup} must be below the decay\'s length, '
                       f'--learning_rate_decay_updates={algo.learning_rate_decay_updates}.')
    rate = optax.linear_schedule(lr, algo.learning_rate_end, algo.learning_rate_decay_updates - warmup)
  if warmup:
    rate = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), rate if callable(rate) else optax.constant_schedule(rate)], [warmup])
  return rate


def make_optimizer(algo: AlgoConfig) -> optax.GradientTransformation:
  """Adam at `learning_rate_schedule(algo)`, after gradient-norm clipping at `algo.max_grad_norm` when set: of all
  gradients together (`grad_clip_scope='global'`, as Brax), or of the policy's and the critic's apart
  ('per_network': a spike in the critic's loss no longer scales the policy's gradient down, which Adam's running
  second moment turns into oversized policy steps once the spike passes)."""
  adam = optax.adam(learning_rate_schedule(algo))
  if algo.max_grad_norm is None:
    return adam
  clip = optax.clip_by_global_norm(algo.max_grad_norm)
  if algo.grad_clip_scope == 'per_network':
    clip = optax.multi_transform({
        'policy': clip,
        'critic': optax.clip_by_global_norm(algo.max_grad_norm)
    }, critic.critic_labels_checked)
  return optax.chain(clip, adam)


def init_train_state(network: nn.Module,
                     optimizer: optax.GradientTransformation,
                     key: PRNGKey,
                     obs_dim: int,
                     normalize_observations: Optional[bool] = None,
                     pixel_shape: Tuple[int, ...] = (),
                     value_norm: bool = False) -> TrainState:
  """A fresh train state; `normalize_observations`: None takes the network's PolicyConfig's (`make_network`
  records it), a value that contradicts it is a ValueError (`gen_stages.normalizes_observations`); `pixel_shape`
  [H, W, C] for a network that takes camera observations (`--obs=pixels`); `value_norm`: with the value targets'
  statistics (`--value_norm_rate`), after checking the critic's output layer."""
  params = gen_stages.init_policy_params(network, key, obs_dim, normalize_observations, pixel_shape)
  if value_norm:
    critic.output_layer(params.network)
  return TrainState(params=params,
                    opt_state=optimizer.init(params.network),
                    num_updates=jnp.zeros((), jnp.int32),
                    policy_version=jnp.zeros((), jnp.int32),
                    value_stats=critic.init_value_stats() if value_norm else None)


def init_fn(network: nn.Module,
            optimizer: optax.GradientTransformation,
            obs_dim: int,
            normalize_observations: Optional[bool] = None,
            pixel_shape: Tuple[int, ...] = (),
            value_norm: bool = False):
  """`init_train_state` with everything but its key bound, to be jitted (`key -> TrainState`): one compiled
  program instead of one dispatch per op of the network's init (46 s of start-up for an 85 M model on the GPU)."""
  return functools.partial(init_train_state,
                           network,
                           optimizer,
                           obs_dim=obs_dim,
                           normalize_observations=normalize_observations,
                           pixel_shape=pixel_shape,
                           value_norm=value_norm)


def _proximal_log_prob(network: nn.Module, params: gen_stages.PolicyParams, batch: Transition, min_std: float) -> Array:
  """[T, S] log-probs of the stored raw actions under `params` (the proximal policy)."""
  t, s = batch.reward.shape
  out = gen_stages.evaluate(network, params, losses.merge_time(batch.obs),
                            batch.raw_action.reshape((t * s,) + batch.raw_action.shape[2:]), jax.random.PRNGKey(0),
                            min_std)  # the entropy (and its key) is unused
  return jax.lax.stop_gradient(out.log_probs.reshape(t, s))


def _shuffle_into_minibatches(key: PRNGKey, time_major: Any, per_segment: Array, num_minibatches: int):
  """Permutes the segment axis (1 of `time_major` leaves [T, S, ...], 0 of `per_segment` [S]) and splits it:
  leaves become [M, T, S/M, ...] and [M, S/M]."""
  s = per_segment.shape[0]
  perm = jax.random.permutation(key, s)

  def split_time_major(x):
    x = jnp.take(x, perm, axis=1)
    x = x.reshape((x.shape[0], num_minibatches, s // num_minibatches) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1)

  return (jax.tree_util.tree_map(split_time_major, time_major), jnp.take(per_segment, perm,
                                                                         axis=0).reshape(num_minibatches, -1))


def _minibatch_loss(network_params, network, algo, min_std, params, minibatch, key, axis_name=None, value_stats=None):
  """Loss of one minibatch as a function of the network variables only (the normaliser is not trained)."""
  batch, proximal, advantages = minibatch
  params = params.replace(network=network_params)
  if algo.name == 'grpo':
    return losses.grpo_loss(network, params, batch, advantages, proximal, key, algo, min_std, axis_name)
  return losses.ppo_loss(network, params, batch, proximal, key, algo, min_std, axis_name, value_stats)


def _rank_key(key: PRNGKey, axis_name: Optional[str]) -> PRNGKey:
  """`key` itself on one rank; folded with the rank's index under `axis_name` (each rank shuffles its own
  segments and draws its own entropy noise)."""
  return key if axis_name is None else jax.random.fold_in(key, jax.lax.axis_index(axis_name))


@struct.dataclass
class KLGuard:
  """`--max_update_kl` through one iteration's minibatch steps: the network variables before the latest step (to
  undo it), the approx KL measured at the iteration's first step (before any update: the normaliser's shift
  alone), steps taken and steps applied and not undone (int32 []), and whether the iteration has stopped (bool
  [])."""
  prev_network: Any
  base_kl: Array
  steps: Array
  applied: Array
  stopped: Array


def init_kl_guard(network: Any) -> KLGuard:
  """The guard at an iteration's start: `network` (the variables before any step) to undo to, nothing measured."""
  zero = jnp.zeros((), jnp.int32)
  return KLGuard(network, jnp.zeros((), jnp.float32), zero, zero, zero > 0)


def _tree_where(cond: Array, a: Any, b: Any) -> Any:
  return jax.tree_util.tree_map(lambda x, y: jnp.where(cond, x, y), a, b)


def _kl_over(algo: AlgoConfig, guard: KLGuard, kl: Array) -> Array:
  """Whether the approx KL `kl` measured now is past the bound: more than `algo.max_update_kl` above the first
  step's (only once steps were taken and not already stopped)."""
  return (guard.steps > 0) & ~guard.stopped & (kl - guard.base_kl > algo.max_update_kl)


def _guarded_update(algo, optimizer, params, opt_state, guard: KLGuard, grads, kl):
  """One minibatch step under `--max_update_kl`. `kl`: approx KL(proximal || current params) on this minibatch,
  measured by the loss before the step. Past the bound the previous step's change to the network is undone and
  this and every later step of the iteration leave the network as it is (one program for every iteration). The
  optimizer's statistics (Adam's moments and step count) take in every step's gradient all the same, the undone
  one's and the skipped ones' (gradients at the network as it is): restoring them with the network handed each
  iteration a fresh Adam, whose first step moves every parameter by the whole learning rate (W2: approx KL ~1.7),
  so it was undone on every iteration (`w2_learn_klguard_h200.json`: no step kept in 42.7 M env steps); freezing
  them while steps are skipped would warm Adam up by one step an iteration."""
  guard = guard.replace(base_kl=jnp.where(guard.steps == 0, kl, guard.base_kl))
  over = _kl_over(algo, guard, kl)
  network = _tree_where(over, guard.prev_network, params.network)
  stopped = guard.stopped | over
  updates, new_opt_state = optimizer.update(grads, opt_state, network)
  new_network = optax.apply_updates(network, updates)
  guard = guard.replace(prev_network=network,
                        steps=guard.steps + 1,
                        applied=guard.applied - over.astype(jnp.int32) + (~stopped).astype(jnp.int32),
                        stopped=stopped)
  return params.replace(network=_tree_where(stopped, network, new_network)), new_opt_state, guard


def _scan(f, carry, xs, unroll: bool):
  """`jax.lax.scan(f, carry, xs)`, or with `unroll` the same steps traced one after the other with no loop at
  all (scan's own `unroll=True` still leaves a while loop of one trip). XLA:CPU runs a convolution inside a loop
  body far slower than the same one outside: a pixel train step (2 minibatches of 80 frames of 64 x 64, the IMPALA
  CNN) took 24.3 s rolled and 0.88 s unrolled on 2 cores (experiments/cpu_conv_loop.py)."""
  if not unroll:
    return jax.lax.scan(f, carry, xs)
  outs = []
  for i in range(jax.tree_util.tree_leaves(xs)[0].shape[0]):
    carry, out = f(carry, jax.tree_util.tree_map(lambda x, i=i: x[i], xs))
    outs.append(out)
  return carry, jax.tree_util.tree_map(lambda *o: jnp.stack(o), *outs)


def _sgd_epoch(network, optimizer, algo, min_std, carry, key, data, axis_name=None, value_stats=None, unroll=False):
  """One pass over the batch: reshuffle segments, then one optax update per minibatch (lax.scan). With
  `axis_name`, minibatch m is the union of every rank's minibatch m. `carry`: (params, opt_state, KLGuard or
  None)."""
  key_perm, key_loss = (_rank_key(k, axis_name) for k in jax.random.split(key))
  (batch, proximal), advantages = data
  (batch, proximal), advantages = _shuffle_into_minibatches(key_perm, (batch, proximal), advantages,
                                                            algo.num_minibatches)
  grad_fn = jax.grad(_minibatch_loss, has_aux=True)

  def minibatch_step(carry, xs):
    params, opt_state, guard = carry
    minibatch, k = xs
    grads, metrics = grad_fn(params.network, network, algo, min_std, params, minibatch, k, axis_name, value_stats)
    metrics.update(grad_norms(grads))
    if guard is None:
      updates, opt_state = optimizer.update(grads, opt_state, params.network)
      return (params.replace(network=optax.apply_updates(params.network, updates)), opt_state, None), metrics
    params, opt_state, guard = _guarded_update(algo, optimizer, params, opt_state, guard, grads, metrics['approx_kl'])
    return (params, opt_state, guard), metrics

  keys = jax.random.split(key_loss, algo.num_minibatches)
  return _scan(minibatch_step, carry, ((batch, proximal, advantages), keys), unroll)


def _final_kl_check(network,
                    algo,
                    min_std,
                    params,
                    opt_state,
                    guard: KLGuard,
                    minibatch,
                    key,
                    axis_name,
                    value_stats=None):
  """The iteration's last step has no next minibatch to measure it: the approx KL on `minibatch` under the final
  params, and the step undone past the bound. Returns (params, opt_state, guard)."""
  _, metrics = _minibatch_loss(params.network, network, algo, min_std, params, minibatch, key, axis_name, value_stats)
  over = _kl_over(algo, guard, metrics['approx_kl'])
  guard = guard.replace(applied=guard.applied - over.astype(jnp.int32), stopped=guard.stopped | over)
  return params.replace(network=_tree_where(over, guard.prev_network, params.network)), opt_state, guard


def _refresh_value_stats(network, algo, params, stats: critic.ValueStats, batch: Transition, axis_name):
  """PopArt's step before an iteration's updates (`--value_norm_rate`): the batch's value targets (GAE's, under
  `params` and the statistics so far, as the first minibatch step computes them) move the statistics, and the
  critic's output layer is rescaled so that its values in return units stay as they were. Returns (params, stats)."""
  t, s = batch.reward.shape
  values = gen_stages.value(network, params, losses.merge_time(batch.obs)).reshape(t, s)
  bootstrap = gen_stages.value(network, params, jax.tree_util.tree_map(lambda x: x[-1], batch.next_obs))
  targets, _ = losses.batch_gae(batch, algo, values, bootstrap, stats)
  mask = batch.mask.astype(jnp.float32)
  moments = (losses.masked_mean(x, mask, axis_name) for x in (targets, jnp.square(targets)))
  new = critic.update_value_stats(stats, *moments, algo.value_norm_rate)
  return params.replace(network=critic.preserve_outputs(params.network, stats, new)), new


def train_step(network: nn.Module,
               optimizer: optax.GradientTransformation,
               algo: AlgoConfig,
               min_std: float,
               state: TrainState,
               batch: Transition,
               key: PRNGKey,
               *,
               group_size: int = 1,
               recompute_proximal: bool = True,
               axis_name: Optional[str] = None,
               unroll: bool = False) -> Tuple[TrainState, Dict[str, Array]]:
  """One training iteration on `batch` (leading axes [T, S]), its shapes checked against `algo`
  (`config_checks.check_batch_shape`: PPO's T x K = unroll_length and S = batch_size x num_minibatches).

  1. Proximal log-probs of the stored raw actions under the params at entry (before the normaliser moves).
     With `recompute_proximal=False` the behaviour log-probs are used instead: exactly Brax's fused PPO, and
     one forward pass cheaper, valid only when the batch came from these very params (on-policy).
  2. The observation normaliser takes in batch.obs (masked; a `PixelObs`'s state only), as Brax does before its
     SGD epochs.
  2b. With `algo.value_norm_rate` (PopArt, `critic`): the batch's value targets move `state.value_stats` and the
     critic's output layer is rescaled to keep its values in return units; the losses then use the new statistics.
  3. GRPO: advantages from the per-env returns sum_t(mask * reward), normalised within consecutive groups of
     `group_size` envs (static) and broadcast over T.
  4. `algo.num_updates_per_batch` epochs; each reshuffles the S segments into `algo.num_minibatches`
     minibatches and takes one optimizer step per minibatch. With `algo.max_update_kl` (`KLGuard`), a step
     whose approx KL, measured on the next minibatch (after the last step: on the first minibatch, one more
     forward pass), rises more than that above the first step's is undone and the iteration's later steps leave
     the network as it is (the optimizer's statistics take in every step's gradient; metric updates_applied: the
     fraction of steps kept; num_updates counts them all).
  Returns the new state (policy_version + 1, num_updates + epochs * minibatches) and metrics averaged over all
  minibatch steps (total_loss, policy_loss, value_loss, entropy_loss, entropy, approx_kl, clip_fraction,
  behaviour_weight, grad_norm and its parts policy_grad_norm and critic_grad_norm; value_target_mean and
  value_target_std with PopArt). `axis_name`: the data-parallel ranks' mesh axis (see the module's docstring); S
  is then this rank's segments and GRPO's groups lie within one rank. `unroll`: the epoch and minibatch loops
  traced step by step (`_scan`): on XLA:CPU with camera observations a step runs ~27x faster, but memory grows
  with the steps (a run's resident memory reached 16 GB at 8 steps of 80 frames of 64 x 64), so it is off by default.
  """
  t, s = types.check_segment(batch)  # ValueError naming a field whose shape is off
  config_checks.check_batch_shape(algo, t, s, batch.raw_action.shape[2], rank_share=axis_name is not None)
  if recompute_proximal:
    proximal = _proximal_log_prob(network, state.params, batch, min_std)
  else:
    proximal = batch.behaviour_log_prob
  if algo.name == 'grpo':
    returns = jnp.sum(batch.reward * batch.mask, axis=0)
    advantages = losses.grpo_advantages(returns, group_size)
  else:
    advantages = jnp.zeros((s,), jnp.float32)  # unused by PPO (GAE runs per minibatch)

  params = state.params
  if params.normalize_observations:
    params = params.replace(normalizer=normalization.update_stats(
        params.normalizer, types.proprioception(batch.obs), batch.mask, axis_name=axis_name))
  value_stats = state.value_stats
  if value_stats is not None:
    params, value_stats = _refresh_value_stats(network, algo, params, value_stats, batch, axis_name)

  def epoch(carry, k):
    return _sgd_epoch(network, optimizer, algo, min_std, carry, k, ((batch, proximal), advantages), axis_name,
                      value_stats, unroll)

  guard = None if algo.max_update_kl is None else init_kl_guard(params.network)
  (params, opt_state, guard), metrics = _scan(epoch, (params, state.opt_state, guard),
                                              jax.random.split(key, algo.num_updates_per_batch), unroll)
  metrics = jax.tree_util.tree_map(jnp.mean, metrics)
  num_steps = algo.num_updates_per_batch * algo.num_minibatches
  if guard is not None:
    m = s // algo.num_minibatches
    first = jax.tree_util.tree_map(lambda x: x[:, :m], (batch, proximal)) + (advantages[:m],)
    params, opt_state, guard = _final_kl_check(network, algo, min_std, params, opt_state, guard, first,
                                               _rank_key(jax.random.fold_in(key, 1), axis_name), axis_name, value_stats)
    metrics['updates_applied'] = guard.applied.astype(jnp.float32) / num_steps
  new_state = state.replace(params=params,
                            opt_state=opt_state,
                            num_updates=state.num_updates + num_steps,
                            policy_version=state.policy_version + 1,
                            value_stats=value_stats)
  if value_stats is not None:
    metrics.update(value_target_mean=value_stats.mean, value_target_std=value_stats.std)
  return new_state, metrics


def train_fn(network: nn.Module, optimizer: optax.GradientTransformation, algo: AlgoConfig, min_std: float,
             group_size: int, recompute_proximal: bool):
  """`train_step` with everything but its arguments bound: `(train_state, batch, key) -> (train_state, metrics)`."""
  return functools.partial(train_step,
                           network,
                           optimizer,
                           algo,
                           min_std,
                           group_size=group_size,
                           recompute_proximal=recompute_proximal)


def make_train_fn(network: nn.Module, optimizer: optax.GradientTransformation, algo: AlgoConfig, min_std: float,
                  group_size: int, recompute_proximal: bool):
  """`train_fn` jitted with the train state donated."""
  return jax.jit(train_fn(network, optimizer, algo, min_std, group_size, recompute_proximal), donate_argnums=(0,))
