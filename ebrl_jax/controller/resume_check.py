"""The run directory's checkpoints against --resume, before any worker starts: read as plain JSON (no orbax, nothing
changed), with a refusal that names the flag behind a train state that does not fit (a checkpoint's arrays are
carried over as saved: its optimizer state too, whose layout gradient clipping and a learning-rate schedule shape),
and what to change after training diverged that --resume then accepts. What the layout does not show (--task
among tasks of the same sizes, --algo, --normalize_observations) is compared with the checkpoint's metadata; where
that predates --normalize_observations, with its observation statistics' count (one scalar, read by tensorstore)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Optional, Set, Tuple

from absl import logging
import jax
import numpy as np
import tensorstore as ts

from ebrl_jax import config as config_lib
from ebrl_jax import config_generation
from ebrl_jax.runtime import storage
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import checkpoint_values
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import stages as trainer_stages

# Parts of the train state that a flag adds: a checkpoint with them fits only a run with that flag, and back.
STATE_FLAGS = {'value_stats': '--value_norm_rate'}


def _checkpoint_state(directory: str) -> str:
  """What `directory` holds, in words, truthfully: its newest intact step, or why none is loadable."""
  damaged = [(s, checkpoint.damage(directory, s)) for s in checkpoint.committed_steps(directory)]
  intact = [s for s, why in damaged if why is None]
  if intact:
    return f'the newest intact one is step {intact[0]}'
  return 'none of them is loadable: ' + '; '.join(f'step {s}: {why}' for s, why in damaged)


def check_checkpoints(cfg: config_lib.Config) -> Optional[dict]:
  """The run directory's checkpoints against --resume, read without orbax and without changing anything: a new
  run refuses a directory that holds checkpoints; --resume needs an intact one whose arrays fit this run's train
  state. Returns what --resume continues from ({'step', 'env_steps', 'iterations', 'skipped'}), else None."""
  run_dir = cfg.schedule.run_dir
  directory = os.path.join(os.path.abspath(run_dir), 'checkpoints')
  steps = checkpoint.committed_steps(directory)
  if not cfg.schedule.resume:
    if steps:  # (with --checkpoint_every=0 too: this run would write its files beside that run's checkpoints)
      raise ValueError(f'--run_dir={run_dir} already holds checkpoints; pass --resume to continue that run '
                       f'({_checkpoint_state(directory)}) or choose another --run_dir.')
    return None
  if not steps:
    raise ValueError(f'--resume was given but {directory} holds no checkpoint, so there is nothing to resume; '
                     'start without --resume, or point --run_dir at the run to continue.')
  skipped = []
  for step in steps:
    why = checkpoint.damage(directory, step)
    if why is None:
      break
    skipped.append(step)
    logging.warning('checkpoint %d (%s) is damaged: %s; --resume falls back to an older step.', step,
                    os.path.join(directory, str(step)), why)
  else:
    raise ValueError(f'--resume: {directory} holds checkpoints, but {_checkpoint_state(directory)}. Start a new '
                     'run (without --resume) in another --run_dir.')
  mismatch = _mismatch(directory, step, state_template(cfg))
  if mismatch is not None:
    hints = [
        f'{field} is {flag}\'s state, set in one run and not the other' for field, flag in STATE_FLAGS.items()
        if f'{field}.' in mismatch
    ]
    if 'opt_state.' in mismatch:
      hints += [optimizer_change(cfg, directory, step) or _OPTIMIZER_FLAGS]
    by = written_by(cfg, step)
    by = by and f' it was written {by} and'
    raise ValueError(
        f'--resume: checkpoint {step} in {directory} is intact, but{by} it does not fit this run\'s train state: '
        f'{mismatch}{"".join(f" ({h})" for h in hints)}. It stays loadable by a run with its own flags: resume '
        'with those, or choose another --run_dir for this run.')
  refused = run_change(cfg, directory, step)
  if refused is not None:
    raise ValueError(refused)
  extra = checkpoint.read_extra(directory, step)
  return {'step': step, 'env_steps': extra.get('env_steps'), 'iterations': extra.get('iterations'), 'skipped': skipped}


def run_change(cfg: config_lib.Config, directory: str, step: int) -> Optional[str]:
  """Why step `step` cannot go on in this run although its arrays fit: the metadata the driver saved with it names
  another --task (of the same sizes), --algo or --normalize_observations, none of which the train state's layout
  shows. None when they agree; a checkpoint whose metadata predates a field is unknown there, one warning (where
  it predates --normalize_observations, its observation statistics' count says, as the trainer reads it)."""
  run = checkpoint.read_extra(directory, step).get('run') or {}
  where, mine = f'--resume: checkpoint {step} in {directory}', cfg.algo.name
  if run.get('task', cfg.sim.task) != cfg.sim.task:
    return (f'{where} was written for --task={run["task"]} (this run: --task={cfg.sim.task}), whose observations '
            'and actions have this one\'s sizes: --resume continues a run on its own task. Resume with '
            f'--task={run["task"]}, or start a new run in another --run_dir.')
  if run.get('algo', mine) != mine:
    return (f'{where} was written by a run with --algo={run["algo"]} (this run: --algo={mine}): its policy and '
            f'optimizer state were trained with {run["algo"]}\'s loss, and --resume continues a run with its own '
            f'algorithm. Resume with --algo={run["algo"]}, or start a new run in another --run_dir.')
  normalise, change = cfg.policy.normalize_observations, None
  known = run.get('normalize_observations') is not None
  if known:
    change = checkpoint_values.normalization_words(bool(run['normalize_observations']), normalise,
                                                   'its metadata records it')
  else:  # a checkpoint from before the record: its statistics' count says (as the trainer reads it)
    seen = read_scalar(directory, step, ('params', 'normalizer', 'count'))
    known = seen is not None and seen >= 0
    change = checkpoint_values.count_change(seen, normalise) if known else None
  if change is not None:
    return f'{where} {change}, or start a new run in another --run_dir.'
  unknown = ['--algo'] if 'algo' not in run else []
  unknown += ['--normalize_observations'] if not known else []
  if unknown:
    logging.warning(
        'checkpoint %d in %s records no %s (it predates that record), so --resume cannot check that '
        'this run\'s match the run that wrote it.', step, directory, ' or '.join(unknown))
  return None


def read_scalar(directory: str, step: int, path: Tuple[str, ...]) -> Optional[float]:
  """The value of step `step`'s scalar array at `path` (('params', 'normalizer', 'count')), read with tensorstore
  alone (orbax's storage; no orbax, no JAX backend, which starts only once the checks passed); None when it cannot
  be read or is not finite."""
  kvstore = {'driver': 'ocdbt', 'base': f'file://{os.path.join(directory, str(step), "state")}/'}
  for driver in ('zarr', 'zarr3'):  # orbax's array format: zarr (0.12), zarr3 (newer)
    try:
      array = ts.open({'driver': driver, 'kvstore': dict(kvstore, path='.'.join(path) + '/')}, open=True).result()
      value = float(np.asarray(array.read().result()).reshape(()))
    except Exception:  # pylint: disable=broad-except  (tensorstore raises ValueError and others; a damaged file)
      continue
    return value if np.isfinite(value) else None
  return None


def state_template(cfg: config_lib.Config):
  """The shapes of this run's train state (`jax.eval_shape`: nothing computed, no JAX backend started)."""
  spec, network, optimizer = driver.network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  return jax.eval_shape(lambda: trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(
      0), spec.obs_dim, cfg.policy.normalize_observations, spec.pixel_shape, cfg.algo.value_norm_rate is not None))


