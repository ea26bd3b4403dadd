"""Checkpointer: bitwise round trip, retention, errors, and atomicity under a crash or an exception mid-save."""
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import policies
from ebrl_jax.trainer import stages
from ebrl_jax.trainer.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NET = policies.make_network(PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)), 3, 2)
ALGO = AlgoConfig(max_grad_norm=1.0)
OPT = stages.make_optimizer(ALGO)


@functools.lru_cache(maxsize=None)
def _state(seed):
  """A state with non-trivial optimizer moments, counters and statistics (distinct per seed)."""
  state = stages.init_train_state(NET, OPT, jax.random.PRNGKey(seed), 3)
  bump = lambda x: x + 0.5 * (seed + 1) if np.issubdtype(x.dtype, np.floating) else x + seed + 1
  return state.replace(opt_state=jax.tree_util.tree_map(bump, state.opt_state),
                       params=state.params.replace(normalizer=jax.tree_util.tree_map(bump, state.params.normalizer)),
                       num_updates=state.num_updates + 7 * (seed + 1),
                       policy_version=state.policy_version + seed + 1)


def _assert_bitwise_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_bitwise_equal(tmp_path):
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(5, _state(1), {'env_steps': 1234, 'config': {'lr': 3e-4}})
    restored, extra, step = ckpt.restore(_state(0))  # the template's values must not leak through
  assert step == 5 and extra == {'env_steps': 1234, 'config': {'lr': 3e-4}}
  _assert_bitwise_equal(restored, _state(1))
  assert isinstance(restored, stages.TrainState)


def test_retention_and_explicit_step(tmp_path):
  ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), {'step': step})
  assert ckpt.all_steps() == (2, 3) and ckpt.latest_step() == 3
  state, extra, step = ckpt.restore(_state(0), step=2)
  assert step == 2 and extra == {'step': 2}
  _assert_bitwise_equal(state, _state(2))
  with pytest.raises(FileNotFoundError, match='step 1'):
    ckpt.restore(_state(0), step=1)
  ckpt.close()


def test_empty_directory_has_a_clear_error(tmp_path):
  ckpt = Checkpointer(str(tmp_path / 'fresh'))
  assert ckpt.latest_step() is None
  with pytest.raises(FileNotFoundError, match='No checkpoint in .*fresh'):
    ckpt.restore(_state(0))
  with pytest.raises(ValueError, match='JSON'):
    ckpt.save(1, _state(0), {'bad': object()})
  assert ckpt.latest_step() is None
  ckpt.close()


def test_exception_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, _state(1), {'step': 1})

  async def fail(self, x, directory):
    raise RuntimeError('disk full (simulated)')

  # The state item is written first; the metadata write then fails, mid-save.
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, '_save_fn', fail)
  with pytest.raises(RuntimeError, match='simulated'):
    ckpt.save(2, _state(2), {'step': 2})
  monkeypatch.undo()
  try:
    ckpt.close()
  except Exception:  # orbax may re-raise the failed save on close; the process goes on either way
    pass
  reopened = Checkpointer(str(tmp_path))
  assert reopened.latest_step() == 1
  state, extra, step = reopened.restore(_state(0))
  assert step == 1 and extra == {'step': 1}
  _assert_bitwise_equal(state, _state(1))
  reopened.save(2, _state(2), {'step': 2})  # the directory stays usable
  assert reopened.latest_step() == 2
  reopened.close()


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
  # A child process saves step 1, then dies (os._exit, no cleanup) halfway through saving step 2.
  child = textwrap.dedent(f"""
      import os
      from orbax.checkpoint._src.handlers import json_checkpoint_handler
      from tests.trainer.test_checkpoint import _state
      from ebrl_jax.trainer.checkpoint import Checkpointer
      ckpt = Checkpointer({str(tmp_path)!r})
      ckpt.save(1, _state(1), {{'step': 1}})
      async def die(self, x, directory):
        os._exit(17)
      json_checkpoint_handler.JsonCheckpointHandler._save_fn = die
      ckpt.save(2, _state(2), {{'step': 2}})
  """)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''), JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', child], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 17, result.stderr[-2000:]
  leftovers = [n for n in os.listdir(tmp_path) if n.startswith('2')]
  assert leftovers and all('tmp' in n for n in leftovers), os.listdir(tmp_path)  # a half-written step 2
  ckpt = Checkpointer(str(tmp_path))
  assert ckpt.latest_step() == 1
  state, extra, step = ckpt.restore(_state(0))
  assert step == 1 and extra == {'step': 1}
  _assert_bitwise_equal(state, _state(1))
  ckpt.save(2, _state(2), {'step': 2})  # the stale temporary directory does not block a new save
  assert ckpt.latest_step() == 2
  ckpt.close()


def test_stray_tmp_directory_is_ignored(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, _state(1), {'step': 1})
  junk = tmp_path / '3.orbax-checkpoint-tmp-12345'
  junk.mkdir()
  (junk / 'state').write_text(json.dumps({'garbage': True}))
  assert ckpt.latest_step() == 1
  state, _, step = ckpt.restore(_state(0))
  assert step == 1
  _assert_bitwise_equal(state, _state(1))
  ckpt.close()


def test_async_save_is_committed_by_close(tmp_path):
  ckpt = Checkpointer(str(tmp_path), async_save=True)
  ckpt.save(4, _state(1), {'step': 4})
  ckpt.close()  # waits for the background write
  state, extra, step = Checkpointer(str(tmp_path)).restore(_state(0))
  assert step == 4 and extra == {'step': 4}
  _assert_bitwise_equal(state, _state(1))
