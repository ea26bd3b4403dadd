"""Domain randomisation ranges: `--randomize=friction=0.8:1.2,mass=0.9:1.1,gain=0.9:1.1` (`SimConfig.randomize`).

Each entry `name=lo:hi` draws, for every env and every element the parameter touches, one value uniformly in
[lo, hi] when the env is reset (`ebrl_jax.sim.randomize` applies them; an auto-reset keeps the env's draw).
'' (the default) randomises nothing, and the simulation is exactly that of a run without the flag.
Every backend (mujoco_cpu, mjx, mjx_warp) takes every parameter, for the project's own tasks; camera,
camera_tilt and color change only what `--obs=pixels` sees (on mujoco_cpu and mjx_warp, which render), and
camera / camera_tilt move cameras of MuJoCo's default mode, fixed to their body (as push_cube's).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

# name -> what one draw of it does (per env and element); scales multiply the model's value.
RANDOMIZE_PARAMS = {
    'friction': "scale of each geom's sliding friction (geom_friction[:, 0])",
    'mass': "scale of each body's mass and inertia (body_mass, body_inertia)",
    'gain': "scale of each actuator's force law: its gain and bias terms (actuator_gainprm[:, :3], "
            "actuator_biasprm[:, :3]: a motor's gear, a position servo's kp and kv, a velocity servo's kv); "
            "affine actuators only",
    'camera': "offset in metres added to each camera's position, per axis (cam_pos)",
    'camera_tilt': "rotation in radians of each camera about its own x axis (cam_quat)",
    'color': "scale of each geom's R, G and B, clipped to [0, 1] (geom_rgba[:, :3])",
}
# Parameters that scale a model value: their ranges must be > 0 (a colour's >= 0).
_SCALES = ('friction', 'mass', 'gain', 'color')

Range = Optional[Tuple[float, float]]


def _flag(name: str, value) -> str:
  return f'--randomize={name}={value[0]}:{value[1]}'


@dataclasses.dataclass(frozen=True)
class RandomizationConfig:
  """One (lo, hi) range per parameter of `RANDOMIZE_PARAMS`; None leaves it as the model has it."""
  friction: Range = None
  mass: Range = None
  gain: Range = None
  camera: Range = None
  camera_tilt: Range = None
  color: Range = None

  def __post_init__(self):
    for name in RANDOMIZE_PARAMS:
      value = getattr(self, name)
      if value is None:
        continue
      if len(value) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value):
        raise ValueError(f'--randomize: {name}={value} must be two finite numbers lo:hi.')
      if value[0] > value[1]:
        raise ValueError(f'{_flag(name, value)}: lo must be <= hi.')
      if name in _SCALES and (value[0] < 0 or (value[0] == 0 and name != 'color')):
        raise ValueError(f'{_flag(name, value)}: {name} is a scale; its range must be '
                         f'{">= 0" if name == "color" else "> 0"}.')

  @property
  def enabled(self) -> bool:
    return any(getattr(self, name) is not None for name in RANDOMIZE_PARAMS)

  @property
  def ranges(self) -> Tuple[Tuple[str, Tuple[float, float]], ...]:
    """(name, (lo, hi)) of each randomised parameter, in `RANDOMIZE_PARAMS` order."""
    return tuple((n, getattr(self, n)) for n in RANDOMIZE_PARAMS if getattr(self, n) is not None)

  @property
  def pixels_only(self) -> bool:
    """True if it randomises only what a camera sees (camera pose, colours), not the physics."""
    return all(n in ('camera', 'camera_tilt', 'color') for n, _ in self.ranges)


def parse_randomize(spec: str) -> RandomizationConfig:
  """`'friction=0.8:1.2,mass=0.9:1.1'` -> RandomizationConfig; '' -> nothing randomised. A bad spec is a
  ValueError of one line naming --randomize and the valid parameters."""
  spec = spec.strip()
  if not spec:
    return RandomizationConfig()
  valid = ', '.join(RANDOMIZE_PARAMS)
  ranges = {}
  for entry in spec.split(','):
    name, sep, value = entry.strip().partition('=')
    name = name.strip()
    if not sep or name not in RANDOMIZE_PARAMS:
      raise ValueError(f'--randomize={spec}: {entry.strip()!r} must be name=lo:hi with name one of {valid}.')
    if name in ranges:
      raise ValueError(f'--randomize={spec}: {name} is given twice.')
    lo, sep, hi = value.partition(':')
    try:
      if not sep:
        raise ValueError(value)
      ranges[name] = (float(lo), float(hi))
    except ValueError:
      raise ValueError(f'--randomize={spec}: {name}={value} must be a range lo:hi of two numbers '
                       f'(e.g. {name}=0.9:1.1).') from None
  return RandomizationConfig(**ranges)
