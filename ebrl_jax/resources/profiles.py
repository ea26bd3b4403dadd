"""Stage profiles: seconds of one stage call as a function of batch size and SM quota, fitted from samples.

Model (one per stage: 'sim', 'generation', 'train', ...):

    t(b, q) = k * (a + c * b) * s(q),    s(q) = max(1, q_sat / q)

  b      batch size of the call (envs for sim/generation, transitions for train);
  q      the process's SM quota in percent (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1..100);
  a >= 0 fixed cost of a call (launch latency, dispatch, host sync);  c >= 0 cost per batch element;
  q_sat  the quota above which the stage runs no faster: its kernels fill at most q_sat % of the SMs. Below it
         the same work is spread over fewer SMs, so time grows as 1 / q. q_sat lies in [1, 100];
  k      run-time correction (below), 1 until `observe` is called.

Why this form: it is the simplest one that is monotone (never faster with a larger batch or a smaller quota) and
has the two effects the planner trades against each other: small stages (MJX's many small kernels) saturate at a
low quota, so several of them can share the GPU without slowing each other; big ones (training) keep speeding
up to 100 %. Its known blind spot: q_sat does not depend on the batch (a bigger batch fills more SMs); profile
the batch sizes the planner will use.

Fit: for each q_sat on a grid (0.25 percentage points), (a, c) by non-negative least squares on relative errors
((t_pred - t) / t, so a 1 ms and a 1 s sample weigh alike); the q_sat with the least residual wins, ties going to
the largest q_sat (the pessimistic one: time already grows below it). A full fit needs samples at >= 2 batch
sizes and >= 2 quotas; with fewer, `is_fitted` is False and the unidentified parameters take conservative values
(one batch size: a = 0, time proportional to batch; one quota q0: q_sat = q0, so no speed-up is predicted above
the measured quota and a 1 / q slow-down below it); `fit_note` says which.

Run-time feedback: `observe` keeps ONE correction factor per profile (not per point), an exponential moving
average of measured / model-predicted seconds. A per-point factor would make predictions non-monotone and
would not inform the points the planner has never run; a global factor moves every prediction toward reality
while the fit keeps their shape. New `add_sample` calls refit the shape and keep the factor.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from absl import logging

_FORMAT = 'ebrl_jax.resources.profiles/1'
_Q_SAT_GRID = np.arange(1.0, 100.0 + 1e-9, 0.25)


def machine_id(gpu_name: str, cpu_count: int) -> str:
  """Key of the machine a profile was measured on: GPU name and CPU count. The driver is not in it (nodes of one
  cluster differ in driver patch levels, and a driver update would throw every profile away): the store records
  the driver it was measured under (`ProfileStore.driver`) and says when it differs."""
  return f'gpu={gpu_name};cpus={int(cpu_count)}'


def workload_id(task: str, backend: str, num_envs: int, policy_size: str) -> str:
  """Key of the workload: task, simulator backend, number of envs, policy size (e.g. 'mlp:32x4' or a count)."""
  return f'task={task};backend={backend};num_envs={int(num_envs)};policy={policy_size}'


def _nnls2(x: np.ndarray, y: np.ndarray) -> Tuple[float, float, float]:
  """min |x @ [a, c] - y|^2 over a, c >= 0 for two columns: the unconstrained solution or the best one-column one."""
  best = None
  (a, c), *_ = np.linalg.lstsq(x, y, rcond=None)
  options = [(a, c)] if a >= 0 and c >= 0 else []
  for col in (0, 1):
    denom = float(x[:, col] @ x[:, col])
    value = max(0.0, float(x[:, col] @ y) / denom) if denom > 0 else 0.0
    options.append((value, 0.0) if col == 0 else (0.0, value))
  for a, c in options:
    residual = float(np.sum((x @ np.array([a, c]) - y)**2))
    if best is None or residual < best[2]:
      best = (float(a), float(c), residual)
  return best


class StageProfile:
  """Measured seconds of one call of a stage against (batch size, SM quota %); see the module docstring."""

  def __init__(self, name: str, ema_alpha: float = 0.2):
    if not 0.0 < ema_alpha <= 1.0:
      raise ValueError(f'StageProfile({name!r}): ema_alpha={ema_alpha} must lie in (0, 1].')
    self.name = name
    self.ema_alpha = ema_alpha
    self.samples: List[Tuple[int, float, float]] = []  # (batch, quota, seconds)
    self.correction = 1.0
    self.num_observations = 0
    self._params: Optional[Tuple[float, float, float]] = None  # (a, c, q_sat); None: stale
    self._fitted = False
    self._note = 'no samples'

  def add_sample(self, batch: int, quota: float, seconds: float) -> None:
    """Records one measured call (first, compiling call excluded); the fit is redone on the next prediction."""
    self._check(batch, quota, seconds)
    self.samples.append((int(batch), float(quota), float(seconds)))
    self._params = None

  def observe(self, batch: int, quota: float, seconds: float) -> float:
    """Run-time feedback: moves the global correction k toward measured / predicted (EMA); returns the new k."""
    self._check(batch, quota, seconds)
    ratio = seconds / self._model(batch, quota)
    self.correction = (1.0 - self.ema_alpha) * self.correction + self.ema_alpha * ratio
    self.num_observations += 1
    return self.correction

  def predict(self, batch: int, quota: float) -> float:
    """Predicted seconds of one call: k * (a + c * batch) * max(1, q_sat / quota)."""
    if batch <= 0 or not 0 < quota <= 100:
      raise ValueError(f'StageProfile({self.name!r}).predict: batch={batch} must be > 0 and quota={quota} in (0, 100].')
    return self.correction * self._model(batch, quota)

  @property
  def params(self) -> Dict[str, float]:
    """The fitted model: overhead_s (a), per_item_s (c), saturation_quota (q_sat), correction (k)."""
    a, c, q_sat = self._fit()
    return {'overhead_s': a, 'per_item_s': c, 'saturation_quota': q_sat, 'correction': self.correction}

  @property
  def is_fitted(self) -> bool:
    """True when every parameter came from the samples; False when some were assumed (see `fit_note`)."""
    self._fit()
    return self._fitted

  @property
  def fit_note(self) -> str:
    self._fit()
    return self._note

  def describe(self) -> str:
    p = self.params
    return (f"{self.name}: t(b, q) = {p['correction']:.3g} * ({p['overhead_s']:.4g} + {p['per_item_s']:.4g} * b)"
            f" * max(1, {p['saturation_quota']:g} / q) from {len(self.samples)} samples ({self.fit_note})")

  def to_dict(self) -> dict:
    return {
        'samples': [list(s) for s in self.samples],
        'correction': self.correction,
        'num_observations': self.num_observations,
        'ema_alpha': self.ema_alpha
    }

  @classmethod
  def from_dict(cls, name: str, data: dict) -> 'StageProfile':
    profile = cls(name, ema_alpha=float(data.get('ema_alpha', 0.2)))
    for batch, quota, seconds in data['samples']:
      profile.add_sample(batch, quota, seconds)
    profile.correction = float(data.get('correction', 1.0))
    profile.num_observations = int(data.get('num_observations', 0))
    return profile

  def _check(self, batch, quota, seconds) -> None:
    if batch <= 0 or not 0 < quota <= 100 or not (seconds > 0 and math.isfinite(seconds)):
      raise ValueError(f'StageProfile({self.name!r}): batch={batch} must be > 0, quota={quota} in (0, 100] and '
                       f'seconds={seconds} finite and > 0.')

  def _model(self, batch: int, quota: float) -> float:
    a, c, q_sat = self._fit()
    return (a + c * batch) * max(1.0, q_sat / quota)

  def _fit(self) -> Tuple[float, float, float]:
    if self._params is not None:
      return self._params
    if not self.samples:
      raise ValueError(f'StageProfile({self.name!r}) has no samples: profile the stage before planning with it.')
    b, q, t = (np.array(column, dtype=np.float64) for column in zip(*self.samples))
    many_batches, many_quotas = len(set(b)) >= 2, len(set(q)) >= 2
    notes = []
    if not many_quotas:
      notes.append(f'one quota measured: assumed q_sat = {q[0]:g}')
    if not many_batches:
      notes.append('one batch size measured: assumed a = 0 (time proportional to batch)')
    grid = _Q_SAT_GRID if many_quotas else np.array([q[0]])
    best = None
    for q_sat in grid:
      s = np.maximum(1.0, q_sat / q)
      x = np.stack([s / t, b * s / t], axis=1)  # relative errors: divide each row by its measured time
      if many_batches:
        a, c, residual = _nnls2(x, np.ones_like(t))
      else:
        c = float(np.sum(x[:, 1]) / np.sum(x[:, 1]**2))
        a, residual = 0.0, float(np.sum((x[:, 1] * c - 1.0)**2))
      # `<=` with a tolerance: equal residuals (q_sat below every measured quota) go to the largest q_sat.
      if best is None or residual <= best[3] + 1e-12 * len(t):
        best = (a, c, float(q_sat), min(residual, best[3]) if best else residual)
    self._params = best[:3]
    self._fitted = many_batches and many_quotas
    self._note = '; '.join(notes) if notes else f'fitted, rms relative error {math.sqrt(best[3] / len(t)):.2%}'
    return self._params


class ProfileStore:
  """A named set of StageProfiles for one (machine, workload), kept in a JSON file.

  File: {"format": ..., "machine": machine_id, "workload": workload_id, "driver": the GPU driver the profiles
  were measured under ('none': no GPU; absent in older files), "profiles": {name: StageProfile dict}}.
  """

  def __init__(self,
               machine: str,
               workload: str,
               path: Optional[str] = None,
               profiles: Optional[Dict[str, StageProfile]] = None,
               driver: str = 'none'):
    self.machine = machine
    self.workload = workload
    self.path = path
    self.driver = driver
    self.profiles: Dict[str, StageProfile] = dict(profiles or {})

  def profile(self, name: str) -> StageProfile:
    """The named profile, created empty if absent (for the profiler to add samples to)."""
    if name not in self.profiles:
      self.profiles[name] = StageProfile(name)
    return self.profiles[name]

  def __getitem__(self, name: str) -> StageProfile:
    if name not in self.profiles:
      raise KeyError(f'no profile {name!r}; profiles present: {sorted(self.profiles) or "none"}')
    return self.profiles[name]

  def __contains__(self, name: str) -> bool:
    return name in self.profiles

  def __iter__(self) -> Iterator[str]:
    return iter(self.profiles)

  def __len__(self) -> int:
    return len(self.profiles)

  def to_dict(self) -> dict:
    return {
        'format': _FORMAT,
        'machine': self.machine,
        'workload': self.workload,
        'driver': self.driver,
        'profiles': {
            name: p.to_dict() for name, p in sorted(self.profiles.items())
        }
    }

  def save(self, path: Optional[str] = None) -> str:
    """Writes the store atomically (a temporary file in the same folder, then os.replace); returns the path."""
    path = path or self.path
    if not path:
      raise ValueError('ProfileStore.save: no path (pass one, or load the store from a file).')
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f'{path}.tmp.{os.getpid()}'
    try:
      with open(tmp, 'w') as f:
        json.dump(self.to_dict(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)  # NOTE: readers see the old file or the new one, never a partial one.
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    self.path = path
    return path

  @classmethod
  def load(cls, path: str, machine: str, workload: str, driver: str = 'none') -> 'ProfileStore':
    """The profiles saved at `path` for this machine and workload; an empty store if the file is missing or was
    written for another machine or workload. A file that is not a valid store is a ValueError naming it. `driver`
    is this machine's GPU driver: the store keeps it for what it measures next, and a store measured under another
    driver is used, with a warning that says so."""
    empty = cls(machine, workload, path=path, driver=driver)
    if not os.path.exists(path):
      return empty
    try:
      with open(path) as f:
        data = json.load(f)
      if not isinstance(data, dict) or data.get('format') != _FORMAT:
        raise ValueError(f'format is not {_FORMAT!r}')
      if data.get('machine') != machine or data.get('workload') != workload:
        logging.info('Profiles in %s are for machine %r, workload %r; starting empty for machine %r, workload %r.',
                     path, data.get('machine'), data.get('workload'), machine, workload)
        return empty
      profiles = {name: StageProfile.from_dict(name, p) for name, p in data['profiles'].items()}
      measured_under = str(data.get('driver', 'unknown'))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'profile file {path} is malformed: {e}') from e
    if measured_under != driver:
      logging.warning(
          'Profiles in %s were measured under GPU driver %s; this machine runs %s. They are used as they are '
          '(--schedule=auto tries a process schedule against fused before it keeps it); delete the file to '
          'measure them again.', path, measured_under, driver)
    return cls(machine, workload, path=path, profiles=profiles, driver=driver)
