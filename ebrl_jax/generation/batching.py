"""Batch shapes for a generation server that batches whichever env slices are ready.

A slice is `slice_envs` envs of one env group (the whole group without `--env_slices`). A batch of r ready slices
holds r * slice_envs observations; it is padded up to the smallest *bucket* that fits, so XLA compiles one act
program per bucket, whatever mix of slices arrives:

  buckets = make_buckets(slice_envs=8, total_envs=64)   # (8, 16, 32, 64)
  rows = bucket_for(buckets, 3 * 8)                    # 32: 24 rows of observations, 8 of padding
  obs = pack([r.obs for r in requests], buffers[rows])  # [32, O]

Pure numpy; axis names: B batch rows, O observation dimension.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def make_buckets(slice_envs: int, total_envs: int) -> Tuple[int, ...]:
  """Batch sizes (rows) to compile act for: `slice_envs` times the powers of two below `total_envs`, and
  `total_envs` (every slice ready). E.g. (8, 64) -> (8, 16, 32, 64); (32, 96) -> (32, 64, 96); (32, 64) -> (32, 64).

  At most 1 + ceil(log2(total_envs / slice_envs)) buckets; a batch pads by less than 2x (except up to the last).
  """
  if slice_envs <= 0 or total_envs <= 0 or total_envs % slice_envs:
    raise ValueError(f'slice_envs={slice_envs} must be > 0 and divide total_envs={total_envs}.')
  buckets, rows = [], slice_envs
  while rows < total_envs:
    buckets.append(rows)
    rows *= 2
  buckets.append(total_envs)
  return tuple(buckets)


def bucket_for(buckets: Sequence[int], rows: int) -> int:
  """The smallest bucket that holds `rows` rows (buckets sorted ascending)."""
  for bucket in buckets:
    if rows <= bucket:
      return bucket
  raise ValueError(f'a batch of {rows} rows exceeds the largest bucket {buckets[-1]}.')


def pack(obs: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
  """Copies the requests' observations (each [B_s, O]) into consecutive rows of `out` [B, O] and zeroes the
  padding rows after them (their actions are computed and discarded). Returns `out`."""
  rows = sum(block.shape[0] for block in obs)
  if rows > out.shape[0]:
    raise ValueError(f'{rows} rows of observations do not fit a batch of {out.shape[0]}.')
  row = 0
  for block in obs:
    out[row:row + block.shape[0]] = block
    row += block.shape[0]
  out[row:] = 0.0
  return out
