"""A jitted program's trace kept on disk, so that a warm start skips Python tracing (issue 14, start-up).

JAX's persistent compilation cache skips XLA's compile on a warm start, but every process still traces its programs
in Python first: on the CPU, ~6 of W1's 12.4 s warm start-up were the traces of the fused chunk, the evaluation scan
and the env reset (experiments/results/startup_cache_cpu.json). `lower` keeps each program's StableHLO
(`jax.export`) under a key made of everything its trace depends on, and on a hit lowers the stored module instead of
tracing the function again; XLA then finds the executable in the compilation cache as before.

The key: the program's name and caller-given parts (the run's frozen config: the function's closure is built from
it), the arguments' tree structure, shapes and dtypes, the donated arguments, the JAX platform and the options that
change a trace (x64, matmul precision, PRNG), the versions of the libraries that shape a trace (jax, jaxlib, mujoco,
mujoco-mjx, brax, flax, optax, warp-lang, playground) and a digest of this package's own files (its code and its
MJCF assets). A program that cannot be exported (a host callback, a custom call outside jax.export's stable list, as
MuJoCo Warp's programs are: host callbacks and custom calls on its CPU kernels) is lowered as usual, and the cache
keeps the reason, so the export is tried once per key.

Arguments and results cross as flat leaves (the exported function takes and returns lists of arrays), so no pytree
node type needs JAX's serialisation registry; the result's tree structure is kept beside the module (pickled: the
directory is private, the same trust as the XLA executables JAX loads from the compilation cache).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
from importlib import metadata
import os
import pickle
from typing import Any, Callable, Optional, Sequence, Tuple

from absl import logging
import jax
import numpy as np

from ebrl_jax.runtime import storage

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = ('jax', 'jaxlib', 'mujoco', 'mujoco-mjx', 'brax', 'flax', 'optax', 'warp-lang', 'playground')
_SUFFIXES = ('.py', '.xml', '.stl', '.obj', '.png')


@dataclasses.dataclass(frozen=True)
class Stats:
  """What `lower` did for one program: 'hit' (lowered from the stored module), 'miss' (traced, then stored),
  'refused' (it cannot be exported: traced as usual) or 'off' (no cache directory)."""
  name: str
  outcome: str
  key: str


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """sha256 over this package's files (code and assets), with their paths; computed once per process."""
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(_PACKAGE_DIR)):
    dirs.sort()
    for name in sorted(files):
      if name.endswith(_SUFFIXES):
        path = os.path.join(root, name)
        h.update(os.path.relpath(path, _PACKAGE_DIR).encode())
        with open(path, 'rb') as f:
          h.update(f.read())
  return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> str:
  parts = []
  for lib in _LIBRARIES:
    try:
      parts.append(f'{lib}={metadata.version(lib)}')
    except metadata.PackageNotFoundError:
      parts.append(f'{lib}=-')
  return ','.join(parts)


def tree_digest(tree) -> str:
  """sha256 of a pytree's array leaves (bytes, shapes, dtypes) and other leaves' reprs: the constants a program
  closes over that no config names, e.g. an env's MuJoCo model loaded from a path outside this package."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, 'dtype') and hasattr(leaf, 'shape'):
      arr = np.asarray(leaf)
      h.update(repr((arr.shape, str(arr.dtype))).encode())
      h.update(arr.tobytes())
    else:
      h.update(repr(leaf).encode())
  return h.hexdigest()


def env_model_digest(env) -> str:
  """`tree_digest` of an MJX env's model (Brax's `sys`, Playground's `mjx_model`; '' where it has neither)."""
  model = getattr(env, 'sys', None)
  if model is None:
    model = getattr(env, 'mjx_model', None)
  return '' if model is None else tree_digest(model)


def _jax_settings() -> str:
  """The platform and the JAX options that change what a trace produces."""
  return repr((jax.default_backend(), jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
               jax.config.jax_default_prng_impl))


def _avals(leaves) -> list:
  return [
      jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, 'dtype') else jax.ShapeDtypeStruct((), type(x))
      for x in leaves
  ]


