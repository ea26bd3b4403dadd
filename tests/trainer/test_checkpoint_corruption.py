"""A checkpoint whose data files were changed on disk after its commit: orbax keeps no checksum, so 0xFF bytes
written into a data file mostly restore without error, as NaN or values near 1e38. The restore checks every float
value (NaN, infinite, beyond +-1e30) and every array against the fingerprint its save recorded (data that reads
back as plausible values of another state), a resume falls back from such a step to the newest intact one, naming the
step and the first bad array, and a run with no intact step left is one FATAL line instead of resuming into a
'divergence'."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import controller
from ebrl_jax.controller import resume_check
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import checkpoint_values

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0')


def _config(run_dir, **schedule):
  return runs_testlib.tiny_pendulum_config(run_dir, **schedule)


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A finished fused run on the pendulum: 2 iterations, checkpoints 1 and 2."""
  run_dir = tmp_path_factory.mktemp('previous') / 'run'
  assert controller.run(_config(run_dir)).iterations == 2
  return run_dir


def _template(run_dir):
  return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), resume_check.state_template(_config(run_dir)))


def _overwrite_data(directory, step):
  """0xFF bytes over three places of step `step`'s largest data file (zstd-compressed arrays, no checksum): orbax
  restores them mostly without error, as NaN or values with random exponents, or fails to decode them."""
  name = max(glob.glob(os.path.join(directory, str(step), 'state', '**', 'd', '*'), recursive=True),
             key=os.path.getsize)
  with open(name, 'r+b') as f:
    for quarter in (1, 2, 3):
      f.seek(os.path.getsize(name) * quarter // 4)
      f.write(b'\xff' * 256)


# The reason a damaged step gives: its first bad array by path, or the decoding error naming its file.
DAMAGED = (r'its data (reads back with values no run saves \([\w.]+: \d+ of \d+ values are NaN, infinite or beyond '
           r'\+-1e\+30\): a data file was changed on disk|does not read back \(\w+: .*\))')


def test_the_check_names_the_first_bad_leaf_of_params_optimizer_or_normalizer():
  normalizer = {'count': jnp.float32(3), 'mean': jnp.zeros(4)}
  state = {
      'params': {
          'normalizer': normalizer,
          'w': jnp.ones((2, 3))
      },
      'opt_state': ({
          'nu': jnp.ones(5, jnp.bfloat16)
      },)
  }
  state['steps'] = jnp.int32(-1)  # ints are not checked
  assert checkpoint_values.implausible_leaf(state) is None
  for bad in (jnp.nan, jnp.inf, -1e38):
    broken = dict(state, opt_state=({'nu': state['opt_state'][0]['nu'].at[1:3].set(bad)},))
    assert checkpoint_values.implausible_leaf(
        broken) == 'opt_state.0.nu: 2 of 5 values are NaN, infinite or beyond +-1e+30'
  broken = dict(state, params=dict(state['params'], normalizer=dict(normalizer, mean=jnp.full(4, jnp.inf))))
  assert checkpoint_values.implausible_leaf(broken).startswith('params.normalizer.mean: 4 of 4 values')
  assert checkpoint_values.implausible_leaf({'big': jnp.float32(-1e29), 'n': jnp.int32(2**31 - 1)}) is None


def test_a_fingerprint_changes_with_any_one_word_a_swap_or_a_dtype_of_any_width():
  leaves = {
      'f32': jnp.linspace(-1.0, 1.0, 1000, dtype=jnp.float32),
      'bf16': jnp.linspace(-1.0, 1.0, 64).astype(jnp.bfloat16),
      'i32': jnp.arange(7, dtype=jnp.int32),
      'flag': jnp.array([True, False, True]),
      'key': jax.random.key(3),
      'scalar': jnp.float32(2.5),
  }
  base = checkpoint_values.fingerprints(leaves)
  assert sorted(base) == sorted(leaves) and all(0 <= v < 2**32 for v in base.values())
  assert checkpoint_values.fingerprints(jax.device_get(leaves)) == base  # host arrays as a multi-rank save gives
  bits = np.asarray(leaves['f32']).view(np.uint32).copy()
  for i in (0, 499, 999):
    for flip in (1, 1 << 31):
      one = bits.copy()
      one[i] ^= flip
      changed = dict(leaves, f32=jnp.asarray(one.view(np.float32)))
      assert checkpoint_values.fingerprints(changed)['f32'] != base['f32'], (i, flip)
  swapped = np.asarray(leaves['f32']).copy()
  swapped[[10, 11]] = swapped[[11, 10]]
  assert checkpoint_values.fingerprints(dict(leaves, f32=jnp.asarray(swapped)))['f32'] != base['f32']
  # +1.0 and -1.0 differ by 2**31: under scheme 1's odd weights a swap of them two places apart cancels
  signs = {'w': jnp.array([1.0, 0.5, -1.0, 0.25])}
  swap = {'w': jnp.array([-1.0, 0.5, 1.0, 0.25])}
  assert checkpoint_values.fingerprints(swap, 1) == checkpoint_values.fingerprints(signs, 1)
  assert checkpoint_values.changed_leaf(swap, checkpoint_values.fingerprints(signs)).startswith('w: ')
  others = dict(leaves,
                bf16=-leaves['bf16'],
                i32=leaves['i32'] + 1,
                flag=~leaves['flag'],
                key=jax.random.key(4),
                scalar=jnp.float32(2.25))
  assert all(checkpoint_values.fingerprints(others)[k] != base[k] for k in others if k != 'f32')
  assert checkpoint_values.changed_leaf(leaves, base) is None and checkpoint_values.changed_leaf(leaves, {}) is None
  assert checkpoint_values.changed_leaf(others, base).startswith('bf16: its values differ from those saved')


def test_data_that_reads_back_as_another_saved_state_is_named_by_its_fingerprint(tmp_path, finished_run):
  """Step 1's data files under step 2's metadata: every value is one a run saved (no implausible value), but not
  the values step 2 saved; the resume falls back past it."""
  directory = str(tmp_path / 'checkpoints')
  shutil.copytree(finished_run / 'checkpoints', directory)
  shutil.rmtree(os.path.join(directory, '2', 'state'))
  shutil.copytree(os.path.join(directory, '1', 'state'), os.path.join(directory, '2', 'state'))
  with checkpoint.Checkpointer(directory) as ckpt:
    state, extra, step = ckpt.restore(_template(directory), 1)  # intact; the fingerprints are not handed back
    assert step == 1 and checkpoint_values.FINGERPRINTS not in extra and extra['iterations'] == 1
    assert checkpoint_values.implausible_leaf(state) is None
    with pytest.raises(checkpoint.DamagedStep,
                       match=rf'^checkpoint 2 \({directory}/2\) is damaged: its data reads back other than it was '
                       r'saved \([\w.]+: its values differ from those saved \(fingerprint 0x[0-9a-f]{8}, saved '
                       r'0x[0-9a-f]{8}\)\): a data file was changed on disk$'):
      ckpt.restore(_template(directory), 2)
    _, _, step, skipped = ckpt.restore_newest_intact(_template(directory))
  assert step == 1 and [s for s, _ in skipped] == [2]
  with open(os.path.join(directory, '1', 'extra', 'metadata')) as f:
    assert len(json.load(f)[checkpoint_values.FINGERPRINTS]) == len(jax.tree_util.tree_leaves(state))


def test_changed_data_is_named_and_the_resume_falls_back_to_the_step_before(tmp_path, finished_run, caplog):
  directory = str(tmp_path / 'checkpoints')
  shutil.copytree(finished_run / 'checkpoints', directory)
  _overwrite_data(directory, 2)
  with checkpoint.Checkpointer(directory) as ckpt:
    with pytest.raises(checkpoint.DamagedStep, match=rf'^checkpoint 2 \({directory}/2\) is damaged: {DAMAGED}$'):
      ckpt.restore(_template(directory), 2)
    state, _, step, skipped = ckpt.restore_newest_intact(_template(directory))
  assert step == 1 and [s for s, _ in skipped] == [2] and checkpoint_values.implausible_leaf(state) is None
  assert re.fullmatch(DAMAGED, skipped[0][1]), skipped
  assert any(f'checkpoint 2 ({directory}/2) is damaged: ' in r.getMessage() for r in caplog.records)


def test_no_intact_step_left_is_one_fatal_line_naming_each_step_not_a_divergence(tmp_path, finished_run):
  run_dir = tmp_path / 'run'
  shutil.copytree(finished_run, run_dir)
  directory = str(run_dir / 'checkpoints')
  for step in (1, 2):
    _overwrite_data(directory, step)
  result = subprocess.run(
      [sys.executable, '-m', 'ebrl_jax.main', *TINY, '--num_timesteps=3840', '--resume', f'--run_dir={run_dir}'],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True,
      text=True,
      timeout=300)
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2 and lines[-1].startswith('FATAL: '), result.stderr[-3000:]
  assert re.search(
      rf'{directory} holds no checkpoint that restores: .*step 2: {DAMAGED}; step 1: {DAMAGED}\)\. '
      'No older step is kept to fall back to; start a new run', lines[-1]), lines[-1]
  assert 'Traceback' not in result.stderr and 'diverged' not in result.stderr
  assert len(lines) == 4, lines  # the controller's 'Resuming ...', a warning per step, then the FATAL line


def test_a_checkpoint_fingerprinted_by_the_first_scheme_is_checked_by_it(tmp_path, finished_run):
  """Saves from before scheme 2 record no scheme: their fingerprints are scheme 1's, checked as such (intact:
  restores; step 1's data under them: damaged)."""
  directory = str(tmp_path / 'checkpoints')
  shutil.copytree(finished_run / 'checkpoints', directory)
  with checkpoint.Checkpointer(directory) as ckpt:
    state, _, _ = ckpt.restore(_template(directory), 2)
    first, _, _ = ckpt.restore(_template(directory), 1)
  for step, fingerprinted in ((2, state), (1, state)):
    name = os.path.join(directory, str(step), 'extra', 'metadata')
    with open(name) as f:
      extra = json.load(f)
    assert extra.pop(checkpoint_values.SCHEME) == 2
    extra[checkpoint_values.FINGERPRINTS] = checkpoint_values.fingerprints(fingerprinted, 1)
    with open(name, 'w') as f:
      json.dump(extra, f)
  assert checkpoint_values.fingerprints(first, 1) != checkpoint_values.fingerprints(state, 1)
  with checkpoint.Checkpointer(directory) as ckpt:
    assert ckpt.restore(_template(directory), 2)[2] == 2
    with pytest.raises(checkpoint.DamagedStep, match='its data reads back other than it was saved'):
      ckpt.restore(_template(directory), 1)
