"""Checkpoints of `TrainState` plus JSON metadata, on orbax-checkpoint's `CheckpointManager`.

NOTE: saves are atomic. Orbax writes step N into `N.orbax-checkpoint-tmp*` and renames it to `N` only after
every item is written (and a commit marker is present), so a crash or an exception mid-save leaves the earlier
steps loadable; leftover temporary directories are ignored and cleaned up when a `Checkpointer` opens the
directory.

  ckpt = Checkpointer('runs/x/checkpoints')
  ckpt.save(step, state, {'env_steps': 1_000_000})
  state, extra, step = ckpt.restore(template_state)   # template: a freshly initialised TrainState
  ckpt.close()

A step can still be damaged after its commit (a file truncated or deleted by hand, a disk error). `damage` and
`shape_mismatch` read a step's metadata files as plain JSON, without orbax and without changing anything (the
controller checks a run's checkpoints with them before any worker starts), and `restore_newest_intact` falls
back from a damaged step to the newest intact one, naming each step it skipped by path and why. A data file
changed on disk shows only when it is read: `restore` raises `DamagedStep` when orbax cannot decode it, when a
value comes back NaN, infinite or implausibly large, or when an array's fingerprint differs from the one its save
recorded in the step's metadata (`checkpoint_values`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from ebrl_jax.trainer.checkpoint_values import (FINGERPRINTS, SCHEME, DamagedStep, changed_leaf, fingerprints,
                                                implausible_leaf, normalization_change, root_cause)
from ebrl_jax.trainer.stages import TrainState

_ITEMS = ('state', 'extra')
_LOG = logging.getLogger(__name__)  # not absl's: a stage module; absl's handler shows it where one is installed
# The files of a committed step that a restore reads as JSON (orbax 0.12's layout), and the one it opens first.
_JSON_FILES = ('extra/metadata', 'state/_METADATA')
_REQUIRED_FILES = ('state/manifest.ocdbt',)
DAMAGED_SUFFIX = '.damaged'  # a damaged step a resumed run moved aside: kept for the user, invisible to orbax


def committed_steps(directory: str) -> List[int]:
  """The step directories in `directory`, newest first (orbax names them by step; temporary ones are not digits)."""
  try:
    return sorted((int(d) for d in os.listdir(directory) if d.isdigit()), reverse=True)
  except OSError:
    return []


def damage(directory: str, step: int) -> Optional[str]:
  """Why step `step` in `directory` cannot be restored (a metadata file missing or not whole), or None when its
  files look whole. Reads only; a truncated data file shows only when the restore reads it."""
  step_dir = os.path.join(directory, str(step))
  for rel in _JSON_FILES + _REQUIRED_FILES:
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      return f'{path} is missing'
    if rel in _JSON_FILES:
      try:
        with open(path) as f:
          json.load(f)
      except (OSError, ValueError) as e:
        return f'{path} is not whole ({e})'
  return _ocdbt_damage(os.path.join(step_dir, 'state'))


_OCDBT_MAGIC = b'\x0c\xdb\x3a\x2a'


def _ocdbt_damage(state_dir: str) -> Optional[str]:
  """Damage the restore would find only while reading, where it aborts with tensorstore callbacks printing
  'Event loop is closed' tracebacks (the fault suite's truncated-checkpoint trials): an OCDBT manifest shorter than
  its header or than the length its header states (magic, then the file's length as a little-endian u64), or an
  array-metadata file that is empty or cut short of its JSON. Files of another layout are left to the restore."""
  for base, _, names in os.walk(state_dir):
    for name in names:
      path = os.path.join(base, name)
      try:
        with open(path, 'rb') as f:
          head = f.read() if os.path.basename(base) == 'array_metadatas' else f.read(12)
        size = os.path.getsize(path)
      except OSError as e:
        return f'{path} cannot be read ({e})'
      if name == 'manifest.ocdbt':
        if size < 12:
          return f'{path} is not whole ({size} bytes, shorter than its header)'
        stated = int.from_bytes(head[4:12], 'little')
        if head[:4] == _OCDBT_MAGIC and stated != size:
          return f'{path} is not whole ({size} of the {stated} bytes its header states)'
      elif os.path.basename(base) == 'array_metadatas':
        if not head.strip():
          return f'{path} is empty'
        if head.lstrip()[:1] == b'{':
          try:
            json.loads(head)
          except ValueError as e:
            return f'{path} is not whole ({e})'
  return None


def read_extra(directory: str, step: int) -> Dict[str, Any]:
  """The JSON metadata saved with step `step` ({} when it cannot be read)."""
  try:
    with open(os.path.join(directory, str(step), 'extra', 'metadata')) as f:
      return dict(json.load(f))
  except (OSError, ValueError, TypeError):
    return {}


def _key_name(key) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _template_shapes(template) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(template)[0]
  return {tuple(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def _saved_shapes(directory: str, step: int) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
  with open(os.path.join(directory, str(step), 'state', '_METADATA')) as f:
    tree = json.load(f)['tree_metadata']
  out = {}
  for entry in tree.values():
    value = entry.get('value_metadata') or {}
    shape = value.get('write_shape')
    if shape is not None or value.get('value_type') == 'np.ndarray':  # an empty node (optax's EmptyState) holds
      # no array; a numpy one (saved by rank 0 of several, see `Checkpointer.save`) records no shape: None
      out[tuple(str(k['key']) for k in entry['key_metadata'])] = None if shape is None else tuple(shape)
  return out


def shape_mismatch(directory: str, step: int, template) -> Optional[str]:
  """How step `step`'s arrays differ from `template`'s (a TrainState or its `jax.eval_shape`), at most three of
  them named, or None when every array has the template's path and shape. Reads only the step's metadata."""
  try:
    saved = _saved_shapes(directory, step)
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f'its array metadata cannot be read ({e})'
  wanted = _template_shapes(template)
  show = lambda path: '.'.join(path)
  diffs = [
      f'{show(p)}: {saved[p]} there, {wanted[p]} here' for p in wanted
      if saved.get(p) is not None and saved[p] != wanted[p]
  ]
  diffs += [f'{show(p)} only in this run' for p in wanted if p not in saved]
  diffs += [f'{show(p)} only in the checkpoint' for p in saved if p not in wanted]
  if not diffs:
    return None
  more = f' and {len(diffs) - 3} more' if len(diffs) > 3 else ''
  return f'{len(diffs)} arrays differ ({"; ".join(diffs[:3])}{more})'


def _this_process_only(ranks: int) -> Dict[str, Any]:
  """Each process saves and restores on its own: with data-parallel trainer ranks only rank 0 saves (every rank
  holds the same state) and every rank restores, so no save waits on the other ranks."""
  if ranks == 1:
    return {}
  me = jax.process_index()
  return {'multiprocessing_options': ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})}


class Checkpointer:
  """Keeps the newest `max_to_keep` checkpoints of a TrainState in `directory`.

  With `async_save=False` (default) `save` returns once the checkpoint is committed. With `async_save=True`
  it returns after the device-to-host copy and the write finishes in the background; the next `save`,
  `restore`, `wait` or `close` waits for it (and raises any error it hit).
  """

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = False):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self._async_save = async_save
    ranks = jax.process_count()
    if ranks > 1:  # orbax creates the root only when every process takes part
      os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           create=ranks == 1,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True,
                                           **_this_process_only(ranks))
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def save(self, step: int, state: TrainState, extra: Optional[Dict[str, Any]] = None) -> None:
    """Saves `state` and JSON-able `extra` (e.g. env_steps, the config as a dict) as checkpoint `step`."""
    extra = dict(extra or {})
    try:
      json.dumps(extra)
    except TypeError as e:
      raise ValueError(f'Checkpoint metadata `extra` must be JSON-serialisable: {e}') from e
    extra[FINGERPRINTS], extra[SCHEME] = fingerprints(state), 2  # what `restore` checks the data against
    self._manager.wait_until_finished()  # one save in flight at most; surfaces a failed async save
    threads_before = set(threading.enumerate())
    if jax.process_count() > 1:  # a rank's arrays are local to it; orbax saves only global ones or numpy
      state = jax.device_get(state)
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
    structure, dtypes and placement (e.g. a freshly initialised TrainState). Raises `DamagedStep` when the
    step's data does not read back (orbax fails, a value comes back NaN, infinite or implausibly large:
    `checkpoint_values.implausible_leaf`, or an array differs from its saved fingerprint: `changed_leaf`). The
    returned `extra` is what `save` was given."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f'No checkpoint in {self.directory} (no committed step directory found).')
    elif step not in self.all_steps():
      raise FileNotFoundError(f'No checkpoint for step {step} in {self.directory}; have {list(self.all_steps())}.')
    multi = jax.process_count() > 1  # as in `save`: numpy in, then onto this rank's device
    template = jax.device_get(template_state) if multi else template_state
    path = os.path.join(self.directory, str(step))
    try:
      restored = self._manager.restore(int(step),
                                       args=ocp.args.Composite(state=ocp.args.StandardRestore(template),
                                                               extra=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore raise many kinds)
      raise DamagedStep(step, path, f'its data does not read back ({root_cause(e)})') from e
    bad = implausible_leaf(restored.state)
    if bad is not None:
      raise DamagedStep(step, path,
                        f'its data reads back with values no run saves ({bad}): a data file was changed on disk')
    extra = dict(restored.extra or {})
    changed = changed_leaf(restored.state, extra.pop(FINGERPRINTS, None), extra.pop(SCHEME, 1))
    if changed is not None:
      raise DamagedStep(step, path, f'its data reads back other than it was saved ({changed}): a data file was '
                        'changed on disk')
    state = jax.device_put(restored.state) if multi else restored.state
    return state, extra, int(step)

  def restore_newest_intact(self, template_state: TrainState):
    """Restores the newest step that restores whole, skipping (with a warning naming its path and why) every
    newer one that is damaged; the skipped steps are then moved aside (`<step>.damaged`, kept for the user) so
    that this run's own saves and retention never meet them. Returns (state, extra, step, skipped: [(step,
    reason)]). Raises ValueError when the newest intact step's arrays do not fit `template_state` (another
    task or policy), FileNotFoundError when no step is intact."""
    skipped: List[Tuple[int, str]] = []
    for step in committed_steps(self.directory):
      reason = damage(self.directory, step)
      if reason is None:
        mismatch = shape_mismatch(self.directory, step, template_state)
        if mismatch is not None:
          raise ValueError(f'--resume: checkpoint {step} in {self.directory} does not fit this run\'s train state: '
                           f'{mismatch}. Resume with the flags it was written with, or choose another --run_dir.')
        try:
          restored = self.restore(template_state, step)
        except DamagedStep as e:
          reason = e.reason
        except FileNotFoundError as e:  # a step directory orbax does not list as a checkpoint
          reason = f'its data does not read back ({root_cause(e)})'  # one line: orbax's text holds a whole spec
        else:
          self._move_aside(skipped)
          return restored + (skipped,)
      _LOG.warning('checkpoint %d (%s) is damaged: %s; trying the next older step.', step,
                   os.path.join(self.directory, str(step)), reason)
      skipped.append((step, reason))
    listed = '; '.join(f'step {s}: {r}' for s, r in skipped) or 'none'
    raise FileNotFoundError(f'No intact checkpoint in {self.directory} (damaged: {listed}).')

  def _move_aside(self, skipped: List[Tuple[int, str]]) -> None:
    for step, _ in skipped:
      path = os.path.join(self.directory, str(step))
      try:
        os.replace(path, f'{path}{DAMAGED_SUFFIX}-{int(time.time())}')
      except OSError as e:
        _LOG.warning('could not move the damaged checkpoint %s aside: %s', path, e)
    if skipped:
      self._manager.reload()

  def close(self) -> None:
    """Waits for in-flight saves, then releases orbax's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def open_and_resume(run_dir: str, schedule, template_state: TrainState, async_save: bool = False):
  """A run's start, by its `config.ScheduleConfig`: (checkpointer or None, train_state, None) for a fresh run, or
  (checkpointer, the state of the newest intact checkpoint, {'step', 'env_steps', 'iterations', 'schedule',
  'skipped_damaged'}) with --resume. The controller checked the directory before anything started; these errors
  guard a driver run on its own. `async_save`: saves write in the background (the overlap schedule)."""
  checkpointer = None
  if schedule.checkpoint_every or schedule.resume:
    checkpointer = Checkpointer(os.path.join(os.path.abspath(run_dir), 'checkpoints'), async_save=async_save)
  state, resumed = _resume(checkpointer, template_state, schedule.resume, run_dir, schedule.name)
  return checkpointer, state, resumed


