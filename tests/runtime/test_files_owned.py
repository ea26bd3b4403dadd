"""Run files are the user's own (issue 17, defect 5): directories are created 0700 and refused when another user
owns them or may write to them; no write follows a planted symbolic link; a compilation cache others can write to
is refused (JAX would load and run what it finds there)."""
import os
import stat

import pytest

from ebrl_jax.runtime import metrics
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage


def test_a_new_run_dir_is_private_and_an_open_one_is_refused(tmp_path):
  run_dir = tmp_path / 'run'
  storage.ensure_private_dir(str(run_dir))
  assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
  open_dir = tmp_path / 'open'
  open_dir.mkdir()
  os.chmod(open_dir, 0o777)  # every user may write: a planted symlink would be followed
  with pytest.raises(ValueError, match=r'--run_dir=.*open is writable by other users \(mode 777\); `chmod go-w'):
    storage.ensure_private_dir(str(open_dir))
  os.chmod(open_dir, 0o1777)  # the sticky bit: others cannot replace what this user creates there (like /tmp)
  storage.ensure_private_dir(str(open_dir))
  group = tmp_path / 'group'
  group.mkdir()
  os.chmod(group, 0o770)
  storage.ensure_private_dir(str(group))  # a run dir may be shared with the group
  with pytest.raises(ValueError, match='--compilation_cache_dir=.*group is writable by other users'):
    storage.ensure_private_dir(str(group), '--compilation_cache_dir', group_may_write=False)


@pytest.mark.skipif(os.geteuid() != 0, reason='giving a directory to another user needs root')
def test_a_run_dir_of_another_user_is_refused(tmp_path):
  theirs = tmp_path / 'theirs'
  theirs.mkdir()
  os.chown(theirs, 4242, 4242)
  with pytest.raises(ValueError, match=r'--run_dir=.*theirs belongs to another user \(uid 4242\)'):
    storage.ensure_private_dir(str(theirs))


def test_json_writes_never_go_through_a_planted_symlink(tmp_path):
  target = tmp_path / 'victim.txt'
  target.write_text('keep me')
  summary = tmp_path / 'summary.json'
  os.symlink(target, f'{summary}.{os.getpid()}.tmp')  # planted at the temporary name
  storage.write_json(str(summary), {'a': 1})
  assert summary.read_text() == '{"a": 1}' and target.read_text() == 'keep me'
  os.remove(summary)
  os.symlink(target, summary)  # planted at the final name: the rename replaces the link, not its target
  storage.write_json(str(summary), {'b': 2})
  assert not os.path.islink(summary) and target.read_text() == 'keep me'
  assert stat.S_IMODE(os.stat(summary).st_mode) == 0o600


def test_metrics_refuse_a_symlinked_log(tmp_path):
  target = tmp_path / 'victim.txt'
  target.write_text('keep me')
  os.symlink(target, tmp_path / 'metrics.jsonl')
  with pytest.raises(ValueError, match='metrics.jsonl is a symbolic link'):
    metrics.MetricsLogger(str(tmp_path), 10, progress_bar=False)
  assert target.read_text() == 'keep me'


def test_a_compilation_cache_others_can_write_is_refused(tmp_path, monkeypatch):
  cache = tmp_path / 'xla'
  cache.mkdir()
  os.chmod(cache, 0o777)
  with pytest.raises(ValueError, match=r'--compilation_cache_dir=.*xla is writable by other users'):
    startup.configure_jax('', str(cache))
  os.chmod(cache, 0o700)
  import jax  # pylint: disable=g-import-not-at-top
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  monkeypatch.delenv('WARP_CACHE_PATH', raising=False)
  try:
    startup.configure_jax('', str(cache))  # its own: accepted, with Warp's kernel cache inside it
    assert jax.config.jax_compilation_cache_dir == str(cache)
    assert os.environ['WARP_CACHE_PATH'] == str(cache / startup.WARP_CACHE_SUBDIR)
    monkeypatch.setenv('WARP_CACHE_PATH', str(tmp_path / 'mine'))
    startup.configure_jax('', str(cache))  # a user's own WARP_CACHE_PATH is kept
    assert os.environ['WARP_CACHE_PATH'] == str(tmp_path / 'mine')
  finally:  # the rest of this test process compiles without it
    jax.config.update('jax_compilation_cache_dir', before[0])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', before[1])
