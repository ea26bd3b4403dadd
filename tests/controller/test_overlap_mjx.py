"""`--schedule=overlap` on MJX: sync's evaluation curve bit for bit (PPO and GRPO, 32 envs in two groups). MJX
compiles for tens of seconds on a CPU; overlap loads sync's programs from their shared compilation cache."""
import pytest

import test_overlap  # pylint: disable=import-error  (tests/controller is on the path, as for brax_testlib)


@pytest.mark.parametrize('algo', ['ppo', 'grpo'])
def test_overlap_replays_sync_bit_for_bit_on_mjx(tmp_path, algo):
  # MJX resets inside its jitted collect program: no reset window there.
  test_overlap.check_overlap_replays_sync(tmp_path, algo, 'mjx', switches=['checkpoint', 'evaluate', 'h2d'])
