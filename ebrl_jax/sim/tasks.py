"""Numpy definitions of Brax's MJX tasks (reset noise, observation, reward, termination) for native MuJoCo.

Each function works on a batch of envs at once. A `Frame` maps an `mujoco.MjData` field name to its values
gathered over the batch: `frame['xpos']` is `[N, nbody, 3]` with the world body at index 0, so Brax's
`pipeline_state.x.pos[i]` is `frame['xpos'][:, i + 1]`. Brax's `xd` (link velocity at the body origin in the
world frame) is rebuilt from `cvel` and `subtree_com` exactly as `brax.mjx.pipeline` does.

Conventions shared with `brax.envs.<task>` for backend='mjx' (read from brax 0.14.2):
  * `reward_fn(before, after, ctrl, c)` sees the frames before and after one env step (`n_frames` physics
    steps) and `ctrl`, the action after Brax's per-task scaling to the actuator range (what Brax's cost uses).
  * data fields are read after `mj_step` without a further `mj_forward`, like Brax reads them after
    `mjx.step`: positions such as `xpos` lag `qpos` by one physics step on both backends.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Mapping, NamedTuple, Tuple

import numpy as np

Frame = Mapping[str, np.ndarray]
TORSO = 1  # MuJoCo body id of Brax's link 0 (the world body is not a Brax link)


class ModelConsts(NamedTuple):
  """Model constants the task functions need, read once from the `MjModel`."""
  dt: float  # model.opt.timestep * n_frames
  init_q: np.ndarray  # [nq] Brax's `sys.init_q`: custom numeric 'init_qpos' if the xml has one, else qpos0
  ctrl_lo: np.ndarray  # [A]
  ctrl_hi: np.ndarray  # [A]
  body_mass: np.ndarray  # [nbody]
  body_inertia: np.ndarray  # [nbody, 3] principal inertia (Brax: diag of `link.inertia.i`)
  body_rootid: np.ndarray  # [nbody]
  body_id: Dict[str, int]  # body name -> MuJoCo body id
  nv: int
  params: Mapping[str, float]  # the task's reward/termination parameters (TaskDef.params)


def make_consts(model, n_frames: int, params: Mapping[str, float]) -> ModelConsts:
  import mujoco  # pylint: disable=g-import-not-at-top
  init_q = np.array(model.qpos0, dtype=np.float64)
  num_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_NUMERIC, 'init_qpos')
  if num_id >= 0:
    adr = model.numeric_adr[num_id]
    init_q = np.array(model.numeric_data[adr:adr + model.numeric_size[num_id]], dtype=np.float64)
  names = {mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, i): i for i in range(model.nbody)}
  return ModelConsts(
      dt=float(model.opt.timestep) * n_frames,
      init_q=init_q,
      ctrl_lo=np.array(model.actuator_ctrlrange[:, 0]),
      ctrl_hi=np.array(model.actuator_ctrlrange[:, 1]),
      body_mass=np.array(model.body_mass),
      body_inertia=np.array(model.body_inertia),
      body_rootid=np.array(model.body_rootid),
      body_id={
          k: v for k, v in names.items() if k
      },
      nv=int(model.nv),
      params=params,
  )


def scale_to_ctrl_range(action: np.ndarray, c: ModelConsts) -> np.ndarray:
  """Brax's `(a + 1) * (hi - lo) / 2 + lo` used by humanoid, pusher and inverted_pendulum."""
  return (action + 1.0) * (c.ctrl_hi - c.ctrl_lo) * 0.5 + c.ctrl_lo


def _point_velocity(frame: Frame, body: np.ndarray, point: np.ndarray, c: ModelConsts) -> np.ndarray:
  """Linear velocity [N, ..., 3] of a world-frame `point` moving with `body`, from MuJoCo's `cvel`.

  `cvel` holds [angular, linear] velocity at `subtree_com[body_rootid]`; shifting to p adds w x (p - c).
  """
  cvel = frame['cvel'][:, body]
  root_com = frame['subtree_com'][:, c.body_rootid[body]]
  return cvel[..., 3:] + np.cross(cvel[..., :3], point - root_com)


# ----------------------------------------------------------------------------------------------------------
# Resets: (rng, n, c) -> qpos [n, nq], qvel [n, nv].


def reset_noise(rng: np.random.Generator, n: int, c: ModelConsts, scale: float,
                normal_qvel: bool) -> Tuple[np.ndarray, np.ndarray]:
  """init_q + U(-scale, scale); qvel ~ scale * N(0, 1) (ant, halfcheetah) or U(-scale, scale) (the rest)."""
  nq = c.init_q.shape[0]
  qpos = c.init_q + rng.uniform(-scale, scale, size=(n, nq))
  if normal_qvel:
    qvel = scale * rng.standard_normal((n, c.nv))
  else:
    qvel = rng.uniform(-scale, scale, size=(n, c.nv))
  return qpos, qvel


