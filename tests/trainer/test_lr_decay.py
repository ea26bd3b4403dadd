"""--learning_rate_end: the decay's length filled in from the run (a cell of several: from the iterations it runs),
its validation, and Adam's step following it."""
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import main
from ebrl_jax.controller import cells
from ebrl_jax.runtime import startup
from ebrl_jax.trainer import cadence
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import stages


def _config(**algo):
  return config_lib.Config(sim=config_lib.SimConfig(num_envs=8),
                           algo=config_lib.AlgoConfig(batch_size=8, num_minibatches=2, unroll_length=5, **algo),
                           schedule=config_lib.ScheduleConfig(num_timesteps=1000, num_evals=3))


def test_decay_length_is_the_runs_gradient_steps():
  cfg = _config(learning_rate_end=0.0, num_updates_per_batch=3)
  # 80 env steps an iteration: 13 iterations for 1000 steps, rounded up to 3 chunks of 5 = 15; 3 epochs x 2 mb.
  assert cfg.env_steps_per_iteration == 80
  assert cfg.algo.learning_rate_decay_updates == 15 * 3 * 2
  assert _config().algo.learning_rate_decay_updates == 0  # constant: nothing filled in
  assert _config(learning_rate_end=0.0, learning_rate_decay_updates=7).algo.learning_rate_decay_updates == 7


@pytest.mark.parametrize('algo,flag', [
    (dict(learning_rate_end=1e-3), 'learning_rate_end'),
    (dict(learning_rate_end=-1e-5), 'learning_rate_end'),
    (dict(learning_rate_decay_updates=10), 'learning_rate_decay_updates'),
    (dict(learning_rate_end=0.0, learning_rate_decay_updates=-1), 'learning_rate_decay_updates'),
])
def test_bad_decay_names_its_flag(algo, flag):
  with pytest.raises(ValueError, match=f'--{flag}='):
    config_lib.AlgoConfig(learning_rate=3e-4, **algo)


def _adam_steps(algo, n):
  """Adam's first `n` steps (as positive numbers) on a constant gradient of ones, under `make_optimizer(algo)`."""
  optimizer = stages.make_optimizer(algo)
  params = {'w': jnp.zeros(3)}
  state = optimizer.init(params)
  steps = []
  for _ in range(n):
    updates, state = optimizer.update({'w': jnp.ones(3)}, state, params)
    steps.append(-float(updates['w'][0]))
  return steps


def test_adam_steps_follow_the_linear_decay():
  """Adam's step on a constant gradient is the learning rate (its moments normalise it): 1e-3 at first, 5e-4
  halfway through 10 steps, the end value from step 10 on."""
  algo = config_lib.AlgoConfig(learning_rate=1e-3, learning_rate_end=1e-4, learning_rate_decay_updates=10)
  steps = _adam_steps(algo, 14)
  expected = [1e-3 - 9e-4 * min(i, 10) / 10 for i in range(14)]
  np.testing.assert_allclose(steps, expected, rtol=1e-4)
  np.testing.assert_allclose(_adam_steps(config_lib.AlgoConfig(learning_rate=1e-3), 12)[-1], 1e-3, rtol=1e-4)


def test_flags_reach_the_config():
  values = main.FLAGS.__class__()
  main.define_flags(values)
  values([
      'prog', '--learning_rate_end=0', '--num_timesteps=1000', '--num_envs=8', '--batch_size=8', '--num_minibatches=2',
      '--num_evals=3', '--num_updates_per_batch=3', '--learning_rate_warmup_updates=5'
  ])
  cfg = main.config_from_flags(values)
  assert cfg.algo.learning_rate_end == 0.0 and cfg.algo.learning_rate_warmup_updates == 5
  assert cfg.algo.learning_rate_decay_updates == 15 * 3 * 2


def test_an_algo_config_alone_must_say_how_long_the_decay_is():
  with pytest.raises(ValueError, match='--learning_rate_decay_updates'):
    stages.make_optimizer(config_lib.AlgoConfig(learning_rate_end=0.0))


def test_warmup_then_decay():
  """Adam's step on a constant gradient is the learning rate: 0, 1/4, 2/4, 3/4 of 1e-3 over a 4-step warm-up, then
  the decay to 1e-4 over the remaining 6 of its 10 steps, then held."""
  algo = config_lib.AlgoConfig(learning_rate=1e-3,
                               learning_rate_end=1e-4,
                               learning_rate_decay_updates=10,
                               learning_rate_warmup_updates=4)
  steps = _adam_steps(algo, 12)
  expected = [1e-3 * i / 4 for i in range(4)] + [1e-3 - 9e-4 * min(i, 6) / 6 for i in range(8)]
  np.testing.assert_allclose(steps, expected, rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(_adam_steps(config_lib.AlgoConfig(learning_rate=1e-3, learning_rate_warmup_updates=2), 4),
                             [0.0, 5e-4, 1e-3, 1e-3],
                             rtol=1e-4,
                             atol=1e-9)


def test_warmup_errors_name_the_flag():
  with pytest.raises(ValueError, match='--learning_rate_warmup_updates=-1'):
    config_lib.AlgoConfig(learning_rate_warmup_updates=-1)
  with pytest.raises(ValueError, match='--learning_rate_warmup_updates=10 must be below'):
    stages.make_optimizer(
        config_lib.AlgoConfig(learning_rate_end=0.0, learning_rate_decay_updates=10, learning_rate_warmup_updates=10))


def test_a_warmup_past_the_runs_decay_is_refused_by_the_config():
  """Before any work (main writes config.json only after a Config is made): 90 gradient steps in the run."""
  with pytest.raises(ValueError, match=r'--learning_rate_warmup_updates=90 must be below the decay\'s length, 90 '):
    _config(learning_rate_end=0.0, num_updates_per_batch=3, learning_rate_warmup_updates=90)


@pytest.mark.parametrize('count', [2, 4])
def test_a_cell_of_several_decays_over_the_iterations_it_runs(tmp_path, count):
  """An iteration of `count` cells is every cell's batch, so the run has 1/count of one cell's iterations: the
  whole run's decay (filled in by Config for one cell) spans those, and ends at the last step; a length the user
  set stays as set."""
  cfg = _config(learning_rate_end=0.0, num_updates_per_batch=3)
  trainer = driver.trainer_config(cfg, startup.ProcessConfig(run_dir=str(tmp_path)))
  cell = cells.Cell(rank=0, count=count, run_dir=str(tmp_path))
  mine = cells.trainer_of_cell(trainer, cell, resume=False)
  _, total, _ = cadence.iteration_plan(mine.schedule, mine.env_steps_per_iteration)
  assert mine.algo.learning_rate_decay_updates == total * 3 * 2 < cfg.algo.learning_rate_decay_updates
  assert float(stages.learning_rate_schedule(mine.algo)(total * 3 * 2)) == 0.0
  set_by_hand = driver.trainer_config(_config(learning_rate_end=0.0, learning_rate_decay_updates=7),
                                      startup.ProcessConfig(run_dir=str(tmp_path)))
  assert cells.trainer_of_cell(set_by_hand, cell, resume=False).algo.learning_rate_decay_updates == 7
