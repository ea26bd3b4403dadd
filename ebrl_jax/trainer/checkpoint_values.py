"""What a restored checkpoint step is checked for, and the error a restore raises for a step whose data does not
read back whole (`DamagedStep`). Orbax keeps no checksum of the data: bytes changed in a data file either fail
zstd's decoding or decode without error into other values, mostly NaN or values with random exponents (17 of 19
places of 256 0xFF bytes in a pendulum run's largest data file; the other two decoded to values within the arrays'
own range). A saved state is finite (a run that diverges saves no checkpoint): `implausible_leaf` finds most such
values by themselves, and the fingerprints the save records beside the data (`fingerprints`, one 32-bit word per
array, computed on the device) find the rest: `changed_leaf` names an array whose values differ from those saved."""
import functools
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np


class DamagedStep(ValueError):
  """A committed step whose arrays do not read back whole; `reason` says why, `step` and `path` which one."""

  def __init__(self, step: int, path: str, reason: str):
    super().__init__(f'checkpoint {step} ({path}) is damaged: {reason}')
    self.step, self.path, self.reason = step, path, reason


# Beyond any value a run keeps (Adam's moments, the normaliser's summed variance over 1e10 steps of observations
# near 1e2 is ~1e14; a run whose values grow near this diverged and saved nothing): zstd decodes a byte flipped
# inside a compressed block without error, into values with random exponents (1e38 in Adam's nu in the test).
IMPLAUSIBLE = 1e30


def implausible_leaf(state) -> Optional[str]:
  """The first float leaf of `state` (tree order: params, the optimizer state, ...) holding a value that is NaN,
  infinite or beyond +-`IMPLAUSIBLE`, as 'path: n of m values are ...', or None when every float value is finite
  and within it."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    with np.errstate(invalid='ignore'):  # a signalling NaN (0xFF bytes) warns as it is cast
      magnitudes = np.abs(np.asarray(jax.device_get(leaf), np.float64))
    bad = int(magnitudes.size - np.count_nonzero(magnitudes <= IMPLAUSIBLE))  # NaN compares False
    if bad:
      name = jax.tree_util.keystr(path, simple=True, separator='.')
      return f'{name}: {bad} of {magnitudes.size} values are NaN, infinite or beyond +-{IMPLAUSIBLE:g}'
  return None


FINGERPRINTS = 'fingerprints'  # the key of a save's metadata (`extra`) that holds them
SCHEME = 'fingerprint_scheme'  # and how they were computed (absent: 1, the first saves' linear sum)


def _words(leaf):
  """A leaf's bits as a flat uint32 vector (typed PRNG keys: their key data; 1- and 2-byte types widened)."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  size = leaf.dtype.itemsize
  if size in (1, 2):
    as_uint = jnp.uint8 if size == 1 else jnp.uint16
    leaf = leaf.astype(jnp.uint8) if leaf.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(leaf, as_uint)
    return leaf.astype(jnp.uint32).reshape(-1)
  return jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)  # 8-byte types: two words each


def _mixed(words, position):
  """Scheme 2: each word XOR a hash of its position, through MurmurHash3's 32-bit finaliser: for a fixed position a
  bijection of the word (so any one changed word changes the sum), and non-linear, so the changes of a swap do
  not cancel as they could under scheme 1's odd weights (+1.0 and -1.0 differ by 2**31, whose multiples by two
  odd weights agree mod 2**32)."""
  x = words ^ (position * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15))
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnums=1)
def _fingerprint_words(leaves, scheme: int):
  """One word per leaf: the sum (mod 2**32) of its words, mixed with their positions (`_mixed`; scheme 1, of saves
  made before scheme 2: each word times an odd weight drawn from its position)."""
  out = []
  for leaf in leaves:
    words = _words(leaf)
    position = jnp.arange(words.shape[0], dtype=jnp.uint32)
    if scheme == 1:
      words = words * ((position * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1))
    else:
      words = _mixed(words, position)
    out.append(jnp.sum(words, dtype=jnp.uint32))
  return out


def fingerprints(state, scheme: int = 2) -> Dict[str, int]:
  """{array path: its 32-bit fingerprint} of a state (host or device arrays), for a save's metadata."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  values = jax.device_get(_fingerprint_words([jnp.asarray(leaf) for _, leaf in flat], scheme))
  return {jax.tree_util.keystr(p, simple=True, separator='.'): int(v) for (p, _), v in zip(flat, values)}


def changed_leaf(state, saved: Optional[Dict[str, int]], scheme: int = 2) -> Optional[str]:
  """The first array of a restored `state` whose fingerprint differs from the one its save recorded (`saved`, by
  `scheme`; None or {}: a checkpoint from before fingerprints were recorded, unchecked), as 'path: ...', else
  None."""
  if not saved:
    return None
  for name, value in fingerprints(state, scheme).items():
    if name in saved and saved[name] != value:
      return f'{name}: its values differ from those saved (fingerprint {value:#010x}, saved {saved[name]:#010x})'
  return None


def root_cause(e: BaseException) -> str:
  """The innermost exception's first line (tensorstore's names the file and the array; orbax's wrapper prints a
  whole TensorStore spec)."""
  seen = []
  while e is not None and e not in seen:
    seen.append(e)
    e = e.__cause__ or e.__context__
  text = str(seen[-1]).strip()
  return f'{type(seen[-1]).__name__}: {text.splitlines()[0][:300] if text else ""}'


def normalization_words(normalised: bool, normalise: bool, evidence: str) -> Optional[str]:
  """Why a checkpoint written by a run that did (`normalised`) or did not normalise its observations cannot go on
  in a run that does (`normalise`) or does not, ending in the flag to resume with; None when they agree.
  `evidence`: how the checkpoint says so (its statistics, its metadata)."""
  if normalise and not normalised:
    return (f'was written by a run with --nonormalize_observations ({evidence}), and this run normalises: its '
            'policy learned from raw observations. Resume with --nonormalize_observations')
  if normalised and not normalise:
    return (f'was written by a run that normalised its observations ({evidence}), and this run has '
            '--nonormalize_observations: its policy would see raw observations. Resume without '
            '--nonormalize_observations')
  return None


def normalization_change(restored, template) -> Optional[str]:
  """Why `restored` (a checkpoint's TrainState) cannot go on under `template`'s observation normalisation, or None.
  The flag is static (not saved in the state: the restore takes the template's), but a run that normalises moves
  its statistics every iteration, so a checkpoint's count says which run wrote it: > 0 one that normalised, 0 one
  that did not. (The controller checks the flag the checkpoint's metadata records before any worker starts; this
  guards a driver run on its own and checkpoints from before the metadata recorded it.)"""
  seen = float(np.asarray(jax.device_get(restored.params.normalizer.count)))
  return count_change(seen, bool(template.params.normalize_observations))


def count_change(seen: float, normalise: bool) -> Optional[str]:
  """`normalization_words` for a checkpoint whose observation statistics have seen `seen` observations (> 0: a run
  that normalised wrote it; 0: one that did not), resumed by a run that does (`normalise`) or does not."""
  evidence = f'its statistics have seen {seen:.0f}' if seen else 'its observation statistics are empty'
  return normalization_words(bool(seen), normalise, evidence)