def reset_reacher(rng, n, c):
  qpos, qvel = reset_noise(rng, n, c, 0.1, normal_qvel=False)
  qvel = rng.uniform(-0.005, 0.005, size=qvel.shape)
  dist = 0.2 * rng.uniform(size=n)
  ang = 2.0 * np.pi * rng.uniform(size=n)
  qpos[:, 2:] = np.stack([dist * np.cos(ang), dist * np.sin(ang)], axis=-1)
  qvel[:, 2:] = 0.0
  return qpos, qvel


def reset_pusher(rng, n, c):
  qpos = np.tile(c.init_q, (n, 1))
  cylinder = np.stack([rng.uniform(-0.3, -1e-6, size=n), rng.uniform(-0.2, 0.2, size=n)], axis=-1)
  norm = np.linalg.norm(cylinder, axis=-1, keepdims=True)  # distance to the goal at the origin
  cylinder *= np.where(norm < 0.17, 0.17 / norm, 1.0)
  qpos[:, -4:] = np.concatenate([cylinder, np.zeros((n, 2))], axis=-1)
  qvel = rng.uniform(-0.005, 0.005, size=(n, c.nv))
  qvel[:, -4:] = 0.0
  return qpos, qvel


# ----------------------------------------------------------------------------------------------------------
# Observations: (frame, c) -> [N, O].


def obs_ant(f: Frame, c: ModelConsts) -> np.ndarray:
  return np.concatenate([f['qpos'][:, 2:], f['qvel']], axis=-1)


def obs_halfcheetah(f, c):
  return np.concatenate([f['qpos'][:, 1:], f['qvel']], axis=-1)


def obs_planar_walker(f, c):
  """Hopper and walker2d: qpos with rootz replaced by the torso height, x dropped; qvel clipped to +-10."""
  pos = f['qpos'].copy()
  pos[:, 1] = f['xpos'][:, TORSO, 2]
  return np.concatenate([pos[:, 1:], np.clip(f['qvel'], -10.0, 10.0)], axis=-1)


def _humanoid_com(f: Frame, c: ModelConsts) -> np.ndarray:
  mass = c.body_mass[1:]
  return np.einsum('l,nlk->nk', mass, f['xipos'][:, 1:]) / mass.sum()


def obs_humanoid(f, c):
  """qpos[2:], qvel, per-link com-frame inertia and mass, com velocities, qfrc_actuator (Brax's layout)."""
  n = f['qpos'].shape[0]
  mass = c.body_mass[1:]
  xipos = f['xipos'][:, 1:]
  rot = f['ximat'][:, 1:].reshape(n, -1, 3, 3)
  # Rotated principal inertia plus the parallel-axis term about the whole-body com.
  inertia = np.einsum('nlij,lj,nlkj->nlik', rot, c.body_inertia[1:], rot)
  p = xipos - _humanoid_com(f, c)[:, None]
  pp = np.einsum('nli,nlj->nlij', p, p)
  inertia += mass[None, :, None, None] * (np.sum(p * p, -1)[..., None, None] * np.eye(3) - pp)
  com_inertia = np.concatenate([inertia.reshape(n, -1, 9), np.broadcast_to(mass[None, :, None], (n, len(mass), 1))], -1)
  links = np.arange(1, len(c.body_mass))
  vel = _point_velocity(f, links, xipos, c)
  com_vel = mass[None, :, None] * vel / mass.sum()
  com_velocity = np.concatenate([com_vel, f['cvel'][:, 1:, :3]], axis=-1)
  return np.concatenate(
      [f['qpos'][:, 2:], f['qvel'],
       com_inertia.reshape(n, -1),
       com_velocity.reshape(n, -1), f['qfrc_actuator']],
      axis=-1)


def obs_pusher(f, c):
  ids = [c.body_id['r_wrist_flex_link'], c.body_id['object'], c.body_id['goal']]
  return np.concatenate([f['qpos'][:, :7], f['qvel'][:, :7], f['xipos'][:, ids].reshape(-1, 9)], axis=-1)


_REACHER_TIP = np.array([0.11, 0.0, 0.0])  # fingertip offset in body1's frame


def _reacher_tip_to_target(f: Frame) -> np.ndarray:
  tip = f['xpos'][:, 2] + f['xmat'][:, 2].reshape(-1, 3, 3) @ _REACHER_TIP
  return tip - f['xpos'][:, 3]


