"""Observation modes and vision encoders: the names and the checks `config.SimConfig`, `config.PolicyConfig` and
`config.Config` run on their `--obs`, `--frame_stack`, `--image_size`, `--vision_encoder`, ... fields (kept here so
that `config.py` stays under 400 lines). Errors are `ValueError`s that name the flag.

`--obs=pixels`: each env's observation is `types.PixelObs(pixels [H, W, 3 * frame_stack] uint8, state [O] float32)`,
the camera frames beside the proprioceptive state, rendered by native MuJoCo's `mujoco.Renderer` on
`--backend=mujoco_cpu` (sim/render.py) or by MJX's GPU renderer inside the jitted simulation stage on
`--backend=mjx_warp` (sim/warp_render.py). `--pixel_depth` adds a uint8 depth channel after each frame's RGB
(round(255 * metres / 2), clipped: `render.CameraObs.depth_max`), so C = 4 * frame_stack; both renderers give it
(a ray that hits nothing reads 0 on mjx_warp and 255, the far plane, on mujoco_cpu).
"""
from __future__ import annotations

from typing import Tuple

from ebrl_jax.config_checks import check_positive

OBS_MODES = ('state', 'pixels')
# --pixel_state: the state values beside the frames: all of the task's (full) or its proprioceptive prefix only
# (proprio: the arm's joints and fingertip for push_cube, so where the cube and the target are comes from pixels).
PIXEL_STATES = ('full', 'proprio')
# Tasks whose model has the camera that pixel observations render ('fixed').
PIXEL_TASKS = ('push_cube',)
# 'cnn': the IMPALA CNN (its d_model features beside the state for --policy=mlp; its feature map as tokens for the
# transformer and token policies); 'patches': ViT patch tokens (transformer and token policies only).
VISION_ENCODERS = ('cnn', 'patches')
MIN_IMAGE_SIZE = 8
# Why a backend cannot give pixels (checked against MJX 3.17: mujoco/mjx/_src/render.py and bvh.py).
NO_JAX_RENDERING = ("MJX's renderer (mjx.render and mjx.refit_bvh, MJX 3.17) takes MuJoCo Warp data only and raises "
                    'NotImplementedError for the JAX implementation')
_NO_RENDERING = {'mjx': NO_JAX_RENDERING}


def pixel_shape(sim) -> Tuple[int, ...]:
  """[H, W, C * frame_stack] of one env's stacked frames with --obs=pixels, C = 3 (RGB) or 4 with --pixel_depth
  (RGB-D); () with --obs=state (`sim` a `config.SimConfig`)."""
  if sim.obs != 'pixels':
    return ()
  return (sim.image_size, sim.image_size, (4 if sim.pixel_depth else 3) * sim.frame_stack)


def check_sim_obs(sim) -> None:
  """SimConfig's observation fields."""
  obs, task, backend, image_size, frame_stack = sim.obs, sim.task, sim.backend, sim.image_size, sim.frame_stack
  if obs not in OBS_MODES:
    raise ValueError(f'--obs={obs!r} is not valid; allowed values: {", ".join(OBS_MODES)}.')
  check_positive('frame_stack', frame_stack)
  if image_size < MIN_IMAGE_SIZE:
    raise ValueError(f'--image_size={image_size} must be at least {MIN_IMAGE_SIZE} (pixels per side).')
  if sim.pixel_state not in PIXEL_STATES:
    raise ValueError(f'--pixel_state={sim.pixel_state!r} is not valid; allowed values: {", ".join(PIXEL_STATES)}.')
  if obs == 'state':
    if frame_stack != 1:
      raise ValueError(f'--frame_stack={frame_stack} stacks camera frames: it needs --obs=pixels.')
    if sim.pixel_depth:
      raise ValueError('--pixel_depth adds a depth channel to camera frames: it needs --obs=pixels.')
    if sim.pixel_state != 'full':
      raise ValueError(f'--pixel_state={sim.pixel_state} chooses the state beside camera frames: it needs --obs=pixels '
                       '(with --obs=state the policy sees the whole state).')
    return
  if backend in _NO_RENDERING:
    raise ValueError(f'--obs=pixels on --backend={backend}: {_NO_RENDERING[backend]}; use --backend=mjx_warp (MJX '
                     "on Warp, rendered on a CUDA GPU) or --backend=mujoco_cpu (native MuJoCo's renderer).")
  if task not in PIXEL_TASKS:
    raise ValueError(f'--obs=pixels needs a task with a camera: --task={" or ".join(PIXEL_TASKS)} (got --task={task}).')


def check_policy_vision(policy) -> None:
  """PolicyConfig's vision-encoder fields (used only with --obs=pixels)."""
  vision_encoder, cnn_channels = policy.vision_encoder, policy.cnn_channels
  if vision_encoder not in VISION_ENCODERS:
    raise ValueError(f'--vision_encoder={vision_encoder!r} is not valid; allowed values: {", ".join(VISION_ENCODERS)}.')
  if not cnn_channels or any(c <= 0 for c in cnn_channels):
    raise ValueError(f'--cnn_channels={list(cnn_channels)} must be non-empty and positive.')
  check_positive('cnn_blocks', policy.cnn_blocks, allow_zero=True)
  check_positive('patch_size', policy.patch_size)


def check_run_pixels(cfg) -> None:
  """The whole run's checks of --obs=pixels (`cfg` a `config.Config`): what the pixel path does not reach yet."""
  sim, policy = cfg.sim, cfg.policy
  if policy.kind == 'mlp' and policy.compute_dtype != 'float32' and sim.obs != 'pixels':
    raise ValueError(f'--compute_dtype={policy.compute_dtype} needs --policy=transformer or token, or --obs=pixels '
                     "(where it is the MLP policy's CNN encoder's; the MLP heads compute in float32).")
  if sim.obs != 'pixels':
    return
  if not cfg.schedule.colocate_generation:
    raise ValueError('--obs=pixels with --nocolocate_generation (a separate generation worker) is not built yet: '
                     'act requests carry state only; keep --colocate_generation.')
  if cfg.resources.plan_generation and (cfg.resources.plan or cfg.schedule.name == 'auto'):
    raise ValueError('--plan_generation with --obs=pixels would weigh a separate generation worker, which the pixel '
                     'path does not have yet (act requests carry state only); drop --plan_generation.')
  if policy.kind == 'mlp' and policy.vision_encoder != 'cnn':
    raise ValueError(f'--vision_encoder={policy.vision_encoder} gives tokens, which --policy=mlp cannot take: use '
                     '--vision_encoder=cnn, or --policy=transformer or token.')
  if policy.vision_encoder == 'patches' and sim.image_size % policy.patch_size:
    raise ValueError(f'--image_size={sim.image_size} must be a multiple of --patch_size={policy.patch_size} '
                     '(--vision_encoder=patches cuts whole patches).')
