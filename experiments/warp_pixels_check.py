r"""--obs=pixels on --backend=mjx_warp on a CUDA GPU: frames against native MuJoCo's, step+render throughput, W5.

    MUJOCO_GL=egl python -m experiments.warp_pixels_check --out=$OUT/warp_pixels_check_h200.json

Sections (each written to the JSON as soon as it is done; a time budget, --budget_s, skips what is left, saying
so; the training child starts first, runs beside the agreement section and is stopped --reserve_s before the
budget ends, and the throughput section runs after it):
  agreement   push_cube, --agree_envs envs: their reset states and the states after --agree_steps random env
              steps. Each state is rendered by MJX-Warp (`warp_render.WarpRenderer` on the Warp data after
              `mjx.forward`, so the geom poses are those of its qpos) and by native MuJoCo (`render.PixelRenderer`:
              mujoco.Renderer on EGL, from MUJOCO_GL=egl or switched to, else OSMesa; on an MjData with the same
              qpos/qvel after mj_forward), RGB and depth (uint8, depth_max 2 m). Mean / p99 / max |warp - native|
              per RGB channel value, fraction of values off by more than 32; depth: the same over pixels both
              hit, and the fraction where one hits and the other does not. PNGs next to the JSON: <out>_warp.png
              and <out>_native.png (4 envs, reset state above, stepped state below, 4x upscaled).
  training    a short fused run of experiments/w5_pixels_warp.flags (--train_timesteps env steps: 3 iterations,
              one evaluation) in a child process: its exit code, wall time, and the last records of metrics.jsonl.
  throughput  at --num_envs (1024, 4096), --image_size 64, 3 frames stacked: a jitted lax.scan of --steps
              `stages.step` with uniform random actions, on the env with a camera (step + render + stack) and
              without (step alone): lower+compile s, first run s, env steps/s (median of --repeats).
"""
from __future__ import annotations

import os

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # the GPU is shared with the training child

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics  # pylint: disable=g-import-not-at-top,wrong-import-position
import struct  # pylint: disable=g-import-not-at-top,wrong-import-position
import subprocess  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys  # pylint: disable=g-import-not-at-top,wrong-import-position
import tempfile  # pylint: disable=g-import-not-at-top,wrong-import-position
import time  # pylint: disable=g-import-not-at-top,wrong-import-position
import zlib  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax import numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import mujoco  # pylint: disable=g-import-not-at-top,wrong-import-position
from mujoco import mjx  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from ebrl_jax.sim import manipulation  # pylint: disable=g-import-not-at-top,wrong-import-position
from ebrl_jax.sim import mjx_env  # pylint: disable=g-import-not-at-top,wrong-import-position
from ebrl_jax.sim import render  # pylint: disable=g-import-not-at-top,wrong-import-position
from ebrl_jax.sim import stages  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import warp_agreement  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, 'experiments', 'w5_pixels_warp.flags')
_T0 = time.perf_counter()


def _log(msg):
  print(f'[{time.perf_counter() - _T0:7.1f}s] {msg}', flush=True)


def write_png(path: str, image: np.ndarray) -> None:
  """An RGB uint8 [H, W, 3] image as a PNG (stdlib only: zlib for IDAT, one filter byte 0 per row)."""
  h, w, _ = image.shape
  raw = b''.join(b'\x00' + np.ascontiguousarray(image[y]).tobytes() for y in range(h))

  def chunk(tag, data):
    return struct.pack('>I', len(data)) + tag + data + struct.pack('>I', zlib.crc32(tag + data) & 0xffffffff)

  with open(path, 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0)) +
            chunk(b'IDAT', zlib.compress(raw, 9)) + chunk(b'IEND', b''))


def _tile(frames: np.ndarray, scale: int = 4) -> np.ndarray:
  """[rows, cols, H, W, 3] -> one [rows * H * scale, cols * W * scale, 3] image."""
  rows, cols, h, w, c = frames.shape
  image = frames.transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)
  return image.repeat(scale, axis=0).repeat(scale, axis=1)


def _diff_stats(warp: np.ndarray, native: np.ndarray) -> dict:
  d = np.abs(warp.astype(np.int32) - native.astype(np.int32))
  return {
      'mean_abs': float(d.mean()),
      'p99_abs': float(np.percentile(d, 99)),
      'max_abs': int(d.max()),
      'frac_over_32': float((d > 32).mean())
  }


def _use_egl() -> str:
  """Native MuJoCo's renderer on EGL (MUJOCO_GL=egl, or switched to it here), else OSMesa; says which happened."""
  if render.gl_backend() == 'egl':
    return 'egl from MUJOCO_GL'
  try:
    render.select_gl_backend('egl')
    return 'switched to egl'
  except RuntimeError as err:
    render.select_gl_backend('osmesa')
    return f'egl failed ({err}); osmesa'


