"""The project's manipulation task `push_cube`: reset noise, observation, reward and termination.

A planar 3-link arm on a table pushes a free cube onto a target disc (model: `assets/push_cube.xml`, whose
header gives the qpos/qvel layout and the frame). The functions here are written once for both backends: each
takes the array module `xp` (numpy for `mujoco_cpu`, `jax.numpy` for the MJX env in `manipulation_mjx`) and
indexes the trailing axes only, so they apply to a numpy batch `[N, ...]` and to one unbatched JAX env alike.

Conventions are those of `ebrl_jax.sim.tasks`: a frame maps MjData field names to arrays, read after the
physics steps without a further forward (so `site_xpos` lags `qpos` by one physics step on both backends);
`reward_fn(before, after, ctrl, c)` uses the frame after the step and the unscaled action (ctrlrange is
[-1, 1]).

Reward per env step (weights in `PARAMS`):
    - reach_weight * |cube - fingertip| - push_weight * |target - cube| - ctrl_cost_weight * sum(action^2)
    + success_bonus * [|target - cube| < success_radius]
Episodes end by the time limit only, or when the cube's centre leaves the table (|x| or |y| > table_half):
that is a failure (done without truncation).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Tuple

import numpy as np

XML_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'assets', 'push_cube.xml')

# Layout of assets/push_cube.xml (checked against the compiled model by `check_layout`).
ARM_Q = slice(0, 3)  # shoulder, elbow, wrist
TARGET_Q = slice(3, 5)  # target_x, target_y (slide joints, no collision, never pushed)
CUBE_POS_Q, CUBE_QUAT_Q = slice(5, 8), slice(8, 12)  # the cube's free joint
ARM_V, TARGET_V, CUBE_V = slice(0, 3), slice(3, 5), slice(5, 11)
SITE_FINGERTIP, SITE_TARGET, SITE_CUBE = 0, 1, 2
NQ, NV, NU = 12, 11, 3
OBS_DIM = 31
PROPRIO_DIM = 9  # the observation's first values: arm qpos, arm qvel, fingertip (what --pixel_state=proprio keeps)
CUBE_HALF = 0.025  # the cube's half size = height of its centre at rest and of the target site

PARAMS: Mapping[str, float] = dict(
    reach_weight=0.5,
    push_weight=1.0,
    ctrl_cost_weight=0.01,
    success_bonus=1.0,
    success_radius=0.05,
    table_half=0.5,
    # Reset: arm joints init_q + U(-arm_noise, arm_noise), arm velocities U(-arm_vel_noise, arm_vel_noise);
    # cube centre and target uniform in their boxes (disjoint in y, so no episode starts solved), cube yaw
    # U(-cube_yaw, cube_yaw); the cube and the target start at rest.
    arm_noise=0.1,
    arm_vel_noise=0.01,
    cube_x=0.1,
    cube_y_lo=-0.05,
    cube_y_hi=0.05,
    cube_yaw=np.pi / 4,
    target_x=0.15,
    target_y_lo=0.12,
    target_y_hi=0.25)
NUM_UNIFORMS = 11  # uniform draws per reset: 3 arm pos, 3 arm vel, cube x, y, yaw, target x, y


class PushCubeTerms(NamedTuple):
  """The reward's terms per env [...]: reach and push distances, control cost, success (bool), done (bool)."""
  reach_dist: Any
  push_dist: Any
  ctrl_cost: Any
  success: Any
  done: Any


def check_layout(model) -> None:
  """Raises ValueError if the compiled model does not have the layout the task functions index."""
  import mujoco  # pylint: disable=g-import-not-at-top
  site = lambda i: mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_SITE, i)
  got = (model.nq, model.nv, model.nu, site(SITE_FINGERTIP), site(SITE_TARGET), site(SITE_CUBE),
         int(model.jnt_qposadr[-1]), int(model.jnt_type[-1]))
  want = (NQ, NV, NU, 'fingertip', 'target', 'cube', CUBE_POS_Q.start, int(mujoco.mjtJoint.mjJNT_FREE))
  if got != want:
    raise ValueError(f'push_cube model layout {got} differs from the one the task indexes {want}.')


