"""Checkpoints of `TrainState` plus JSON metadata, on orbax-checkpoint's `CheckpointManager`.

NOTE: saves are atomic. Orbax writes step N into `N.orbax-checkpoint-tmp*` and renames it to `N` only after
every item is written (and a commit marker is present), so a crash or an exception mid-save leaves the earlier
steps loadable; leftover temporary directories are ignored and cleaned up when a `Checkpointer` opens the
directory.

  ckpt = Checkpointer('runs/x/checkpoints')
  ckpt.save(step, state, {'env_steps': 1_000_000})
  state, extra, step = ckpt.restore(template_state)   # template: a freshly initialised TrainState
  ckpt.close()
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, Optional, Tuple

import orbax.checkpoint as ocp

from ebrl_jax.trainer.stages import TrainState

_ITEMS = ('state', 'extra')


class Checkpointer:
  """Keeps the newest `max_to_keep` checkpoints of a TrainState in `directory`.

  With `async_save=False` (default) `save` returns once the checkpoint is committed. With `async_save=True`
  it returns after the device-to-host copy and the write finishes in the background; the next `save`,
  `restore`, `wait` or `close` waits for it (and raises any error it hit).
  """

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = False):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self._async_save = async_save
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           create=True,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def save(self, step: int, state: TrainState, extra: Optional[Dict[str, Any]] = None) -> None:
    """Saves `state` and JSON-able `extra` (e.g. env_steps, the config as a dict) as checkpoint `step`."""
    extra = dict(extra or {})
    try:
      json.dumps(extra)
    except TypeError as e:
      raise ValueError(f'Checkpoint metadata `extra` must be JSON-serialisable: {e}') from e
    self._manager.wait_until_finished()  # one save in flight at most; surfaces a failed async save
    threads_before = set(threading.enumerate())
    try:
      saved = self._manager.save(int(step),
                                 args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         extra=ocp.args.JsonSave(extra)),
                                 force=True)
      if not self._async_save:
        self._manager.wait_until_finished()
    except BaseException:
      self._drain(threads_before)
      raise
    if not saved:
      raise RuntimeError(f'orbax declined to save step {step} in {self.directory}.')

  def _drain(self, threads_before, timeout_s: float = 60.0) -> None:
    """After a failed save, waits (bounded) for the writer threads orbax started for it.

    NOTE: orbax re-raises the first failing item while its other writers still run; were they left running,
    a later save or a `Checkpointer` reopening the directory (which deletes stale temporary directories)
    would race with them.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      pending = [
          t for t in set(threading.enumerate()) - threads_before
          if t is not threading.current_thread() and (t.is_alive() or t.ident is None)
      ]
      if not pending:
        return
      for thread in pending:
        try:
          thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
        except RuntimeError:  # not started yet
          time.sleep(0.01)

  def wait(self) -> None:
    """Blocks until any in-flight save is committed."""
    self._manager.wait_until_finished()

  def latest_step(self) -> Optional[int]:
    """Newest committed step, or None when the directory holds no checkpoint."""
    self._manager.wait_until_finished()
    self._manager.reload()  # another process may have saved since we opened the directory
    return self._manager.latest_step()

  def all_steps(self) -> Tuple[int, ...]:
    self._manager.wait_until_finished()
    self._manager.reload()
    return tuple(self._manager.all_steps())

  def restore(self, template_state: TrainState, step: Optional[int] = None) -> Tuple[TrainState, Dict[str, Any], int]:
    """Restores (state, extra, step); `step=None` takes the newest. `template_state` fixes the pytree
    structure, dtypes and placement (e.g. a freshly initialised TrainState)."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f'No checkpoint in {self.directory} (no committed step directory found).')
    elif step not in self.all_steps():
      raise FileNotFoundError(f'No checkpoint for step {step} in {self.directory}; have {list(self.all_steps())}.')
    restored = self._manager.restore(int(step),
                                     args=ocp.args.Composite(state=ocp.args.StandardRestore(template_state),
                                                             extra=ocp.args.JsonRestore()))
    return restored.state, dict(restored.extra or {}), int(step)

  def close(self) -> None:
    """Waits for in-flight saves, then releases orbax's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
