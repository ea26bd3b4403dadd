"""Shared pieces of the run tests (tests/rollout, tests/controller, the command-line ones): the tiny MJX run
config and the tiny native pendulum config, the check that a run consumed each of its segments once, the check
that a finished process run left no worker and no shared memory, and whether a small tmpfs can be mounted (the
full-disk tests)."""
import json
import os
import shutil
import subprocess
import time

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import lifecycle


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


def tiny_pendulum_config(run_dir, sim_kw=None, algo_kw=None, **schedule_kw) -> config_lib.Config:
  """inverted_pendulum on native MuJoCo with 32 envs (8 eval envs, 1 thread), a batch of 32 in 8 minibatches, in
  `run_dir`, no compilation cache, no progress bar, no telemetry; 2560 env steps over 2 evaluations unless
  `schedule_kw` says otherwise (and `sim_kw`/`algo_kw` on top): the fused CPU run the checkpoint tests write."""
  schedule = {
      'num_timesteps': 2560,
      'num_evals': 2,
      'compilation_cache_dir': '',
      'progress_bar': False,
      'run_dir': str(run_dir),
      **schedule_kw
  }
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=32,
                                                    num_eval_envs=8,
                                                    num_threads=1,
                                                    **(sim_kw or {})),
                           algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8, **(algo_kw or {})),
                           schedule=config_lib.ScheduleConfig(**schedule),
                           resources=config_lib.ResourceConfig(telemetry_period_s=0))


def assert_each_segment_once(summary, env_steps: int, segments: int, max_staleness=None) -> dict:
  """The run (a `controller.run` summary) took `env_steps` env steps and consumed `segments` segments, none twice,
  and none staler than `max_staleness` (where given); returns its `extra`."""
  extra = summary.extra
  assert summary.env_steps == env_steps, (summary.env_steps, env_steps)
  assert (extra['segments_consumed'], extra['segments_duplicated']) == (segments, 0), extra
  if max_staleness is not None:
    assert extra['max_staleness_seen'] <= max_staleness, extra['max_staleness_seen']
  return extra


def assert_nothing_left(run_dir, wait_s: float = 10.0) -> None:
  """The workers a process run recorded in `run_dir/workers.json` end within `wait_s`, and its controller's shared
  memory (`/dev/shm/ebrl_<controller pid>_*`) is gone."""
  workers = json.load(open(os.path.join(run_dir, 'workers.json')))
  deadline = time.monotonic() + wait_s
  while any(lifecycle.pid_alive(p) for p in workers['workers'].values()) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not [p for p in workers['workers'].values() if lifecycle.pid_alive(p)]
  assert not [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{workers["controller"]}_')]


def can_mount_a_tmpfs() -> bool:
  """Whether this machine lets a user namespace mount a tmpfs (`unshare -rm`): the full-disk tests' small disk."""
  if not shutil.which('unshare'):
    return False
  probe = subprocess.run(
      ['unshare', '-rm', 'sh', '-c', 'd=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs "$d" '
       '&& umount "$d"'],
      capture_output=True,
      timeout=30)
  return probe.returncode == 0