def section_agreement(args, result):
  camera = render.CameraObs(height=args.image_size, width=args.image_size, frame_stack=1, depth=True)
  env = push_cube_env(camera)
  renderer, sys = mjx_env.pixel_renderer(env), env.unwrapped.sys
  n = args.agree_envs
  state = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(0), n, 1)
  step = jax.jit(stages.step, static_argnums=0)
  states = {'reset': state}
  for k in range(args.agree_steps):
    state, _ = step(env, state, jax.random.uniform(jax.random.PRNGKey(100 + k), (n, 3), minval=-1.0, maxval=1.0))
  states[f'after_{args.agree_steps}_steps'] = state
  warp_frames = jax.jit(lambda data: renderer.frames(sys, mjx.forward(sys, data))[1])
  model = mujoco.MjModel.from_xml_path(manipulation.XML_PATH)
  datas = [mujoco.MjData(model) for _ in range(n)]
  gl_note = _use_egl()
  native_renderer = render.PixelRenderer(model, camera, n)
  out, pictures = {'gl_backend': render.gl_backend(), 'gl_note': gl_note, 'envs': n, 'image_size': args.image_size}, {}
  try:
    for name, s in states.items():
      data = s.brax_state.pipeline_state
      warp = np.asarray(warp_frames(data))
      qpos, qvel = np.asarray(data.qpos), np.asarray(data.qvel)
      for i, d in enumerate(datas):
        d.qpos[:], d.qvel[:] = qpos[i], qvel[i]
        mujoco.mj_forward(model, d)
      native = native_renderer.render(datas)
      hit_w, hit_n = warp[..., 3] > 0, native[..., 3] < 255
      both = hit_w & hit_n
      out[name] = {
          'rgb': _diff_stats(warp[..., :3], native[..., :3]),
          'depth_both_hit': _diff_stats(warp[..., 3][both], native[..., 3][both]) if both.any() else None,
          'depth_hit_mismatch_frac': float((hit_w != hit_n).mean()),
          'rgb_mean_warp': float(warp[..., :3].mean()),
          'rgb_mean_native': float(native[..., :3].mean()),
      }
      pictures[name] = (warp[:4, ..., :3], native[:4, ..., :3])
      _log(f'agreement {name}: {out[name]["rgb"]}')
  finally:
    native_renderer.close()
  base = os.path.splitext(args.out)[0]
  for side, idx in (('warp', 0), ('native', 1)):
    path = f'{base}_{side}.png'
    write_png(path, _tile(np.stack([p[idx] for p in pictures.values()])))
    out[f'png_{side}'] = os.path.basename(path)
  result['agreement'] = out


def push_cube_env(camera, randomization=None):
  """push_cube on MJX-Warp (250 steps an episode, no action repeat, auto-reset) with `camera` (None: no pixels) and
  `randomization` (a parsed --randomize, or None); the env of this check and of warp_randomize_check."""
  return mjx_env.make_mjx_env('push_cube', 250, 1, True, impl='warp', randomization=randomization, camera=camera)


def time_random_steps(env, n: int, steps: int, repeats: int) -> tuple[dict, object]:
  """`n` envs reset, then a jitted lax.scan of `steps` `stages.step` with uniform random actions in [-1, 1], lowered
  and compiled, run once, then timed `repeats` times: (reset_first_call_s, compile_s, first_run_s, run_s (each
  repeat), env_steps_per_s (median), finite (the last rewards)), and the last state."""
  t = time.perf_counter()
  state = jax.block_until_ready(jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(1), n, 1))
  reset_s = time.perf_counter() - t

  def run(state, key):

    def body(s, k):
      s, res = stages.step(env, s, jax.random.uniform(k, (n, 3), minval=-1.0, maxval=1.0))  # push_cube's 3
      return s, jnp.sum(res.reward)

    return jax.lax.scan(body, state, jax.random.split(key, steps))

  t = time.perf_counter()
  program = jax.jit(run, donate_argnums=0).lower(state, jax.random.PRNGKey(2)).compile()
  compile_s = time.perf_counter() - t
  t = time.perf_counter()
  state, rewards = jax.block_until_ready(program(state, jax.random.PRNGKey(3)))
  first_s = time.perf_counter() - t
  times = []
  for r in range(repeats):
    t = time.perf_counter()
    state, rewards = jax.block_until_ready(program(state, jax.random.PRNGKey(4 + r)))
    times.append(time.perf_counter() - t)
  return {
      'reset_first_call_s': reset_s,
      'compile_s': compile_s,
      'first_run_s': first_s,
      'run_s': times,
      'env_steps_per_s': n * steps / statistics.median(times),
      'finite': bool(np.isfinite(np.asarray(rewards)).all())
  }, state


def _throughput(n: int, camera, steps: int, repeats: int) -> dict:
  out, state = time_random_steps(push_cube_env(camera), n, steps, repeats)
  if camera is not None:
    px = np.asarray(state.pixels[:8])
    out['pixels'] = {'shape': list(state.pixels.shape), 'dtype': str(state.pixels.dtype), 'mean': float(px.mean())}
  return out