def _node_paths(template) -> Set[Tuple[str, ...]]:
  """The paths of `template`'s leaves and of its empty nodes (optax's EmptyState, a None), as orbax names them in
  a step's metadata (tuple indices, field and dict keys)."""
  empty = lambda x: x is None or (isinstance(x, (tuple, list, dict)) and not x)
  name = lambda k: str(next(getattr(k, a) for a in ('key', 'name', 'idx') if hasattr(k, a)))
  return {tuple(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(template, is_leaf=empty)[0]}


def _mismatch(directory: str, step: int, template) -> Optional[str]:
  """`checkpoint.shape_mismatch`, and beside the arrays the tree's empty nodes: optax's stateless parts (gradient
  clipping of one scope or the other) hold no array, yet a restore into another layout fails (orbax: 'tree
  structures do not match'), which the trainer took for a damaged step."""
  mismatch = checkpoint.shape_mismatch(directory, step, template)
  if mismatch is not None:
    return mismatch
  try:
    with open(os.path.join(directory, str(step), 'state', '_METADATA')) as f:
      saved = {tuple(str(k['key']) for k in e['key_metadata']) for e in json.load(f)['tree_metadata'].values()}
  except (OSError, ValueError, KeyError, TypeError):
    return None  # shape_mismatch read it: a layout it cannot say more of
  wanted = _node_paths(template)
  diffs = [f'{".".join(p)} only in this run' for p in sorted(wanted - saved)]
  diffs += [f'{".".join(p)} only in the checkpoint' for p in sorted(saved - wanted)]
  if not diffs:
    return None
  return f'{len(diffs)} empty nodes of the tree differ ({"; ".join(diffs[:3])}{" and more" if len(diffs) > 3 else ""})'


_OPTIMIZER_FLAGS = ('opt_state is the optimizer\'s state, whose layout --max_grad_norm, --grad_clip_scope, '
                    '--learning_rate_end and --learning_rate_warmup_updates shape')


def _optimizer_variants(algo: config_lib.AlgoConfig) -> Iterator[Tuple[str, str, dict]]:
  """(the checkpoint's setting, this run's, the AlgoConfig fields of a run with the checkpoint's) for each change of
  the flags that shape the optimizer state's layout: gradient clipping on or off or its scope, a learning-rate
  schedule on or off, and clipping with a schedule. Their values (the norm, the rates) shape nothing."""
  if algo.max_grad_norm is None:
    clip = [('--max_grad_norm set', '--max_grad_norm unset', dict(max_grad_norm=1.0)),
            ('--max_grad_norm set with --grad_clip_scope=per_network', '--max_grad_norm unset',
             dict(max_grad_norm=1.0, grad_clip_scope='per_network'))]
  else:
    other = 'global' if algo.grad_clip_scope == 'per_network' else 'per_network'
    clip = [('--max_grad_norm unset', f'--max_grad_norm={algo.max_grad_norm:g}',
             dict(max_grad_norm=None, grad_clip_scope='global')),
            (f'--grad_clip_scope={other}', f'--grad_clip_scope={algo.grad_clip_scope}', dict(grad_clip_scope=other))]
  scheduled = [f'--learning_rate_end={algo.learning_rate_end:g}'] if algo.learning_rate_end is not None else []
  if algo.learning_rate_warmup_updates:
    scheduled.append(f'--learning_rate_warmup_updates={algo.learning_rate_warmup_updates}')
  if scheduled:
    rate = [('a constant learning rate', ' '.join(scheduled),
             dict(learning_rate_end=None, learning_rate_warmup_updates=0))]
  else:
    rate = [('a learning-rate schedule (--learning_rate_end or --learning_rate_warmup_updates)',
             'a constant learning rate', dict(learning_rate_warmup_updates=1))]
  yield from clip + rate
  for theirs, mine, fields in clip:
    for rate_theirs, rate_mine, rate_fields in rate:
      yield f'{theirs} and {rate_theirs}', f'{mine}, {rate_mine}', {**fields, **rate_fields}


def optimizer_change(cfg: config_lib.Config, directory: str, step: int) -> Optional[str]:
  """Which optimizer flag makes this run's optimizer state differ from step `step`'s, in words ('the checkpoint's
  optimizer state is that of a run with --max_grad_norm unset (this run: --max_grad_norm=0.5)...'): the first
  change of `_optimizer_variants` whose train state fits the step. None when none does."""
  for theirs, mine, fields in _optimizer_variants(cfg.algo):
    try:
      variant = state_template(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, **fields)))
    except ValueError:  # a combination this run's networks cannot have (per_network clipping of a shared critic)
      continue
    if _mismatch(directory, step, variant) is None:
      return (f'the checkpoint\'s optimizer state is that of a run with {theirs} (this run: {mine}); gradient '
              'clipping and a learning-rate schedule shape the optimizer state, which --resume carries over as '
              'saved')
  return None