def obs_reacher(f, c):
  theta = f['qpos'][:, :2]
  # NOTE: Brax shifts body1's origin velocity by the *unrotated* offset (0.11, 0, 0); reproduced as is.
  origin_vel = _point_velocity(f, np.array(2), f['xpos'][:, 2], c)
  tip_vel = origin_vel - np.cross(_REACHER_TIP, f['cvel'][:, 2, :3])
  return np.concatenate(
      [np.cos(theta), np.sin(theta), f['qpos'][:, 2:], tip_vel[:, :2],
       _reacher_tip_to_target(f)], axis=-1)


def obs_inverted_pendulum(f, c):
  return np.concatenate([f['qpos'], f['qvel']], axis=-1)


# ----------------------------------------------------------------------------------------------------------
# Rewards: (before, after, ctrl, c) -> reward [N], done [N] (bool, termination by failure only).


def _forward_velocity(before: Frame, after: Frame, c: ModelConsts) -> np.ndarray:
  return (after['xpos'][:, TORSO, 0] - before['xpos'][:, TORSO, 0]) / c.dt


def _ctrl_cost(ctrl: np.ndarray, c: ModelConsts) -> np.ndarray:
  return c.params['ctrl_cost_weight'] * np.sum(np.square(ctrl), axis=-1)


def reward_ant(before, after, ctrl, c):
  p = c.params
  z = after['xpos'][:, TORSO, 2]
  healthy = (z >= p['healthy_z_min']) & (z <= p['healthy_z_max'])
  reward = _forward_velocity(before, after, c) + p['healthy_reward'] - _ctrl_cost(ctrl, c)
  return reward, ~healthy


def reward_halfcheetah(before, after, ctrl, c):
  reward = c.params['forward_reward_weight'] * _forward_velocity(before, after, c) - _ctrl_cost(ctrl, c)
  return reward, np.zeros(reward.shape, bool)


def reward_planar_walker(before, after, ctrl, c):
  """Hopper (with the state-range check) and walker2d; all bounds are strict as in Brax."""
  p = c.params
  z, angle = after['xpos'][:, TORSO, 2], after['qpos'][:, 2]
  healthy = (z > p['healthy_z_min']) & (z < p['healthy_z_max'])
  healthy &= (angle > p['healthy_angle_min']) & (angle < p['healthy_angle_max'])
  if 'healthy_state_min' in p:
    state = np.concatenate([after['qpos'][:, 2:], after['qvel']], axis=-1)
    healthy &= np.all((state > p['healthy_state_min']) & (state < p['healthy_state_max']), axis=-1)
  reward = (p['forward_reward_weight'] * _forward_velocity(before, after, c) + p['healthy_reward'] -
            _ctrl_cost(ctrl, c))
  return reward, ~healthy


def reward_humanoid(before, after, ctrl, c):
  p = c.params
  velocity = (_humanoid_com(after, c)[:, 0] - _humanoid_com(before, c)[:, 0]) / c.dt
  z = after['xpos'][:, TORSO, 2]
  healthy = (z >= p['healthy_z_min']) & (z <= p['healthy_z_max'])
  reward = p['forward_reward_weight'] * velocity + p['healthy_reward'] - _ctrl_cost(ctrl, c)
  return reward, ~healthy


def reward_pusher(before, after, ctrl, c):
  # NOTE: Brax measures the distances on the state *before* the step.
  tips, obj, goal = (before['xipos'][:, c.body_id[b]] for b in ('r_wrist_flex_link', 'object', 'goal'))
  reward_near = -np.linalg.norm(obj - tips, axis=-1)
  reward_dist = -np.linalg.norm(obj - goal, axis=-1)
  reward_ctrl = -np.sum(np.square(ctrl), axis=-1)
  reward = reward_dist + c.params['ctrl_cost_weight'] * reward_ctrl + c.params['near_weight'] * reward_near
  return reward, np.zeros(reward.shape, bool)


def reward_reacher(before, after, ctrl, c):
  reward = -np.linalg.norm(_reacher_tip_to_target(after), axis=-1) - np.sum(np.square(ctrl), axis=-1)
  return reward, np.zeros(reward.shape, bool)


def reward_inverted_pendulum(before, after, ctrl, c):
  done = np.abs(after['qpos'][:, 1]) > c.params['max_pole_angle']
  return np.ones(done.shape), done


RewardFn = Callable[[Frame, Frame, np.ndarray, ModelConsts], Tuple[np.ndarray, np.ndarray]]
reset_ant = functools.partial(reset_noise, scale=0.1, normal_qvel=True)
reset_halfcheetah = functools.partial(reset_noise, scale=0.1, normal_qvel=True)
reset_hopper = functools.partial(reset_noise, scale=5e-3, normal_qvel=False)
reset_walker2d = functools.partial(reset_noise, scale=5e-3, normal_qvel=False)
reset_humanoid = functools.partial(reset_noise, scale=1e-2, normal_qvel=False)
reset_inverted_pendulum = functools.partial(reset_noise, scale=0.01, normal_qvel=False)