def section_throughput(args, result):
  camera = render.CameraObs(height=args.image_size, width=args.image_size, frame_stack=args.frame_stack)
  out = result.setdefault('throughput', {})
  for n in args.num_envs:
    for name, cam in (('step', None), ('step_render', camera)):
      if warp_agreement.over_budget(args, result, f'throughput {n} {name}'):
        return
      out[f'{n}/{name}'] = _throughput(n, cam, args.steps, args.repeats)
      _log(f'throughput {n} {name}: {out[f"{n}/{name}"]["env_steps_per_s"]:.0f} env steps/s, '
           f'compile {out[f"{n}/{name}"]["compile_s"]:.1f}s')
      warp_agreement.write_result(args, result)
    step, both = out[f'{n}/step'], out[f'{n}/step_render']
    out[f'{n}/render_cost'] = {
        'us_per_env_step_step': 1e6 / step['env_steps_per_s'],
        'us_per_env_step_step_render': 1e6 / both['env_steps_per_s'],
        'slowdown': step['env_steps_per_s'] / both['env_steps_per_s']
    }


class Training:
  """The short fused W5 run in a child process, started before the agreement section so that its start-up (XLA
  compiles on the CPU cores) overlaps it; waited for before the throughput section, which it would disturb."""

  def __init__(self, args):
    self._dir = tempfile.TemporaryDirectory()
    self.cmd = [
        sys.executable, '-m', 'ebrl_jax.main', f'--flagfile={FLAGFILE}', f'--num_timesteps={args.train_timesteps}',
        '--num_evals=1', f'--run_dir={self._dir.name}/run'
    ] + args.train_flags.split()
    self._log = open(os.path.join(self._dir.name, 'output.log'), 'w+')  # a file: a full pipe would block it
    self._t0 = time.perf_counter()
    self._proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

  def finish(self, args, result) -> None:
    deadline = _T0 + args.budget_s - args.reserve_s
    try:
      rc = self._proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
      rc = 'timeout'
    wall = time.perf_counter() - self._t0
    self._log.seek(0)
    tail = self._log.read()[-3000:]
    self._log.close()
    records = []
    path = os.path.join(self._dir.name, 'run', 'metrics.jsonl')
    if os.path.exists(path):
      with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    result['training'] = {
        'command': ' '.join(self.cmd[1:]).replace(self._dir.name, '<tmp>'),
        'returncode': rc,
        'finished': rc == 0,
        'wall_s': wall,
        'overlapped_with': 'agreement',
        'metrics_records': len(records),
        'last_records': records[-3:],
        'output_tail': tail
    }
    self._dir.cleanup()
    _log(f'training: rc {rc} after {wall:.0f}s, {len(records)} metrics records')


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default=os.path.join(os.environ.get('OUT', '/tmp'), 'warp_pixels_check_h200.json'))
  p.add_argument('--sections', default='agreement,throughput,training')
  p.add_argument('--image_size', type=int, default=64)
  p.add_argument('--frame_stack', type=int, default=3)
  p.add_argument('--agree_envs', type=int, default=16)
  p.add_argument('--agree_steps', type=int, default=30)
  p.add_argument('--num_envs', default='1024,4096')
  p.add_argument('--steps', type=int, default=100, help='env steps per timed scan')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--train_timesteps',
                 type=int,
                 default=3 * 10240,
                 help='env steps of the training child (the flagfile: 1024 envs x 10 steps = 10240 per iteration)')
  p.add_argument('--train_flags', default='', help='extra flags for the training child (after the flagfile)')
  p.add_argument('--budget_s', type=float, default=320.0, help='skip later sections after this many seconds')
  p.add_argument('--reserve_s', type=float, default=70.0, help='of the budget, kept from the training child')
  args = p.parse_args(argv)
  args.num_envs = [int(n) for n in args.num_envs.split(',')]
  from ebrl_jax.sim import warp as warp_lib  # pylint: disable=g-import-not-at-top
  warp_lib.check_available()
  import warp  # pylint: disable=g-import-not-at-top
  result = {
      'command': 'python -m experiments.warp_pixels_check ' + ' '.join(argv if argv is not None else sys.argv[1:]),
      'device': str(jax.devices()[0].device_kind),
      'versions': {
          'jax': jax.__version__,
          'mujoco': mujoco.__version__,
          'warp': warp.__version__
      },
      'env': {
          k: os.environ.get(k) for k in ('MUJOCO_GL', 'XLA_PYTHON_CLIENT_PREALLOCATE', 'EBRL_WARP_GRAPH_MODE')
      },
      'args': vars(args),
      'skipped': [],
  }
  sections = args.sections.split(',')
  training = Training(args) if 'training' in sections else None
  for name, fn in (('agreement', section_agreement), ('training', training.finish if training else None),
                   ('throughput', section_throughput)):
    if name not in sections:
      continue
    if name != 'training' and warp_agreement.over_budget(args, result, f'before {name}'):
      continue
    _log(f'--- {name}')
    try:
      fn(args, result)
    except Exception as e:  # pylint: disable=broad-except
      result['skipped'].append(f'{name} failed: {type(e).__name__}: {e}'[:2000])
      _log(f'{name} failed: {type(e).__name__}: {e}')
    jax.clear_caches()
    warp_agreement.write_result(args, result)
  _log(f'wrote {args.out}')


if __name__ == '__main__':
  main()
