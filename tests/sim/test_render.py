"""Camera observations of the native-MuJoCo pool (push_cube's fixed camera) and the frame-stacking helpers.

Rendering needs a headless GL backend. MuJoCo reads MUJOCO_GL when it is first imported (by an earlier test
module, usually); where that left it with GLFW and no display, the `gl` fixture switches this process to EGL
(`render.select_gl_backend`). Set MUJOCO_GL=osmesa for the run to test OSMesa instead. Without a working
backend the pixel tests skip with the reason, which names the missing library or setting.
"""
import numpy as np
import pytest

from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import manipulation as m
from ebrl_jax.sim import render


@pytest.fixture(scope='module')
def gl():
  try:
    if render.needs_headless_gl():
      render.select_gl_backend('egl')
    render.PixelRenderer(cpu_env.load_model(cpu_env.registry.load('push_cube')), render.CameraObs(), 1).close()
  except (ImportError, RuntimeError) as err:
    pytest.skip(f'no headless OpenGL for mujoco.Renderer ({render.gl_backend()}): {err}')


def _pool(num_envs=2, frame_stack=2, **kw):
  camera = render.CameraObs(frame_stack=frame_stack,
                            depth=kw.pop('depth', False),
                            num_threads=kw.pop('render_threads', 1))
  return cpu_env.CpuEnvPool('push_cube', num_envs, kw.pop('episode_length', 250), num_threads=1, camera=camera, **kw)


def _qpos(cube_xy, target_xy=(0.0, 0.2)):
  return np.array([0.0, 2.5, -2.0, *target_xy, *cube_xy, m.CUBE_HALF, 1.0, 0.0, 0.0, 0.0])


def test_stack_frames_hand_case():
  # Frames 1, 2, 3 of one pixel with 3 channels each, oldest first; pushing frame 4 drops frame 1.
  frame = lambda v: np.full((1, 1, 1, 3), v, np.uint8)
  stack = np.concatenate([frame(1), frame(2), frame(3)], axis=-1)
  np.testing.assert_array_equal(render.stack_frames(stack, frame(4))[0, 0, 0], [2, 2, 2, 3, 3, 3, 4, 4, 4])
  np.testing.assert_array_equal(stack[0, 0, 0], [1, 1, 1, 2, 2, 2, 3, 3, 3])  # pure: the input is unchanged
  np.testing.assert_array_equal(render.fill_stack(frame(7), 3), np.full((1, 1, 1, 9), 7))
  with pytest.raises(ValueError, match='stacked'):
    render.stack_frames(stack, np.zeros((1, 1, 1, 2), np.uint8))


def test_depth_to_uint8_and_camera_obs_validation():
  # depth_max 2 m: 0 -> 0, 1 m -> round(127.5) = 128, 2 m -> 255, 3 m clips to 255.
  np.testing.assert_array_equal(render.depth_to_uint8(np.array([0.0, 1.0, 2.0, 3.0]), 2.0)[..., 0], [0, 128, 255, 255])
  camera = render.CameraObs(frame_stack=4, depth=True)
  assert camera.channels == 4 and camera.shape == (64, 64, 16)
  with pytest.raises(ValueError, match='frame_stack'):
    render.CameraObs(frame_stack=0)


def test_pixels_are_uint8_stacks_refilled_at_reset(gl):
  with _pool(num_envs=2, frame_stack=3) as pool:
    pixels = pool.pixels()
    assert pixels.shape == (2, 64, 64, 9) and pixels.dtype == np.uint8
    # After a reset all frames of the stack are the reset frame.
    np.testing.assert_array_equal(pixels[..., 0:3], pixels[..., 3:6])
    np.testing.assert_array_equal(pixels[..., 3:6], pixels[..., 6:9])
    assert pixels.std() > 10  # an image, not a blank buffer
    before = pixels
    pool.step(np.tile([[1.0, 1.0, 1.0]], (2, 1)))
    after = pool.pixels()
    # Newest last: the stack moved one frame towards the start, and the new frame shows the arm moved.
    np.testing.assert_array_equal(after[..., 0:6], before[..., 3:9])
    assert (after[..., 6:9] != before[..., 6:9]).any()
    pool.reset([0])
    refilled = pool.pixels()
    np.testing.assert_array_equal(refilled[0, ..., 0:3], refilled[0, ..., 6:9])
    np.testing.assert_array_equal(refilled[1], after[1])  # the other env's stack is untouched


def test_auto_reset_refills_the_stack(gl):
  with _pool(num_envs=1, frame_stack=2, episode_length=2) as pool:
    pool.step(np.ones((1, 3)))
    moved = pool.pixels()
    assert (moved[..., 0:3] != moved[..., 3:6]).any()
    res = pool.step(np.ones((1, 3)))
    assert res.done[0] == 1
    fresh = pool.pixels()
    np.testing.assert_array_equal(fresh[..., 0:3], fresh[..., 3:6])


def test_cube_position_changes_the_image(gl):
  with _pool(num_envs=3, frame_stack=1, render_threads=2) as pool:
    qpos = np.stack([_qpos((0.0, 0.0)), _qpos((0.08, 0.04)), _qpos((0.0, 0.0))])
    pool.set_state(range(3), qpos, np.zeros((3, m.NV)))
    pixels = pool.pixels()
  assert (pixels[0] != pixels[1]).sum() > 20  # the 5 cm cube spans several pixels at 64 x 64
  np.testing.assert_array_equal(pixels[0], pixels[2])  # same state, same image (render threads agree)
  red = (pixels[..., 0] > 150) & (pixels[..., 1] < 80) & (pixels[..., 2] < 80)  # the cube is the red thing
  assert red[0].any() and red[1].any() and (red[0] != red[1]).any()


def test_depth_channel(gl):
  with _pool(num_envs=1, frame_stack=1, depth=True) as pool:
    pixels = pool.pixels()
  assert pixels.shape == (1, 64, 64, 4)
  depth = pixels[0, ..., 3].astype(int)
  # Rows further up the image look further along the table (the camera looks down at 45 degrees).
  assert depth[40, 32] < depth[20, 32] < 255


def test_errors_name_the_fix(gl):
  with cpu_env.CpuEnvPool('push_cube', 1, 10, num_threads=1) as pool:
    with pytest.raises(ValueError, match='camera='):
      pool.pixels()
    with pytest.raises(ValueError, match="no camera 'overhead'.*'fixed'"):
      render.PixelRenderer(pool.model, render.CameraObs(camera='overhead'), 1)
  with pytest.raises(ValueError, match='egl or osmesa'):
    render.select_gl_backend('glfw')


def test_missing_gl_library_error_names_library_and_package(monkeypatch):

  def fail(name):  # what PyOpenGL raises when libOSMesa is not installed (measured with apt remove libosmesa6)
    raise AttributeError("'NoneType' object has no attribute 'glGetError'")

  monkeypatch.setattr(render.importlib, 'import_module', fail)
  with pytest.raises(RuntimeError, match=r'is libOSMesa\.so installed \(apt libosmesa6\)'):
    render.select_gl_backend('osmesa')
