"""A damaged checkpoint step (a metadata file truncated or deleted after its commit) is named by path and step,
and a resume falls back to the newest intact step; a checkpoint of another task is refused by its array shapes,
read from its metadata without orbax (the controller's check)."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.controller import resume_check
from ebrl_jax.generation import policies
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import stages

OPT = stages.make_optimizer(AlgoConfig())


def _state(obs_dim=3, seed=0):
  net = policies.make_network(PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)), obs_dim, 2)
  state = stages.init_train_state(net, OPT, jax.random.PRNGKey(seed), obs_dim)
  return state.replace(policy_version=state.policy_version + seed)


def _saved(tmp_path, steps=(1, 2, 3)):
  directory = str(tmp_path / 'checkpoints')
  with checkpoint.Checkpointer(directory) as ckpt:
    for step in steps:
      ckpt.save(step, _state(seed=step), {'env_steps': 100 * step, 'iterations': step})
  return directory


def _truncate(path):
  with open(path) as f:
    text = f.read()
  with open(path, 'w') as f:
    f.write(text[:len(text) // 2])


def test_a_truncated_step_is_named_and_the_resume_falls_back_to_the_previous_one(tmp_path, caplog):
  directory = _saved(tmp_path)
  metadata = os.path.join(directory, '3', 'state', '_METADATA')
  _truncate(metadata)
  assert checkpoint.damage(directory, 2) is None
  assert checkpoint.damage(directory, 3).startswith(f'{metadata} is not whole')
  with checkpoint.Checkpointer(directory) as ckpt:
    state, extra, step, skipped = ckpt.restore_newest_intact(_state())
    assert step == 2 and extra['iterations'] == 2 and int(state.policy_version) == 2
    assert [s for s, _ in skipped] == [3] and metadata in skipped[0][1]
    assert ckpt.latest_step() == 2  # the damaged step was moved aside: this run's saves never meet it
  assert any('checkpoint 3' in r.getMessage() and metadata in r.getMessage() for r in caplog.records)
  assert [n for n in os.listdir(directory) if n.startswith('3' + checkpoint.DAMAGED_SUFFIX)]


def test_a_deleted_metadata_file_and_a_failing_restore_both_fall_back(tmp_path):
  directory = _saved(tmp_path)
  os.remove(os.path.join(directory, '3', 'extra', 'metadata'))
  os.remove(os.path.join(directory, '2', 'state', 'manifest.ocdbt'))  # only the restore itself finds this one
  assert 'extra/metadata is missing' in checkpoint.damage(directory, 3)
  with checkpoint.Checkpointer(directory) as ckpt:
    _, _, step, skipped = ckpt.restore_newest_intact(_state())
  assert step == 1 and [s for s, _ in skipped] == [3, 2]


def test_no_intact_step_is_a_clear_error_listing_each(tmp_path):
  directory = _saved(tmp_path, steps=(1, 2))
  for step in (1, 2):
    _truncate(os.path.join(directory, str(step), 'state', '_METADATA'))
  with checkpoint.Checkpointer(directory) as ckpt:
    with pytest.raises(FileNotFoundError, match=r'No intact checkpoint .*step 2: .*step 1: '):
      ckpt.restore_newest_intact(_state())


def test_another_tasks_checkpoint_is_refused_by_its_shapes_before_orbax_sees_it(tmp_path):
  directory = _saved(tmp_path, steps=(1,))
  assert checkpoint.shape_mismatch(directory, 1, jax.eval_shape(_state)) is None
  mismatch = checkpoint.shape_mismatch(directory, 1, jax.eval_shape(lambda: _state(obs_dim=5)))
  assert mismatch is not None and 'params.normalizer.mean: (3,) there, (5,) here' in mismatch
  with checkpoint.Checkpointer(directory) as ckpt:
    with pytest.raises(ValueError, match='does not fit this run.s train state'):
      ckpt.restore_newest_intact(_state(obs_dim=5))
    state, _, step, _ = ckpt.restore_newest_intact(_state())  # nothing was moved: the step stays loadable
  assert step == 1
  np.testing.assert_array_equal(state.params.normalizer.mean, _state(seed=1).params.normalizer.mean)


@pytest.mark.parametrize('victim,keep', [('state/manifest.ocdbt', 0), ('state/manifest.ocdbt', 60),
                                         ('state/ocdbt.process_0/manifest.ocdbt', 30),
                                         ('state/array_metadatas/process_0', 0),
                                         ('state/array_metadatas/process_0', 100)])
def test_a_cut_manifest_or_array_metadata_is_found_before_the_restore(tmp_path, victim, keep):
  """The fault suite found these two: only the restore noticed them, and its abort printed dozens of tracebacks."""
  directory = _saved(tmp_path, steps=(1, 2))
  path = os.path.join(directory, '2', victim)
  if not os.path.exists(path):
    pytest.skip(f'this orbax writes no {victim}')
  assert checkpoint.damage(directory, 2) is None and checkpoint.damage(directory, 1) is None  # whole: not flagged
  with open(path, 'r+b') as f:
    f.truncate(keep)
  assert checkpoint.damage(directory, 2).startswith(path)


@pytest.mark.parametrize('saved_critic,named', [('shared', '--critic=shared (this run: mlp)'),
                                                (None, '--critic=shared (checkpoints from before --critic)'),
                                                ('mlp', None)])
def test_the_refusal_names_the_critic_a_checkpoint_was_written_with(tmp_path, saved_critic, named):
  run = {'task': 'ant', 'policy': 'transformer'}
  if saved_critic:
    run['critic'] = saved_critic
  with checkpoint.Checkpointer(str(tmp_path / 'checkpoints')) as ckpt:
    ckpt.save(1, _state(), {'env_steps': 100, 'iterations': 1, 'run': run})
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='ant'),
                          policy=PolicyConfig(kind='transformer'),
                          schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path)))
  text = resume_check.written_by(cfg, 1)
  if named:
    assert text.startswith('for --task=ant --policy=transformer (this run: --task=ant --policy=transformer)')
    assert named in text
  else:  # its task, policy and critic are this run's: nothing to say
    assert text == ''
  other = dataclasses.replace(cfg, sim=config_lib.SimConfig(task='humanoid'))
  assert resume_check.written_by(other, 1).startswith('for --task=ant --policy=transformer (this run: '
                                                      '--task=humanoid --policy=transformer)')


@pytest.mark.parametrize('saved_rate,resume_rate', [(None, 0.05), (0.05, None)])
def test_a_popart_difference_is_named_by_its_flag(tmp_path, saved_rate, resume_rate):
  """A checkpoint with or without PopArt's statistics resumed by a run without or with --value_norm_rate: the
  refusal names the flag (task and policy agree, so they say nothing)."""

  def cfg(rate, resume):
    return config_lib.Config(sim=config_lib.SimConfig(num_envs=4),
                             policy=PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)),
                             algo=AlgoConfig(batch_size=4, num_minibatches=1, value_norm_rate=rate),
                             schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path), resume=resume))

  saved = cfg(saved_rate, False)
  state = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), resume_check.state_template(saved))
  with checkpoint.Checkpointer(str(tmp_path / 'checkpoints')) as ckpt:
    run = {'task': 'inverted_pendulum', 'policy': 'mlp', 'normalize_observations': True}  # zeros: a count of 0
    ckpt.save(1, state, {'env_steps': 100, 'iterations': 1, 'run': run})
  assert resume_check.check_checkpoints(cfg(saved_rate, True))['step'] == 1
  with pytest.raises(ValueError,
                     match=r"value_stats\.\w+ only in (this run|the checkpoint).*\(value_stats is "
                     r"--value_norm_rate's state, set in one run and not the other\)"):
    resume_check.check_checkpoints(cfg(resume_rate, True))


@pytest.mark.parametrize('every', [1, 0])
def test_a_new_run_refuses_a_run_dir_with_checkpoints_even_without_checkpoints_of_its_own(tmp_path, every):
  """--checkpoint_every=0 writes no checkpoint, but its config.json, summary.json and metrics would land beside
  the other run's checkpoints: refused as with checkpoints on."""
  with checkpoint.Checkpointer(str(tmp_path / 'checkpoints')) as ckpt:
    ckpt.save(1, _state(), {'env_steps': 100, 'iterations': 1})
  cfg = config_lib.Config(schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path), checkpoint_every=every))
  with pytest.raises(ValueError, match='already holds checkpoints; pass --resume'):
    resume_check.check_checkpoints(cfg)
