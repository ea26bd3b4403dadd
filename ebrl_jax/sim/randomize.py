"""Domain randomisation: per-env model fields drawn from the ranges of a `config.RandomizationConfig`.

    base = randomize.base_fields(cfg, model)                   # the model's own values of the fields cfg touches
    fields = randomize.apply(cfg, base, randomize.draw_numpy(cfg, base, rng))   # one env's fields

Both backends draw uniforms in [0, 1) of `draw_shapes` (numpy's Generator on native MuJoCo, `jax.random` on
MJX) and map them with the same `apply` (`xp` is numpy or jax.numpy). What each parameter does is in
`config.RANDOMIZE_PARAMS`. Draws happen when an env is reset: the native-MuJoCo pool writes them into the
env's own `MjModel` copy (`CpuEnvPool.env_model`, `CpuEnvPool.model_fields`), which its step and its
`mujoco.Renderer` frame read; the MJX env (both implementations, `--backend=mjx` and `mjx_warp`) keeps them in
`state.info[INFO_KEY]` and resets, steps and renders each env with its model (`mjx_env.PerEnvModel`,
`mjx_env.model_fields`); an auto-reset keeps the env's draw. Envs of one GRPO group share their draw, as they
share their initial state.

What a renderer sees: geom colours are the env's geom_rgba (native MuJoCo's `mjv_updateScene` with the env's
model; MJX-Warp's renderer reads geom_rgba per world); the camera pose is the env's cam_pos / cam_quat, which
the kinematics turn into the data's cam_xpos / cam_xmat that both renderers read. `color` scales geom_rgba,
which is what a geom without a material shows (all of push_cube's); a geom with a material shows its material's
colour only while its rgba is MuJoCo's default (0.5, 0.5, 0.5, 1), so on both renderers a scaled default grey
replaces it.

Keys: an MJX env's draw comes from its reset key folded with `KEY_PURPOSE` (`rollout.keys.ENV_RANDOMIZE`); a
native-MuJoCo pool draws from `np.random.SeedSequence((seed, KEY_PURPOSE))`, apart from its reset draws, so the
initial states are those of a run without randomisation.
"""
from __future__ import annotations

from typing import Dict, Mapping, Tuple

import numpy as np

from ebrl_jax import config as config_lib

KEY_PURPOSE = 8
INFO_KEY = 'randomized_model'
# parameter -> the model fields it rewrites.
MODEL_FIELDS = {
    'friction': ('geom_friction',),
    'mass': ('body_mass', 'body_inertia'),
    'gain': ('actuator_gainprm', 'actuator_biasprm'),
    'camera': ('cam_pos',),
    'camera_tilt': ('cam_quat',),
    'color': ('geom_rgba',),
}
assert set(MODEL_FIELDS) == set(config_lib.RANDOMIZE_PARAMS)


def fields_of(cfg: config_lib.RandomizationConfig) -> Tuple[str, ...]:
  """The model fields `cfg` rewrites."""
  return tuple(f for name, _ in cfg.ranges for f in MODEL_FIELDS[name])


# MuJoCo's mjtGain / mjtBias values whose force is affine in the terms `gain` scales (mjGAIN_FIXED/AFFINE,
# mjBIAS_NONE/AFFINE); a muscle's or a user actuator's parameters mean other things.
_AFFINE_GAINS, _AFFINE_BIASES = (0, 1), (0, 1)


def base_fields(cfg: config_lib.RandomizationConfig, model) -> Dict[str, np.ndarray]:
  """The model's own values (an MjModel or an mjx.Model) of the fields `cfg` rewrites. `gain` scales an
  actuator's whole force law (gain * ctrl + bias), so a servo stays the servo it was with its strength scaled:
  refused (ValueError naming the actuators) for any actuator whose gain or bias is not affine."""
  if cfg.gain is not None:
    gains, biases = np.asarray(model.actuator_gaintype), np.asarray(model.actuator_biastype)
    odd = [i for i in range(len(gains)) if gains[i] not in _AFFINE_GAINS or biases[i] not in _AFFINE_BIASES]
    if odd:
      raise ValueError(f'--randomize=gain scales an affine actuator\'s gain and bias, but actuator(s) {odd} of '
                       'this model are muscles or user actuators (gaintype/biastype not fixed or affine); drop '
                       'gain from --randomize for this task.')
  return {f: getattr(model, f) for f in fields_of(cfg)}


def draw_shapes(cfg: config_lib.RandomizationConfig, base: Mapping[str, np.ndarray]) -> Dict[str, Tuple[int, ...]]:
  """Shape of one env's uniforms per randomised parameter: one per geom, body, actuator or camera (x3 for a
  camera offset or an RGB scale)."""
  sizes = {
      'friction': lambda: base['geom_friction'].shape[:1],
      'mass': lambda: base['body_mass'].shape[:1],
      'gain': lambda: base['actuator_gainprm'].shape[:1],
      'camera': lambda: base['cam_pos'].shape[:1] + (3,),
      'camera_tilt': lambda: base['cam_quat'].shape[:1],
      'color': lambda: base['geom_rgba'].shape[:1] + (3,),
  }
  return {name: tuple(sizes[name]()) for name, _ in cfg.ranges}


def draw_numpy(cfg: config_lib.RandomizationConfig, base: Mapping[str, np.ndarray],
               rng: np.random.Generator) -> Dict[str, np.ndarray]:
  """One env's uniforms in [0, 1) from numpy's Generator (native MuJoCo)."""
  return {name: rng.random(shape) for name, shape in draw_shapes(cfg, base).items()}


def _quat_mul(a, b, xp):
  """Hamilton product of quaternions (w, x, y, z) [..., 4]."""
  aw, ax, ay, az = (a[..., i] for i in range(4))
  bw, bx, by, bz = (b[..., i] for i in range(4))
  return xp.stack([
      aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
      aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw
  ],
                  axis=-1)


def apply(cfg: config_lib.RandomizationConfig,
          base: Mapping[str, np.ndarray],
          uniforms: Mapping[str, np.ndarray],
          xp=np) -> Dict[str, np.ndarray]:
  """One env's randomised fields: each parameter's value lo + (hi - lo) * u applied to the model's own values."""
  out = {}
  for name, (lo, hi) in cfg.ranges:
    v = lo + (hi - lo) * uniforms[name]
    if name == 'friction':
      f = base['geom_friction']
      out['geom_friction'] = xp.concatenate([f[:, :1] * v[:, None], f[:, 1:]], axis=1)
    elif name == 'mass':
      out['body_mass'] = base['body_mass'] * v
      out['body_inertia'] = base['body_inertia'] * v[:, None]
    elif name == 'gain':
      g, b = base['actuator_gainprm'], base['actuator_biasprm']
      out['actuator_gainprm'] = xp.concatenate([g[:, :3] * v[:, None], g[:, 3:]], axis=1)
      out['actuator_biasprm'] = xp.concatenate([b[:, :3] * v[:, None], b[:, 3:]], axis=1)
    elif name == 'camera':
      out['cam_pos'] = base['cam_pos'] + v
    elif name == 'camera_tilt':
      zeros = xp.zeros_like(v)
      turn = xp.stack([xp.cos(v / 2), xp.sin(v / 2), zeros, zeros], axis=-1)
      out['cam_quat'] = _quat_mul(base['cam_quat'], turn, xp)
    elif name == 'color':
      rgba = base['geom_rgba']
      out['geom_rgba'] = xp.concatenate([xp.clip(rgba[:, :3] * v, 0.0, 1.0), rgba[:, 3:]], axis=1)
  return out
