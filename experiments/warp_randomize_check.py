r"""--randomize on --backend=mjx_warp on a CUDA GPU: the draws reaching physics, camera and renderer; their cost.

    python -m experiments.warp_randomize_check --out=$OUT/warp_randomize_check_h200.json

Sections (each written to the JSON as soon as it is done):
  reach       push_cube with a 64x64 camera, --check_envs envs in groups of 2, --check_steps env steps of fixed
              actions. Randomised with RANGES_REACH (gain=2:2 doubles every motor), against the plain env stepped
              with doubled actions from the same reset key: max |qpos difference|; the drawn colour scales' range and
              whether a group's envs share them; max |data.cam_xpos - drawn cam_pos| and |data.cam_xmat -
              quat2mat(drawn cam_quat)| of the (worldbody) camera; whether the env's frames equal, bit for bit,
              MJX's renderer on its data with the drawn geom_rgba, and the mean |difference| from the same data
              rendered with the model's own colours. PNG next to the JSON: <out>_frames.png (8 reset states: plain
              above, the same states randomised with RANGES_ALL below, 4x upscaled).
  throughput  at --num_envs (1024, 4096): a jitted lax.scan of --steps `stages.step` (physics + render + a stack
              of 3), uniform random actions, plain vs randomised with RANGES_ALL: compile s, env steps/s (median
              of --repeats), and the slowdown the per-env model fields cost.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
from jax import numpy as jnp
import mujoco
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import render
from ebrl_jax.sim import stages
from experiments import warp_pixels_check

RANGES_REACH = 'gain=2:2,color=0.2:1,camera=-0.05:0.05,camera_tilt=-0.1:0.1'
RANGES_ALL = 'friction=0.7:1.3,mass=0.8:1.2,gain=0.8:1.2,camera=-0.03:0.03,camera_tilt=-0.05:0.05,color=0.5:1'
_T0 = time.perf_counter()


def _log(msg):
  print(f'[{time.perf_counter() - _T0:7.1f}s] {msg}', flush=True)


def _env(camera, spec=''):
  return warp_pixels_check.push_cube_env(camera, config_lib.parse_randomize(spec) if spec else None)


def section_reach(args, result, out_png):
  camera = render.CameraObs(height=64, width=64)
  env, plain = _env(camera, RANGES_REACH), _env(camera)
  n = args.check_envs
  reset, step = jax.jit(stages.reset, static_argnums=(0, 2, 3)), jax.jit(stages.step, static_argnums=0)
  state, state_p = reset(env, jax.random.PRNGKey(2), n, 2), reset(plain, jax.random.PRNGKey(2), n, 2)
  fields = {k: np.asarray(v) for k, v in mjx_env.model_fields(env, state.brax_state).items()}
  base = plain.unwrapped.sys
  scale = fields['geom_rgba'][..., :3] / np.asarray(base.geom_rgba)[None, :, :3]
  actions = jnp.tile(jnp.array([0.3, -0.2, 0.1]), (n, 1))
  for _ in range(args.check_steps):
    state, _ = step(env, state, actions)
    state_p, _ = step(plain, state_p, 2 * actions)
  data = state.brax_state.pipeline_state
  cam = mjx_env.pixel_renderer(env).camera_id
  mats = np.zeros((n, 9))
  for i in range(n):
    mujoco.mju_quat2Mat(mats[i], fields['cam_quat'][i, cam].astype(np.float64))
  frames = np.asarray(state.pixels)
  render_with = jax.jit(lambda rgba, d: mjx_env.pixel_renderer(plain).frames(base.replace(geom_rgba=rgba), d)[1])
  result['reach'] = {
      'ranges':
          RANGES_REACH,
      'envs':
          n,
      'steps':
          args.check_steps,
      'max_abs_qpos_vs_plain_doubled_actions':
          float(np.abs(data.qpos - state_p.brax_state.pipeline_state.qpos).max()),
      'color_scale_min_max': [float(scale.min()), float(scale.max())],
      'groups_share_draws':
          bool(np.array_equal(scale[0::2], scale[1::2])),
      'groups_differ':
          bool(not np.array_equal(scale[0], scale[2])),
      'max_abs_cam_xpos_vs_drawn':
          float(np.abs(np.asarray(data.cam_xpos[:, cam]) - fields['cam_pos'][:, cam]).max()),
      'max_abs_cam_xmat_vs_drawn':
          float(np.abs(np.asarray(data.cam_xmat[:, cam]).reshape(n, 9) - mats).max()),
      'frames_equal_render_with_drawn_colours':
          bool(np.array_equal(np.asarray(render_with(fields['geom_rgba'], data)), frames)),
      'mean_abs_vs_render_with_model_colours':
          float(np.abs(np.asarray(render_with(base.geom_rgba, data)).astype(int) - frames).mean()),
  }
  # The same 8 reset states (a reset's state does not depend on the model), plain and with 8 draws of RANGES_ALL.
  env_all = _env(camera, RANGES_ALL)
  rand_frames = np.asarray(reset(env_all, jax.random.PRNGKey(3), 8, 1).pixels)
  plain_frames = np.asarray(reset(plain, jax.random.PRNGKey(3), 8, 1).pixels)
  warp_pixels_check.write_png(out_png, warp_pixels_check._tile(np.stack([plain_frames, rand_frames])))  # pylint: disable=protected-access
  result['reach']['png'] = os.path.basename(out_png)


def _throughput(n, spec, steps, repeats):
  env = _env(render.CameraObs(height=64, width=64, frame_stack=3), spec)
  timed, _ = warp_pixels_check.time_random_steps(env, n, steps, repeats)
  return {k: timed[k] for k in ('compile_s', 'run_s', 'env_steps_per_s', 'finite')}


def section_throughput(args, result):
  out = result.setdefault('throughput', {'ranges': RANGES_ALL})
  for n in args.num_envs:
    for name, spec in (('plain', ''), ('randomized', RANGES_ALL)):
      out[f'{n}/{name}'] = _throughput(n, spec, args.steps, args.repeats)
      _log(f'throughput {n} {name}: {out[f"{n}/{name}"]["env_steps_per_s"]:.0f} env steps/s')
      _write(args, result)
    out[f'{n}/slowdown'] = out[f'{n}/plain']['env_steps_per_s'] / out[f'{n}/randomized']['env_steps_per_s']


def _write(args, result):
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default=os.path.join(os.environ.get('OUT', '/tmp'), 'warp_randomize_check_h200.json'))
  p.add_argument('--sections', default='reach,throughput')
  p.add_argument('--check_envs', type=int, default=16)
  p.add_argument('--check_steps', type=int, default=5)
  p.add_argument('--num_envs', default='1024,4096')
  p.add_argument('--steps', type=int, default=100)
  p.add_argument('--repeats', type=int, default=3)
  args = p.parse_args(argv)
  args.num_envs = [int(x) for x in args.num_envs.split(',')]
  result = {
      'command': 'python -m experiments.warp_randomize_check ' + ' '.join(argv or []),
      'device': str(jax.devices()[0])
  }
  for name in args.sections.split(','):
    _log(f'section {name}')
    if name == 'reach':
      section_reach(args, result, os.path.splitext(args.out)[0] + '_frames.png')
    elif name == 'throughput':
      section_throughput(args, result)
    else:
      raise ValueError(f'--sections: unknown section {name!r} (reach, throughput).')
    _write(args, result)
  _log(f'wrote {args.out}')


if __name__ == '__main__':
  main()
