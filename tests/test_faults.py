"""The fault suite's short version (issue 17, item 6) — what CI runs of `python -m experiments.faults`: peers
SIGKILLed inside the transport (holding a lock, mid-copy) and bad inputs drawn from the generated list; plus the list itself (at least 80 cases, every category, each refused by the validators
it claims). The kill and signal kinds have their own tests; the long table is experiments/results/faults_cpu.json."""
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import faults  # pylint: disable=wrong-import-position


def test_the_generated_bad_inputs_are_many_and_each_is_refused_in_process():
  cases = faults.generated_bad_inputs()
  assert len(cases) >= 80 and len(set(tuple(argv) for _, argv in cases)) == len(cases)
  categories = collections.Counter(category for category, _ in cases)
  assert {'parse: int', 'parse: float', 'parse: bool', 'validator', 'unknown flag', 'quotas'} <= set(categories)
  for category, argv in cases:
    if category == 'validator':
      assert faults._refused_by_config(argv), argv  # pylint: disable=protected-access
  assert not faults._refused_by_config(('--num_envs=64',))  # pylint: disable=protected-access


def test_the_short_suite_survives_every_trial(tmp_path):
  table = faults.run_suite(faults.SHORT, str(tmp_path), log=lambda line: None)
  rows = {r['kind']: r for r in table['rows']}
  assert set(rows) == set(faults.SHORT.kinds)
  for kind, row in rows.items():
    assert row['trials'] >= 1 and row['survived'] == row['trials'], (kind, table['records'][kind])
    assert row['hangs'] == 0 and row['processes_left'] == 0 and row['shm_bytes_left'] == 0, row
  assert rows['channel_lock']['trials'] == len(faults.CHANNEL_FAULTS)
  assert rows['bad_input']['trials'] == faults.SHORT.bad_inputs
  assert len({r['category'] for r in table['records']['bad_input']}) == faults.SHORT.bad_inputs
  assert table['all_survived']