def program_key(name: str, key_parts: Sequence[Any], args: Tuple, donate_argnums: Sequence[int]) -> str:
  """The cache key of program `name` traced at `args` (arrays or ShapeDtypeStructs): see the module docstring."""
  leaves, tree = jax.tree.flatten(args)
  h = hashlib.sha256()
  # The tree structure by its pickle, not its text: nodes' static data (MJX's contact index arrays) print as
  # object addresses, which differ in every process. A pickle's bytes depend on which objects the tree shares, and
  # a tree that came back from this cache (`_Program`'s results) shares differently: pickled once more, both read
  # the same.
  for part in (name.encode(), repr(tuple(key_parts)).encode(), pickle.dumps(pickle.loads(pickle.dumps(tree))),
               repr([(a.shape, str(a.dtype)) for a in _avals(leaves)]).encode(), repr(tuple(donate_argnums)).encode(),
               _jax_settings().encode(), _versions().encode(), source_digest().encode()):
    h.update(hashlib.sha256(part).digest())
  return h.hexdigest()[:32]


class _Program:
  """The stored module's compiled program, called with the original pytrees (the module takes flat leaves)."""

  def __init__(self, compiled, out_tree):
    self._compiled, self._out_tree = compiled, out_tree

  def __call__(self, *args):
    return jax.tree.unflatten(self._out_tree, self._compiled(*jax.tree.leaves(args)))


class _Lowered:
  """What `jax.jit(f).lower(...)` gives, as far as callers here use it: `compile()` and `out_info`."""

  def __init__(self, lowered, out_tree):
    self._lowered, self._out_tree = lowered, out_tree

  @property
  def out_info(self):
    return jax.tree.unflatten(self._out_tree, self._lowered.out_info)

  def compile(self):
    return _Program(self._lowered.compile(), self._out_tree)


def _flat_donate(args: Tuple, donate_argnums: Sequence[int]) -> Tuple[int, ...]:
  positions, start = [], 0
  for i, arg in enumerate(args):
    n = len(jax.tree.leaves(arg))
    if i in donate_argnums:
      positions.extend(range(start, start + n))
    start += n
  return tuple(positions)


def _export(fn: Callable, args: Tuple, flat_donate: Tuple[int, ...]):
  """Traces `fn` once at `args` as a function of flat leaves; returns (Exported, the result's tree structure)."""
  leaves, in_tree = jax.tree.flatten(args)
  out_tree = []

  def flat_fn(*flat):
    out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, list(flat))))
    out_tree.append(tree)
    return out

  exported = jax.export.export(jax.jit(flat_fn, donate_argnums=flat_donate))(*_avals(leaves))
  return exported, out_tree[0]


def _read(path: str):
  try:
    with open(path, 'rb') as f:
      blob = f.read()
    tree_len = int.from_bytes(blob[:8], 'little')
    out_tree = pickle.loads(blob[8:8 + tree_len])
    return jax.export.deserialize(bytearray(blob[8 + tree_len:])), out_tree
  except Exception as e:  # a truncated or foreign file: traced again and rewritten
    logging.warning('Trace cache: %s unreadable (%s: %s); tracing again.', path, type(e).__name__, e)
    return None


def _serialize(exported, out_tree) -> bytes:
  tree = pickle.dumps(out_tree)
  return len(tree).to_bytes(8, 'little') + tree + bytes(exported.serialize())


def _write(path: str, blob: bytes) -> None:
  tmp = f'{path}.{os.getpid()}.tmp'
  try:
    with open(tmp, 'wb') as f:
      f.write(blob)
    os.replace(tmp, path)
  except OSError as e:  # a full disk costs the next start its trace, never this run
    logging.warning('Trace cache: could not write %s (%s); this program is traced again next time.', path, e)
    if os.path.exists(tmp):
      os.remove(tmp)


