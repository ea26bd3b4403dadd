"""A process schedule's first iteration is start-up: run_training moves it into compile_s and leaves its env steps
out of the end-to-end rate (the fused schedules compile ahead of time instead)."""
import time

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import startup
from ebrl_jax.trainer import driver


class _FakeChannelSource:
  """Iterations take 50 ms each, the session's first one 300 ms more (workers starting, train step compiling)."""

  def __init__(self):
    self.startup = None
    self.taken = False

  def compile(self, state, n):
    del state, n
    return 1.0

  def evaluate(self, params, key):
    del params, key
    return {'eval/episode_return': 0.0}

  def run_iterations(self, state, n):
    for i in range(n):
      extra = 0.3 if self.startup is None and i == 0 else 0.0
      time.sleep(0.05 + extra)
      if self.startup is None:
        self.startup = 0.05 + extra
    return state, {}

  def take_startup_s(self):
    if self.taken or self.startup is None:
      return None
    self.taken = True
    return self.startup

  def close(self):
    pass


def test_first_iteration_of_a_process_schedule_counts_as_startup(tmp_path):
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                   num_envs=4,
                                                   num_eval_envs=2,
                                                   episode_length=50),
                          algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1, unroll_length=5),
                          schedule=config_lib.ScheduleConfig(name='fused',
                                                             num_timesteps=8 * 20,
                                                             num_evals=2,
                                                             run_dir=str(tmp_path),
                                                             checkpoint_every=0,
                                                             progress_bar=False))
  trainer = driver.trainer_config(cfg, startup.ProcessConfig(run_dir=str(tmp_path)))
  summary = driver.run_training(trainer, lambda *args: _FakeChannelSource())
  # 8 iterations of 20 env steps in 2 chunks of 4; the first (0.35 s) is start-up: compile 1.0 + 0.35 s,
  # 7 iterations (140 steps) over ~7 x 50 ms.
  assert summary.iterations == 8 and summary.env_steps == 160
  assert summary.compile_s == pytest.approx(1.35, abs=0.02)
  assert summary.train_wall_s == pytest.approx(0.35, abs=0.1)
  assert summary.env_steps_per_s == pytest.approx(140 / summary.train_wall_s)
  assert summary.extra['startup_s'] == pytest.approx(0.35, abs=0.02)
