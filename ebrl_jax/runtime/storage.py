"""A full disk among the errors of the run's writers and of the libraries under them, and the atomic JSON write.

Our own writes fail with `OSError(ENOSPC)`; orbax-checkpoint and tensorstore wrap the OS error in their own
exception types where only its text survives, so both the error codes and the texts are recognised, along the
exception's cause/context chain.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from typing import Any, Optional

_CODES = {errno.ENOSPC: 'No space left on device', errno.EDQUOT: 'Disk quota exceeded'}
_TEXTS = (*_CODES.values(), f"os_error_code='{errno.ENOSPC}'")  # the last: tensorstore's words for ENOSPC


def disk_full(exc: Optional[BaseException]) -> Optional[str]:
  """What is full when `exc`, or an exception it came from, is a full disk or an exceeded quota (the OS text and,
  where known, the file); None for any other error."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _CODES:
      return (exc.strerror or _CODES[exc.errno]) + (f': {exc.filename}' if exc.filename else '')
    text = str(exc)
    for marker in _TEXTS:
      if marker in text:
        line = next((l for l in text.splitlines() if marker in l), marker).strip()
        return line if len(line) <= 300 else line[:297] + '...'
    exc = exc.__cause__ or exc.__context__
  return None


def write_json(path: str, data: Any, **dump_kwargs) -> None:
  """Writes `data` as JSON so that a reader sees the old file or the new one, never half of one: a temporary file
  beside it (named by this process), then os.replace. The OSError of a failed write (a full disk) is raised, and
  the temporary file does not stay behind."""
  tmp = f'{path}.{os.getpid()}.tmp'
  try:
    if os.path.lexists(tmp):  # left by a crash, or planted: removed, never written through
      os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, 'w') as f:
      json.dump(data, f, **dump_kwargs)
    os.replace(tmp, path)  # NOTE: a rename replaces a symlink at `path` itself; it never writes through it
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def latest_checkpoint_step(checkpoint_dir: str) -> Optional[int]:
  """The newest committed step directory in `checkpoint_dir` (orbax names them by step; temporary ones are not
  digits), without opening orbax: usable from a controller whose worker wrote them. None when there is none."""
  try:
    steps = [int(d) for d in os.listdir(checkpoint_dir) if d.isdigit()]
  except OSError:
    return None
  return max(steps) if steps else None


def resume_advice(run_dir: str) -> str:
  """What the user can do after the disk filled: which checkpoint stays loadable, and how to continue."""
  checkpoints = os.path.join(run_dir, 'checkpoints')
  step = latest_checkpoint_step(checkpoints)
  if step is None:
    return (f'no checkpoint had been written in {checkpoints} (see --checkpoint_every), so there is nothing to '
            'resume: free space and start again.')
  return (f'checkpoint {step} in {checkpoints} is intact and loadable (saves are atomic): free space, then '
          'continue with --resume.')


def checkpoint_advice(run_dir: str, fix: str = '') -> str:
  """The truth about what a stopped run can continue from: its newest committed checkpoint and `--resume` (after
  `fix`, e.g. 'start MPS again'), or that none had been written yet, so there is nothing to resume."""
  checkpoints = os.path.join(run_dir, 'checkpoints')
  step = latest_checkpoint_step(checkpoints)
  then = f'{fix}, then ' if fix else ''
  if step is None:
    return (f'No checkpoint had been written in {checkpoints} yet (see --first_checkpoint_iteration), so there is '
            f'nothing to resume: {then}start the run again.')
  return f'Its checkpoint {step} in {checkpoints} stays loadable: {then}continue with --resume.'


def ensure_private_dir(path: str, flag: str = '--run_dir', group_may_write: bool = True) -> None:
  """Creates `path` for this user only (0700) or checks an existing one: refused (a ValueError naming `flag`) when
  another user owns it, or when every user (or, with `group_may_write` False, the group) may write to it without
  the sticky bit: another user could plant files or symlinks the run would then write through or load."""
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
  except OSError as e:
    raise ValueError(f'{flag}={path} cannot be created: {e}') from None
  if st.st_uid != os.geteuid():
    raise ValueError(f'{flag}={path} belongs to another user (uid {st.st_uid}); choose a directory of your own.')
  others = stat.S_IWOTH | (0 if group_may_write else stat.S_IWGRP)
  if st.st_mode & others and not st.st_mode & stat.S_ISVTX:
    raise ValueError(f'{flag}={path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); '
                     f'`chmod go-w {path}` or choose another directory.')


def open_append(path: str):
  """`path` opened for appending lines (line-buffered, 0600 when new), refusing to follow a symbolic link."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise ValueError(f'{path} is a symbolic link; the run writes no file through one.') from None
    raise
  return os.fdopen(fd, 'a', buffering=1)


def lock_run_dir(run_dir: str) -> int:
  """Holds the existing --run_dir for this process's run: an exclusive `flock` on the directory itself (no file is
  written, so a full disk or a listing sees nothing of it; the kernel drops it when the process ends). A second
  run started there meanwhile is refused (ValueError) before it writes anything, where it would have replaced the
  first one's files and orbax would have deleted its checkpoints. Returns the directory's descriptor: closing it
  (`os.close`) releases the directory."""
  fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise ValueError(f'--run_dir={run_dir} is in use by a run that is still going (it holds the directory\'s '
                     'lock); wait for it to end, or choose another --run_dir.') from None
  return fd
