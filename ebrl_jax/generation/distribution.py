"""Tanh-squashed diagonal Gaussian, as pure functions (Brax's `NormalTanhDistribution` semantics).

The network emits `dist_params [..., 2A]`: the first half is the Gaussian mean `loc`, the second a raw scale
mapped to `scale = softplus(raw) + min_std`. Samples are drawn and stored *before* the tanh (`raw`): the tanh
saturates, so log-probs are recomputed from raw samples, never from squashed actions.

Axis names: `A` action dimension; `...` any leading batch axes (`[B]`, `[B, K]`, `[T, B, K]`).
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax.types import Array, PRNGKey

_HALF_LOG_2PI = 0.5 * float(np.log(2.0 * np.pi))
_LOG_2 = float(np.log(2.0))


def split_params(dist_params: Array, min_std: float) -> Tuple[Array, Array]:
  """`[..., 2A]` network output -> `(loc [..., A], scale [..., A])`, scale = softplus(raw) + min_std."""
  loc, raw_scale = jnp.split(dist_params, 2, axis=-1)
  return loc, jax.nn.softplus(raw_scale) + min_std


def postprocess(raw: Array) -> Array:
  """Squashes raw Gaussian samples into [-1, 1]."""
  return jnp.tanh(raw)


def tanh_log_det_jacobian(raw: Array) -> Array:
  """Elementwise log|d tanh(u)/du| = log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)).

  The right-hand form stays finite where tanh(u) rounds to +-1 (|u| > ~9 in float32).
  """
  return 2.0 * (_LOG_2 - raw - jax.nn.softplus(-2.0 * raw))


def sample_raw(loc: Array, scale: Array, key: PRNGKey) -> Array:
  """Pre-tanh sample `[..., A]` from N(loc, scale^2)."""
  return loc + scale * jax.random.normal(key, loc.shape, loc.dtype)


def mode(loc: Array) -> Array:
  """The squashed mode used for deterministic actions: tanh(loc)."""
  return jnp.tanh(loc)


def log_prob(loc: Array, scale: Array, raw: Array) -> Array:
  """Log-density of the squashed action tanh(raw), summed over the last axis: `[..., A] -> [...]`.

  log p(tanh(u)) = log N(u; loc, scale) - log|d tanh(u)/du|  (change of variables).
  """
  z = (raw - loc) / scale
  gaussian = -0.5 * jnp.square(z) - jnp.log(scale) - _HALF_LOG_2PI
  return jnp.sum(gaussian - tanh_log_det_jacobian(raw), axis=-1)


def entropy(loc: Array, scale: Array, key: PRNGKey) -> Array:
  """Single-sample estimate of the squashed distribution's entropy, `[..., A] -> [...]` (as Brax estimates it).

  H(tanh(U)) = H(U) + E[log|d tanh(u)/du|]; the expectation is estimated with one sample per element.
  """
  gaussian_entropy = 0.5 + _HALF_LOG_2PI + jnp.log(scale)
  raw = sample_raw(loc, scale, key)
  return jnp.sum(gaussian_entropy + tanh_log_det_jacobian(raw), axis=-1)
