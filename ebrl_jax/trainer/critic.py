"""The critic's part of a network's parameters, and PopArt value normalisation (`--value_norm_rate`).

PopArt (van Hasselt et al., 2016, "Learning values across many orders of magnitude") lets the critic regress
normalised targets: the network's value output `v` stands for `v * std + mean`, where mean and std are running
statistics of the value targets. When the statistics move, the critic's output layer is rescaled so that every
denormalised prediction stays exactly what it was ("preserving outputs precisely"); only the regression's scale
changes. PPO's value targets grow as the policy improves (W2: value loss 424 -> 3.2 k over a run), which makes the
critic's loss, and with a global gradient clip the policy's step, depend on the return's scale.

Axis names: T time, S segments.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from ebrl_jax.types import Array

CRITIC_MODULES = ('value', 'value_mlp', 'value_head')  # the networks' value modules (generation/policies.py)
# The statistics' std never goes below this (return units): a batch of constant targets (a sparse task's zero
# rewards) would otherwise scale the output layer by 1/std when the first varied batch comes.
STD_MIN = 1e-2


def _keys(path) -> tuple:
  return tuple(getattr(k, 'key', None) for k in path)


def _top_module(path) -> Optional[str]:
  names = _keys(path)
  return names[1] if len(names) > 1 and names[0] == 'params' else names[0]


def critic_labels(network_params: Any) -> Any:
  """'critic' for each leaf of the network's own value module (a top-level module named in CRITIC_MODULES; a
  shared trunk's parameters are not among them), 'policy' for every other leaf: the same tree of labels."""
  return jax.tree_util.tree_map_with_path(lambda p, _: 'critic'
                                          if _top_module(p) in CRITIC_MODULES else 'policy', network_params)


def critic_labels_checked(network_params: Any) -> Any:
  """`critic_labels`, with an error naming --grad_clip_scope when the network has no critic parameters."""
  labels = critic_labels(network_params)
  if 'critic' not in jax.tree_util.tree_leaves(labels):
    raise ValueError('--grad_clip_scope=per_network found no critic parameters (a top-level module named one of '
                     f'{", ".join(CRITIC_MODULES)}) in the network.')
  return labels


@struct.dataclass
class ValueStats:
  """Running statistics of the value targets (float32 []): an exponential moving average of their mean and of
  their second moment, and how many batches were taken in (int32 [])."""
  mean: Array
  second_moment: Array
  updates: Array

  @property
  def std(self) -> Array:
    return jnp.sqrt(jnp.maximum(self.second_moment - jnp.square(self.mean), STD_MIN**2))


def init_value_stats() -> ValueStats:
  """mean 0, std 1: denormalising is the identity until the first batch."""
  return ValueStats(jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32))


def denormalize(stats: Optional[ValueStats], values: Array) -> Array:
  """The network's normalised values -> values in return units (the identity without statistics)."""
  return values if stats is None else values * stats.std + stats.mean


def normalize(stats: Optional[ValueStats], targets: Array) -> Array:
  """Value targets in return units -> the critic's regression targets (the identity without statistics)."""
  return targets if stats is None else (targets - stats.mean) / stats.std


def update_value_stats(stats: ValueStats, batch_mean: Array, batch_second_moment: Array, rate: float) -> ValueStats:
  """Takes in a batch of value targets by its (masked) mean and second moment: the first batch sets the statistics
  to them, every later one moves them by `rate` towards them."""
  r = jnp.where(stats.updates == 0, 1.0, rate)
  return ValueStats(mean=(1.0 - r) * stats.mean + r * batch_mean,
                    second_moment=(1.0 - r) * stats.second_moment + r * batch_second_moment,
                    updates=stats.updates + 1)


def output_layer(network_params: Any) -> Any:
  """The path (a tuple of keys) of the module whose `kernel` [H, 1] and `bias` [1] make the critic's value output:
  the one Dense with a single output unit in the network's value module. Raises ValueError naming
  --value_norm_rate when there is not exactly one."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(network_params)[0]:
    if _top_module(path) in CRITIC_MODULES and getattr(path[-1], 'key', None) == 'kernel' and leaf.shape[-1] == 1:
      found.append(_keys(path[:-1]))
  if len(found) != 1:
    raise ValueError(f'--value_norm_rate needs a critic with one output layer (a Dense of 1 unit in a module named one '
                     f'of {", ".join(CRITIC_MODULES)}); the network has {len(found)}: {found}.')
  return found[0]


def preserve_outputs(network_params: Any, old: ValueStats, new: ValueStats) -> Any:
  """PopArt's rescale of the critic's output layer from statistics `old` to `new`: kernel * std/std', bias
  (std * bias + mean - mean') / std', so `denormalize(new, v')` equals `denormalize(old, v)` for every input."""
  path = output_layer(network_params)
  ratio = old.std / new.std

  def rescale(p, leaf):
    keys = _keys(p)
    if keys == path + ('kernel',):
      return (leaf * ratio).astype(leaf.dtype)
    if keys == path + ('bias',):
      return ((old.std * leaf + old.mean - new.mean) / new.std).astype(leaf.dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(rescale, network_params)
