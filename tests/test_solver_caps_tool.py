"""experiments/solver_caps.py's native section on a few push_cube envs: the linesearch cap that native MuJoCo never
reaches changes nothing, and an iteration cap of 1 is reached by the steps with contacts."""
import argparse

from experiments import solver_caps


def test_native_section_compares_caps_with_the_default():
  args = argparse.Namespace(steps=30, native_envs=4, caps=solver_caps._parse_caps('0:0,0:8,1:4'))  # pylint: disable=protected-access
  out = solver_caps.native_section(args, 'push_cube')
  assert out['default']['iterations_max'] >= 2  # teeth: the uncapped solver takes 2 iterations somewhere
  assert out['0:8']['qpos_dev_max'] == 0.0 and out['0:8']['one_step_qvel_dev_max'] == 0.0
  assert out['1:4']['share_at_cap'] > 0.1  # steps with contacts iterate at least once, so they reach a cap of 1
  assert set(out) == {'envs', 'env_steps', 'task_options', 'default', '0:8', '1:4'}
