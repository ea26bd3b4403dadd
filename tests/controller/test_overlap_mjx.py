"""`--schedule=overlap` on MJX: sync's evaluation curve bit for bit (PPO and GRPO, 32 envs in two groups). MJX
compiles for minutes on a 2-core CPU (measured 373 s for PPO and 520 s for GRPO on a loaded 2-core machine, overlap
loading sync's programs from their shared compilation cache), past what the CI suite has left: the file runs with
EBRL_MJX_EQUIVALENCE=1 (`EBRL_MJX_EQUIVALENCE=1 python -m pytest -q -p no:xdist tests/controller/test_overlap_mjx.py`);
native MuJoCo's equivalence (test_overlap.py) runs in CI."""
import os

import pytest

import test_overlap  # pylint: disable=import-error  (tests/controller is on the path, as for brax_testlib)

pytestmark = pytest.mark.skipif(not os.environ.get('EBRL_MJX_EQUIVALENCE'),
                                reason='minutes of MJX compiles on a CPU; set EBRL_MJX_EQUIVALENCE=1 to run')


@pytest.mark.parametrize('algo', ['ppo', 'grpo'])
def test_overlap_replays_sync_bit_for_bit_on_mjx(tmp_path, algo):
  # MJX resets inside its jitted collect program: no reset window there.
  test_overlap.check_overlap_replays_sync(tmp_path,
                                          algo,
                                          'mjx',
                                          switches=['checkpoint', 'evaluate', 'h2d'],
                                          evaluator='trainer')