def reset_from_uniform(u, init_q, p: Mapping[str, float], xp=np):
  """(qpos [..., NQ], qvel [..., NV]) from uniforms u [..., NUM_UNIFORMS] in [0, 1): the reset both backends
  share (each draws u with its own generator)."""
  span = lambda v, lo, hi: lo + (hi - lo) * v
  arm = init_q[ARM_Q] + span(u[..., 0:3], -p['arm_noise'], p['arm_noise'])
  arm_vel = span(u[..., 3:6], -p['arm_vel_noise'], p['arm_vel_noise'])
  cube_xy = xp.stack([span(u[..., 6], -p['cube_x'], p['cube_x']),
                      span(u[..., 7], p['cube_y_lo'], p['cube_y_hi'])],
                     axis=-1)
  half_yaw = 0.5 * span(u[..., 8], -p['cube_yaw'], p['cube_yaw'])
  target = xp.stack(
      [span(u[..., 9], -p['target_x'], p['target_x']),
       span(u[..., 10], p['target_y_lo'], p['target_y_hi'])], axis=-1)
  zero = xp.zeros_like(half_yaw)
  quat = xp.stack([xp.cos(half_yaw), zero, zero, xp.sin(half_yaw)], axis=-1)  # a turn about z
  qpos = xp.concatenate([arm, target, cube_xy, (zero + CUBE_HALF)[..., None], quat], axis=-1)
  qvel = xp.concatenate([arm_vel, xp.zeros(arm_vel.shape[:-1] + (NV - 3,), dtype=arm_vel.dtype)], axis=-1)
  return qpos, qvel


def observation(f, xp=np):
  """[..., OBS_DIM]: arm qpos (3), arm qvel (3), fingertip (3), cube centre (3), cube quat (4), cube velocity
  (6: linear, angular), target (3), cube - fingertip (3), target - cube (3)."""
  sites = f['site_xpos']
  tip, target, cube = sites[..., SITE_FINGERTIP, :], sites[..., SITE_TARGET, :], sites[..., SITE_CUBE, :]
  qpos, qvel = f['qpos'], f['qvel']
  return xp.concatenate([
      qpos[..., ARM_Q], qvel[..., ARM_V], tip, cube, qpos[..., CUBE_QUAT_Q], qvel[..., CUBE_V], target, cube - tip,
      target - cube
  ],
                        axis=-1)


def reward_terms(after, action, p: Mapping[str, float], xp=np) -> PushCubeTerms:
  sites = after['site_xpos']
  tip, target, cube = sites[..., SITE_FINGERTIP, :], sites[..., SITE_TARGET, :], sites[..., SITE_CUBE, :]
  push_dist = xp.linalg.norm(target - cube, axis=-1)
  off_table = xp.any(xp.abs(cube[..., :2]) > p['table_half'], axis=-1)
  return PushCubeTerms(reach_dist=xp.linalg.norm(cube - tip, axis=-1),
                       push_dist=push_dist,
                       ctrl_cost=xp.sum(xp.square(action), axis=-1),
                       success=push_dist < p['success_radius'],
                       done=off_table)


def reward(terms: PushCubeTerms, p: Mapping[str, float], xp=np):
  return (-p['reach_weight'] * terms.reach_dist - p['push_weight'] * terms.push_dist -
          p['ctrl_cost_weight'] * terms.ctrl_cost + xp.where(terms.success, p['success_bonus'], 0.0))


# ----------------------------------------------------------------------------------------------------------
# The numpy task functions of the registry (signatures of `ebrl_jax.sim.tasks`).


def reset_push_cube(rng: np.random.Generator, n: int, c) -> Tuple[np.ndarray, np.ndarray]:
  return reset_from_uniform(rng.uniform(size=(n, NUM_UNIFORMS)), c.init_q, c.params)


def obs_push_cube(f, c) -> np.ndarray:
  return observation(f)


def reward_push_cube(before, after, ctrl, c) -> Tuple[np.ndarray, np.ndarray]:
  terms = reward_terms(after, ctrl, c.params)
  return reward(terms, c.params), terms.done