def _saved_run(cfg: config_lib.Config, step: int) -> Optional[dict]:
  """{'task', 'policy'[, 'critic']} of the run that wrote `step`: its metadata, else the run dir's config.json
  (written by the last run that started there), else None."""
  run = checkpoint.read_extra(os.path.join(cfg.schedule.run_dir, 'checkpoints'), step).get('run')
  if run is not None:
    return run
  try:
    with open(os.path.join(cfg.schedule.run_dir, 'config.json')) as f:
      saved = json.load(f)
    return {'task': saved['sim']['task'], 'policy': saved['policy']['kind']}
  except (OSError, ValueError, KeyError, TypeError):
    return None


def written_by(cfg: config_lib.Config, step: int) -> str:
  """'for --task=... --policy=... (this run: ...)' of the run that wrote `step` ('by another run' when unknown), with
  its critic where that differs; '' where its task, policy and critic are this run's (the words would say
  nothing)."""
  critic = config_generation.critic_of(cfg.policy, cfg.sim.obs == 'pixels')
  run = _saved_run(cfg, step)
  if run is None:
    return 'by another run'
  theirs = run.get('critic') or ('shared (checkpoints from before --critic)' if run.get('policy') != 'mlp' else critic)
  if (run.get('task'), run.get('policy'), theirs) == (cfg.sim.task, cfg.policy.kind, critic):
    return ''
  text = (f'for --task={run.get("task")} --policy={run.get("policy")} (this run: --task={cfg.sim.task} '
          f'--policy={cfg.policy.kind})')
  return text if theirs == critic else f'{text} with --critic={theirs} (this run: {critic})'


def divergence_advice(cfg: config_lib.Config) -> str:
  """What to change after training diverged, and how to go on, in words that hold: --resume carries the optimizer
  state over as saved, so a lower --learning_rate (or --max_grad_norm, where the run clips already) continues the
  run, while clipping added to a run without it is a new run."""
  run_dir = cfg.schedule.run_dir
  if cfg.algo.max_grad_norm is not None:
    return storage.checkpoint_advice(run_dir, 'lower --learning_rate or --max_grad_norm')
  if storage.latest_checkpoint_step(os.path.join(run_dir, 'checkpoints')) is None:
    return storage.checkpoint_advice(run_dir, 'lower --learning_rate or set --max_grad_norm')
  return storage.checkpoint_advice(run_dir, 'lower --learning_rate') + (
      ' Gradient clipping (--max_grad_norm) changes the optimizer state\'s layout, which --resume carries over as '
      'saved: a run with it starts afresh, in another --run_dir.')
