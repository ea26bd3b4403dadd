"""Running mean/std observation normaliser (batched Welford update, as Brax's `running_statistics`).

Axis names: `O` observation dimension; `...` any leading batch axes (`[B]`, `[T, B]`).
"""
from __future__ import annotations

import functools
from typing import Optional

import chex
import jax
import jax.numpy as jnp
from flax import struct

from ebrl_jax.types import Array

STD_MIN = 1e-6
STD_MAX = 1e6


@struct.dataclass
class RunningStats:
  """count []: (weighted) number of observations seen, float32 (no int64 without x64; exact up to 2^24, then
  relative error ~6e-8, which is harmless for a normaliser). mean, summed_variance, std: [O]."""
  count: Array
  mean: Array
  summed_variance: Array
  std: Array


def init_stats(obs_dim: int) -> RunningStats:
  """Empty statistics: mean 0, std 1, so `normalize` is the identity until the first update."""
  return RunningStats(count=jnp.zeros((), jnp.float32),
                      mean=jnp.zeros((obs_dim,), jnp.float32),
                      summed_variance=jnp.zeros((obs_dim,), jnp.float32),
                      std=jnp.ones((obs_dim,), jnp.float32))


def update_stats(stats: RunningStats,
                 obs: Array,
                 mask: Optional[Array] = None,
                 axis_name: Optional[str] = None) -> RunningStats:
  """Folds a batch `obs [..., O]` (weights `mask [...]`, 1 keeps, 0 drops) into the statistics.

  Batched Welford (Chan et al.): with n the new count,
    mean' = mean + sum(w (x - mean)) / n,   M2' = M2 + sum(w (x - mean)(x - mean')),   std = sqrt(M2'/n),
  which is exact for 0/1 weights. std is clipped into [1e-6, 1e6] as Brax does. With `axis_name`
  (data-parallel ranks under `shard_map`) the sums run over every rank's shard: the update of the global batch.
  """
  total = (lambda v: v) if axis_name is None else functools.partial(jax.lax.psum, axis_name=axis_name)
  obs_dim = stats.mean.shape[-1]
  chex.assert_axis_dimension(obs, -1, obs_dim)
  x = jnp.reshape(obs, (-1, obs_dim)).astype(jnp.float32)
  if mask is None:
    w = jnp.ones((x.shape[0],), jnp.float32)
  else:
    chex.assert_shape(mask, obs.shape[:-1])
    w = jnp.reshape(mask, (-1,)).astype(jnp.float32)
  count = stats.count + total(jnp.sum(w))
  safe_count = jnp.maximum(count, 1.0)  # all-masked first batch: numerators are 0 too
  diff_old = (x - stats.mean) * w[:, None]
  mean = stats.mean + total(jnp.sum(diff_old, axis=0)) / safe_count
  summed_variance = stats.summed_variance + total(jnp.sum(diff_old * (x - mean), axis=0))
  std = jnp.sqrt(jnp.maximum(summed_variance, 0.0) / safe_count)  # rounding can make M2 slightly negative
  std = jnp.where(count > 0, jnp.clip(std, STD_MIN, STD_MAX), stats.std)
  return RunningStats(count=count, mean=mean, summed_variance=summed_variance, std=std)


def normalize(stats: RunningStats, obs: Array) -> Array:
  """`(obs - mean) / std`, broadcast over the leading axes of `obs [..., O]`."""
  return (obs - stats.mean) / stats.std
