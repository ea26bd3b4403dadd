"""--obs=pixels end to end on native MuJoCo: push_cube's stacked camera frames (uint8) beside its state, through the
fused schedule and through async worker processes over shared memory, a few iterations each (tiny: 2 envs,
32 x 32 frames, a small CNN). Rendering needs headless OpenGL (EGL or OSMesa, picked by
`render.ensure_headless_gl`); without it these tests skip with the reason."""
import json
import math

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import render
from ebrl_jax.trainer import stages as trainer_stages

ITERATIONS = 3  # of 2 segments x 5 steps


@pytest.fixture(scope='module')
def gl():
  try:
    render.ensure_headless_gl()
    render.PixelRenderer(cpu_env.load_model(cpu_env.registry.load('push_cube')), render.CameraObs(), 1).close()
  except (ImportError, RuntimeError) as err:
    pytest.skip(f'no headless OpenGL for mujoco.Renderer ({render.gl_backend()}): {err}')


def _config(run_dir, schedule, pixel_state='full', **schedule_kw):
  return config_lib.Config(sim=config_lib.SimConfig(task='push_cube',
                                                    pixel_state=pixel_state,
                                                    num_envs=2,
                                                    episode_length=20,
                                                    num_eval_envs=2,
                                                    num_threads=1,
                                                    obs='pixels',
                                                    image_size=32,
                                                    frame_stack=2),
                           policy=config_lib.PolicyConfig(cnn_channels=(8, 16),
                                                          cnn_blocks=0,
                                                          d_model=32,
                                                          policy_hidden_sizes=(32,),
                                                          value_hidden_sizes=(32,)),
                           algo=config_lib.AlgoConfig(batch_size=2, num_minibatches=1, num_updates_per_batch=1),
                           schedule=config_lib.ScheduleConfig(name=schedule,
                                                              run_dir=str(run_dir),
                                                              compilation_cache_dir='',
                                                              progress_bar=False,
                                                              num_timesteps=ITERATIONS * 10,
                                                              num_evals=1,
                                                              checkpoint_every=0,
                                                              first_checkpoint_iteration=0,
                                                              **schedule_kw))


def _losses_finite(run_dir) -> int:
  records = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
  losses = [r['train/ppo/total_loss'] for r in records if 'train/ppo/total_loss' in r]
  assert losses and all(math.isfinite(v) for v in losses), losses
  return len(losses)


@pytest.mark.parametrize('pixel_state,state_dim', [('full', 31), ('proprio', 9)])
def test_fused_pixels_reach_the_train_step_as_uint8_stacks(tmp_path, gl, monkeypatch, pixel_state, state_dim):
  seen = []
  real = trainer_stages.train_step

  def recording(*args, **kwargs):  # traced once per compile: the batch's shapes and dtypes as the trainer sees them
    seen.append(jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype).name), args[5].obs))
    return real(*args, **kwargs)

  monkeypatch.setattr(trainer_stages, 'train_step', recording)
  summary = controller.run(_config(tmp_path / 'fused', 'fused', pixel_state))
  assert summary.env_steps == ITERATIONS * 10 and summary.iterations == ITERATIONS
  # [T, S] = [5 steps, 2 segments]; 32 x 32 RGB frames, 2 stacked: 6 uint8 channels beside push_cube's 31 floats
  # (--pixel_state=full) or its 9 arm values (proprio).
  assert seen and seen[0].pixels == ((5, 2, 32, 32, 6), 'uint8') and seen[0].state == ((5, 2, state_dim), 'float32')
  assert _losses_finite(tmp_path / 'fused') >= 1
  assert all(math.isfinite(e['return']) for e in summary.eval_curve)


def test_async_workers_send_pixel_segments_over_shared_memory(tmp_path, gl):
  # The trainer evaluates in line (--evaluator=trainer): one process fewer on CI's 2 cores; the evaluator process
  # builds the same pixel network (rollout/evaluator.py).
  summary = controller.run(_config(tmp_path / 'async', 'async', num_groups=1, transport='shm', evaluator='trainer'))
  assert summary.env_steps == ITERATIONS * 10
  assert summary.extra['segments_consumed'] == ITERATIONS  # one segment of the one group per iteration
  # The group's segment: [5 steps, 2 envs]. Pixels 5 x 2 x 32 x 32 x 6 = 61,440 bytes; state 5 x 2 x 31 x 4 = 1,240
  # -> 1,280 on 64-byte lines; obs and next_obs 2 x 62,720; raw_action 120 -> 128; six [5, 2] fields 6 x 64 = 384;
  # group, iteration, incarnation and the episode sums 6 x 64 = 384: 126,336 bytes a slot.
  assert summary.extra['topology']['segment_bytes'] == 126_336
  assert _losses_finite(tmp_path / 'async') >= 1