def lower(cache_dir: str,
          name: str,
          fn: Callable,
          args: Tuple,
          key_parts: Sequence[Any] = (),
          donate_argnums: Sequence[int] = ()) -> Tuple[Any, Stats]:
  """`jax.jit(fn, donate_argnums=...).lower(*args)`, from the stored trace when `cache_dir` holds one for this
  key; returns (the lowered program: `.compile()`, `.out_info`; its compiled program takes the same pytrees as
  `fn`, Stats). `key_parts` must name everything `fn` closes over that is not in this package's code (the config
  it was built from). `cache_dir` '' traces as usual. A program that cannot be exported is marked as such in the
  cache (`<name>-<key>.refused`, with the reason), so that later starts do not trace it twice."""
  plain = lambda outcome, key='': (jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*args),
                                   Stats(name, outcome, key))
  if not cache_dir:
    return plain('off')
  try:  # a cache that cannot be created (a read-only mount, a file in its place) costs the traces, not the run
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
  except OSError as e:
    logging.log_first_n(logging.WARNING, 'Trace cache off: %s cannot be created (%s).', 1, cache_dir, e)
    return plain('off')
  # NOTE: a directory another user owns or may write to is refused (a ValueError): its files are loaded and run.
  storage.ensure_private_dir(cache_dir, '--compilation_cache_dir', group_may_write=False)
  key = program_key(name, key_parts, args, donate_argnums)
  path = os.path.join(cache_dir, f'{name}-{key}')
  if os.path.exists(path + '.refused'):
    return plain('refused', key)
  flat_donate = _flat_donate(args, donate_argnums)
  stored = _read(path + '.bin') if os.path.exists(path + '.bin') else None
  outcome = 'hit'
  if stored is None:
    try:
      stored = _export(fn, args, flat_donate)
      blob = _serialize(*stored)
    except Exception as e:  # not exportable: a callback, an unstable custom call (MuJoCo Warp's kernels)
      reason = f'{type(e).__name__}: {e}'
      logging.info('Trace cache: %s cannot be exported, it is traced at each start (%s).', name, reason[:300])
      _write(path + '.refused', reason.encode())
      return plain('refused', key)
    _write(path + '.bin', blob)
    outcome = 'miss'
  exported, out_tree = stored
  leaves = jax.tree.leaves(args)
  lowered = jax.jit(exported.call, donate_argnums=flat_donate).lower(*_avals(leaves))
  return _Lowered(lowered, out_tree), Stats(name, outcome, key)


def lowerer(cache_dir: str) -> Optional[Callable]:
  """`lower` bound to `cache_dir`, returning the lowered program alone (None where `cache_dir` is '': callers then
  lower as usual), for stages that take a lowering function instead of importing this service."""
  if not cache_dir:
    return None

  def lower_fn(name, fn, args, key_parts=(), donate_argnums=(), env=None):
    """`env`: an MJX env `fn` closes over; its model's digest joins the key (`env_model_digest`)."""
    key_parts = tuple(key_parts) + ((env_model_digest(env),) if env is not None else ())
    lowered, stats = lower(cache_dir, name, fn, args, key_parts, donate_argnums)
    logging.info('Trace cache: %s %s.', name, stats.outcome)
    return lowered

  return lower_fn


class CachedJit:
  """`jax.jit(fn, donate_argnums=...)` whose programs are lowered through `lower` (the trace cache), one per
  signature of its arguments (tree structure, shapes, dtypes), compiled on first use, as jit would."""

  def __init__(self,
               cache_dir: str,
               name: str,
               fn: Callable,
               key_parts: Sequence[Any] = (),
               donate_argnums: Sequence[int] = ()):
    self._lower_args = (cache_dir, name, fn)
    self._key_parts, self._donate = tuple(key_parts), tuple(donate_argnums)
    self._programs = {}
    self.stats = []  # one `Stats` per signature compiled

  def __call__(self, *args):
    leaves, tree = jax.tree.flatten(args)
    signature = (tree, tuple((a.shape, str(a.dtype)) for a in _avals(leaves)))
    program = self._programs.get(signature)
    if program is None:
      lowered, stats = lower(*self._lower_args, args, self._key_parts, self._donate)
      program = self._programs[signature] = lowered.compile()
      self.stats.append(stats)
    return program(*args)


def jit(cache_dir: str, name: str, fn: Callable, key_parts: Sequence[Any] = (), donate_argnums: Sequence[int] = ()):
  """`CachedJit` where `cache_dir` is set, plain `jax.jit` where it is '' (the trace cache off)."""
  if not cache_dir:
    return jax.jit(fn, donate_argnums=tuple(donate_argnums))
  return CachedJit(cache_dir, name, fn, key_parts, donate_argnums)


def clear_memo() -> None:
  """Forgets the source digest and the library versions (tests that edit the package's files)."""
  source_digest.cache_clear()
  _versions.cache_clear()


def cache_dir_for(compilation_cache_dir: str, enabled: bool = True) -> str:
  """The trace cache inside the compilation cache, as Warp's kernel cache is; '' (off) when that is off, when not
  `enabled` (--notrace_cache) or when jax.export's serialisation is not installed (flatbuffers)."""
  if not compilation_cache_dir or not enabled:
    return ''
  if importlib.util.find_spec('flatbuffers') is None:
    logging.log_first_n(logging.WARNING, 'Trace cache off: jax.export needs the flatbuffers package.', 1)
    return ''
  return os.path.join(os.path.abspath(os.path.expanduser(compilation_cache_dir)), 'export')