def _resume(checkpointer: Optional[Checkpointer], template_state: TrainState, resume_run: bool, run_dir: str,
            schedule: str):
  if not resume_run:
    if checkpointer is not None and checkpointer.latest_step() is not None:
      raise ValueError(f'--run_dir={run_dir} already holds checkpoints; pass --resume to continue that run or '
                       'choose another --run_dir.')
    return template_state, None
  try:
    state, extra, step, skipped = checkpointer.restore_newest_intact(template_state)
  except FileNotFoundError as e:
    raise ValueError(
        f'--resume was given but {run_dir}/checkpoints holds no checkpoint that restores: {str(e).rstrip(".")}. No older '
        'step is kept to fall back to; start a new run (without --resume) in another --run_dir.') from None
  change = normalization_change(state, template_state)
  if change is not None:
    raise ValueError(f'--resume: checkpoint {step} in {run_dir}/checkpoints {change}, or start a new run in another '
                     '--run_dir.')
  # A fallback is a warning, so that a trainer worker (its INFO lines are not shown) names the step it restored too.
  log = _LOG.warning if skipped else _LOG.info
  past = f' (past damaged step(s) {[s for s, _ in skipped]})' if skipped else ''
  log('Resumed from checkpoint %d%s: env step %d (iteration %d) of a %s run.', step, past, extra['env_steps'],
      extra['iterations'], extra.get('schedule', '?'))
  if extra.get('schedule') not in (None, schedule):
    _LOG.warning('The checkpoint was written by --schedule=%s; continuing with --schedule=%s.', extra['schedule'],
                 schedule)
  return state, {
      'step': step,
      'env_steps': int(extra['env_steps']),
      'iterations': int(extra['iterations']),
      'schedule': extra.get('schedule'),
      'skipped_damaged': [s for s, _ in skipped]
  }
