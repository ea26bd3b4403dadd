"""Camera frames of MJX-Warp envs rendered on the GPU by MJX's renderer, from jitted JAX code (`--obs=pixels` on
`--backend=mjx_warp`).

    renderer = WarpRenderer(mj_model, render.CameraObs(height=64, width=64, frame_stack=3))
    data, frames = renderer.frames(sys, data)        # data: batched Warp data [B, ...]; frames [B, 64, 64, 3] uint8

MJX 3.17's API (`mujoco.mjx`): `create_render_context(mjm, nworld, cam_res=(W, H), render_rgb, render_depth,
use_textures, use_shadows, cam_active, ...)` builds MuJoCo Warp's ray-casting context on the device for exactly
`nworld` envs (its buffers are Warp arrays that JAX does not see, so one context serves one batch size);
`refit_bvh(m, d, ctx)` refits the scene's bounding-volume hierarchy to the envs' current geom poses, and
`render(m, d, ctx) -> (rgb, depth, d)` ray-casts every active camera of every env into packed buffers
(uint32 ABGR, float32 planar depth in metres), which `get_rgb` / `get_depth` unpack to [B, H, W, 3|1] floats
in [0, 1]. `m` and `d` must be MJX-Warp's (`impl='warp'`): for MJX's JAX implementation `render` and
`refit_bvh` raise NotImplementedError, which is why `--backend=mjx` cannot give pixels.

A frame is what `render.PixelRenderer` gives for native MuJoCo: RGB uint8 [H, W, 3] (round(255 x)), plus one
uint8 depth channel with `camera.depth` (round(255 * depth / depth_max), clipped). Differences from
`mujoco.Renderer` that remain: a ray caster, not OpenGL rasterisation, so edges are not antialiased either way
but shading differs slightly; a ray that hits nothing gives the background colour (black) and depth 0 where GL
gives the far plane (255 after clipping). experiments/warp_pixels_check.py measures the agreement on push_cube.

The returned `d` carries the renderer's execution token (it orders the Warp calls that share the context's
buffers); callers keep it as the env's new data so the next refit comes after this render.

NOTE: contexts are made while the first program for a batch size is traced (lazily, under a lock: the fused
schedule traces its evaluation program in a second thread) and live as long as the renderer, whose env is
memoised for the process.
"""
from __future__ import annotations

import threading
from typing import Dict, Tuple

import jax
from jax import numpy as jnp
import mujoco
from mujoco import mjx

from ebrl_jax.sim import render


class WarpRenderer:
  """Renders MJCF camera `camera.camera` of every env of a batched MJX-Warp state into uint8 frames."""

  def __init__(self, mj_model: mujoco.MjModel, camera: render.CameraObs):
    self.camera = camera
    self._mj_model = mj_model
    self.camera_id = mujoco.mj_name2id(mj_model, mujoco.mjtObj.mjOBJ_CAMERA, camera.camera)
    if self.camera_id < 0:
      cameras = [mujoco.mj_id2name(mj_model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(mj_model.ncam)]
      raise ValueError(f'CameraObs: the model has no camera {camera.camera!r}; its cameras: {cameras}.')
    self._contexts: Dict[int, object] = {}
    self._lock = threading.Lock()

  def context(self, num_envs: int):
    """The render context for batches of `num_envs` envs (made on first use)."""
    with self._lock:
      if num_envs not in self._contexts:
        self._contexts[num_envs] = mjx.create_render_context(
            mjm=self._mj_model,
            nworld=int(num_envs),
            cam_res=(self.camera.width, self.camera.height),
            render_rgb=True,
            render_depth=self.camera.depth,
            render_seg=False,
            use_textures=self._mj_model.ntex > 0,
            use_shadows=False,  # as PixelRenderer, which turns GL shadows off
            cam_active=[self.camera_id],  # the one camera: index 0 of the context's outputs
            enabled_geom_groups=[0, 1, 2])  # mjv's default visible groups
      return self._contexts[num_envs]

  def frames(self, sys, data) -> Tuple[object, jax.Array]:
    """(data with the render's token, frames [B, H, W, C] uint8) of the batched Warp `data` [B, ...]; `sys` the
    MJX-Warp model (a Brax System whose mjx.Model fields are impl='warp')."""
    handle = self.context(int(data.qpos.shape[0])).pytree()
    data = mjx.refit_bvh(sys, data, handle)
    rgb, depth, data = mjx.render(sys, data, handle)
    frame = jnp.round(mjx.get_rgb(handle, 0, rgb) * 255.0).astype(jnp.uint8)
    if self.camera.depth:
      scaled = mjx.get_depth(handle, 0, depth, self.camera.depth_max)  # depth / depth_max, clipped to [0, 1]
      frame = jnp.concatenate([frame, jnp.round(scaled * 255.0).astype(jnp.uint8)], axis=-1)
    return data, frame
