"""The README's lists of values match the code's: every summary `stopped` value a run can end with is in its list
(`trainer_died` was missing), and the flag table's --platform values are those config accepts (`cuda` was
missing)."""
import os
import re

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import errors
from ebrl_jax.trainer import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, 'README.md')).read()


def test_the_stopped_list_names_every_value_a_summary_can_hold():
  listed = re.search(r'`stopped` saying why \((.*?)\), prints one `STOPPED:` line', README, re.S)
  assert listed, 'the README no longer lists the `stopped` values'
  named = set(re.findall(r'`(\w+)`', listed.group(1)))
  every = {
      *driver.FINISHED, *driver.BUDGETS, *errors.STOP_SIGNALS, errors.DIVERGED, errors.OUT_OF_MEMORY,
      errors.WORKER_FAILED, errors.TRAINER_DIED
  }
  assert every <= named, sorted(every - named)


def test_the_flag_tables_platform_values_are_those_config_accepts():
  row = re.search(r'^\| `--platform` \(([^)]*)\) \|', README, re.M)
  assert row, 'the README\'s flag table has no --platform row'
  listed = set(re.findall(r'`(\w+)`', row.group(1)))

  def accepted(value):
    try:
      config_lib.ResourceConfig(platform=value)
    except ValueError:
      return False
    return True

  candidates = {'cpu', 'gpu', 'cuda', 'rocm', 'tpu', 'metal', 'METAL', 'host'}
  assert listed == {v for v in candidates if accepted(v)}
  assert all(accepted(v) for v in listed)
