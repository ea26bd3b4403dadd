"""Shared pieces of the run tests (tests/rollout, tests/controller): the tiny MJX run config and the check that a
run consumed each of its segments once."""
from ebrl_jax import config as config_lib


def tiny_mjx_config(run_dir=None, unroll_length=None, **schedule_kw) -> config_lib.Config:
  """inverted_pendulum on --backend=mjx with 8 envs (4 eval envs), 40-step episodes, a batch of 8 in 2 minibatches
  (and `unroll_length` where given), a schedule of `schedule_kw` (in `run_dir` where given) with thread transport, no compilation cache and
  no progress bar: the smallest MJX run that the MJX run tests compile."""
  algo = {} if unroll_length is None else {'unroll_length': unroll_length}
  schedule = {'compilation_cache_dir': '', 'progress_bar': False, 'transport': 'thread', **schedule_kw}
  if run_dir is not None:
    schedule['run_dir'] = str(run_dir)
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    backend='mjx',
                                                    num_envs=8,
                                                    num_eval_envs=4,
                                                    episode_length=40),
                           algo=config_lib.AlgoConfig(batch_size=8, num_minibatches=2, **algo),
                           schedule=config_lib.ScheduleConfig(**schedule))


def assert_each_segment_once(summary, env_steps: int, segments: int, max_staleness=None) -> dict:
  """The run (a `controller.run` summary) took `env_steps` env steps and consumed `segments` segments, none twice,
  and none staler than `max_staleness` (where given); returns its `extra`."""
  extra = summary.extra
  assert summary.env_steps == env_steps, (summary.env_steps, env_steps)
  assert (extra['segments_consumed'], extra['segments_duplicated']) == (segments, 0), extra
  if max_staleness is not None:
    assert extra['max_staleness_seen'] <= max_staleness, extra['max_staleness_seen']
  return extra
