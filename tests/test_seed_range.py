"""--seed is checked where the config is built: JAX keeps a seed's low 32 bits (2**32 would draw seed 0's numbers)
and numpy's seeds are >= 0, so only [0, 2**32 - 1] is accepted, with one line naming the flag and the range, where
-1 was a numpy error from the env pool and 10**20 an OverflowError traceback from the root key."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.rollout import keys
from ebrl_jax.sim import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANGE = r'--seed=\S+ must be an integer in \[0, 4294967295\] \(2\*\*32 - 1\)'


@pytest.mark.parametrize('seed', [-1, 2**32, 10**20, True, 1.0])
def test_a_seed_outside_the_range_is_refused_naming_the_flag(seed):
  with pytest.raises(ValueError, match=RANGE):
    config_lib.ScheduleConfig(seed=seed)
  if isinstance(seed, int) and not isinstance(seed, bool):
    with pytest.raises(ValueError, match=RANGE):
      keys.root(seed)


def test_the_range_ends_are_accepted_and_draw_distinct_keys():
  for seed in (0, 2**32 - 1):
    assert config_lib.ScheduleConfig(seed=seed).seed == seed
  assert not np.array_equal(keys.root(0), keys.root(2**32 - 1))
  assert np.array_equal(keys.root(np.int64(5)), jax.random.PRNGKey(5))
  assert np.array_equal(jax.random.PRNGKey(2**32), jax.random.PRNGKey(0))  # why the range ends there


def test_the_native_pool_names_a_negative_seed():
  with pytest.raises(ValueError, match=r'CpuEnvPool: seed=-1 must be an integer >= 0'):
    cpu_env.CpuEnvPool('inverted_pendulum', 2, 10, num_threads=1, seed=-1)


def test_the_command_line_says_it_in_one_line():
  result = subprocess.run(
      [sys.executable, '-m', 'ebrl_jax.main', '--seed=99999999999999999999', '--run_dir=/nonexistent/x'],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True,
      text=True,
      timeout=120)
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(
      'FATAL: --seed=99999999999999999999 '), lines
  assert 'Traceback' not in result.stderr
