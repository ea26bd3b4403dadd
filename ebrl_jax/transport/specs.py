"""Fixed-shape record specifications: what one record of a channel holds, and where it lives in a slot.

A record is a `NamedTuple` of numpy arrays (e.g. `types.Transition`), whose fields may themselves be NamedTuples
of arrays (`types.SegmentRecord` holds a `Transition`). Its `RecordSpec` maps each leaf, by its dotted path in
field order ('transition.obs', ..., 'group'), to an `ArraySpec(shape, dtype)`. Records go in and come out as the
same classes.
"""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Dict, Iterator, Mapping, Tuple, Type

import numpy as np

ALIGN = 64  # bytes; every field and every slot starts on a cache line


def align_up(n: int, align: int = ALIGN) -> int:
  return (n + align - 1) // align * align


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """Shape and dtype of one array. A dataclass (not a NamedTuple) so that pytree utilities treat it as a leaf."""
  shape: Tuple[int, ...]
  dtype: str

  def __post_init__(self):
    object.__setattr__(self, 'shape', tuple(int(d) for d in self.shape))
    object.__setattr__(self, 'dtype', np.dtype(self.dtype).name)
    if any(d < 0 for d in self.shape):
      raise ValueError(f'ArraySpec shape {self.shape} must be non-negative.')

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

  @classmethod
  def of(cls, array: Any) -> 'ArraySpec':
    """From anything with `.shape` and `.dtype` (numpy or jax arrays, `jax.ShapeDtypeStruct`)."""
    return cls(tuple(array.shape), np.dtype(array.dtype).name)


def check_array(name: str, spec: ArraySpec, value: Any) -> np.ndarray:
  """Returns `value` as a numpy array, or raises ValueError naming the field, expected and given shape/dtype."""
  array = np.asarray(value)
  if array.shape != spec.shape or array.dtype.name != spec.dtype:
    raise ValueError(f'field {name!r}: expected shape {spec.shape} dtype {spec.dtype}, '
                     f'given shape {array.shape} dtype {array.dtype.name}.')
  return array


def _leaf_paths(record_type: Type, nested: Mapping[str, Type], prefix: str = '') -> Iterator[str]:
  for name in getattr(record_type, '_fields', ()):
    path = prefix + name
    if path in nested:
      yield from _leaf_paths(nested[path], nested, path + '.')
    else:
      yield path


class RecordSpec(collections.abc.Mapping):
  """Ordered mapping leaf path -> ArraySpec for records of one NamedTuple class, plus their slot layout.

  `nested` maps the path of each field that is itself a NamedTuple to its class (empty for a flat record).
  Layout: leaves back to back in path order, each at a 64-byte aligned offset; `nbytes` is the slot size, a
  multiple of 64.
  """

  def __init__(self, record_type: Type, fields: Mapping[str, ArraySpec], nested: Mapping[str, Type] | None = None):
    if not getattr(record_type, '_fields', ()):
      raise ValueError(f'{record_type!r} is not a NamedTuple class.')
    self.record_type = record_type
    self.nested: Dict[str, Type] = dict(nested or {})
    paths = tuple(_leaf_paths(record_type, self.nested))
    if tuple(fields) != paths:
      raise ValueError(f'fields {list(fields)} must be exactly the fields of {record_type.__name__}: {list(paths)}.')
    self._fields: Dict[str, ArraySpec] = {
        k: (v if isinstance(v, ArraySpec) else ArraySpec(*v)) for k, v in fields.items()
    }
    offsets, offset = {}, 0
    for name, spec in self._fields.items():
      offsets[name] = offset
      offset = align_up(offset + spec.nbytes)
    self.offsets: Dict[str, int] = offsets
    self.nbytes: int = max(align_up(offset), ALIGN)

  def __getitem__(self, name: str) -> ArraySpec:
    return self._fields[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._fields)

  def __len__(self) -> int:
    return len(self._fields)

  def __eq__(self, other) -> bool:
    return (isinstance(other, RecordSpec) and self.record_type is other.record_type and
            self._fields == other._fields and self.nested == other.nested)

  def __hash__(self):
    return hash((self.record_type, tuple(self._fields.items()), tuple(self.nested.items())))

  def __repr__(self) -> str:
    inner = ', '.join(f'{k}={v.shape}:{v.dtype}' for k, v in self._fields.items())
    return f'RecordSpec({self.record_type.__name__}: {inner})'

  def __reduce__(self):
    return (RecordSpec, (self.record_type, self._fields, self.nested))

  def _flatten(self, record: Any, record_type: Type, prefix: str, out: list) -> None:
    given = tuple(getattr(record, '_fields', ()))
    expected = tuple(record_type._fields)
    if given != expected:
      missing = [f for f in expected if f not in given]
      extra = [f for f in given if f not in expected]
      where = f' at {prefix[:-1]!r}' if prefix else ''
      raise ValueError(f'record {type(record).__name__}{where} has fields {list(given)}; expected '
                       f'{record_type.__name__} fields {list(expected)} (missing {missing}, extra {extra}).')
    for name, value in zip(expected, record):
      path = prefix + name
      if path in self.nested:
        self._flatten(value, self.nested[path], path + '.', out)
      else:
        out.append(check_array(path, self._fields[path], value))

  def check(self, record: Any) -> Tuple[np.ndarray, ...]:
    """Validates a record against the spec; returns its leaves as numpy arrays, in path order.

    Raises ValueError naming the field with expected vs given shape/dtype, or the missing/extra field names.
    """
    out: list = []
    self._flatten(record, self.record_type, '', out)
    return tuple(out)

  def build(self, leaves) -> Any:
    """The record (nested NamedTuples included) whose leaves, in path order, are `leaves`."""
    it = iter(leaves)

    def make(record_type: Type, prefix: str):
      return record_type(*(make(self.nested[prefix + n], prefix + n + '.') if prefix + n in self.nested else next(it)
                           for n in record_type._fields))

    return make(self.record_type, '')

  def zeros(self) -> Any:
    """A record of zeros (handy as a template and in tests)."""
    return self.build(np.zeros(s.shape, s.dtype) for s in self._fields.values())


def record_spec(record_type: Type,
                shapes: Mapping[str, Any],
                dtypes: Mapping[str, Any] | None = None,
                default_dtype: str = 'float32') -> RecordSpec:
  """RecordSpec from a NamedTuple class and per-field shapes.

  `shapes[name]` is a shape tuple or an `ArraySpec`; dtypes default to `default_dtype` unless given in `dtypes`
  (or carried by an ArraySpec). Example: `record_spec(types.Transition, {'obs': (T, B, O), ...},
  dtypes={'policy_version': 'int32'})`.
  """
  names = tuple(getattr(record_type, '_fields', ()))
  unknown = [k for k in list(shapes) + list(dtypes or {}) if k not in names]
  missing = [k for k in names if k not in shapes]
  if unknown or missing:
    raise ValueError(f'record_spec({getattr(record_type, "__name__", record_type)}): unknown fields {unknown}, '
                     f'missing shapes for {missing}; fields are {list(names)}.')
  fields = {}
  for name in names:
    shape = shapes[name]
    if isinstance(shape, ArraySpec):
      fields[name] = shape
    else:
      fields[name] = ArraySpec(tuple(shape), (dtypes or {}).get(name, default_dtype))
  return RecordSpec(record_type, fields)


def spec_of(example: Any) -> RecordSpec:
  """RecordSpec of an example record: a NamedTuple whose leaves have a shape and dtype (numpy or jax arrays,
  `jax.ShapeDtypeStruct`s), with NamedTuple fields nested at any depth. Same classes, shapes and dtypes."""
  if not getattr(example, '_fields', None):
    raise ValueError(f'spec_of needs a NamedTuple of arrays, got {type(example).__name__}.')
  fields: Dict[str, ArraySpec] = {}
  nested: Dict[str, Type] = {}

  def walk(record: Any, prefix: str) -> None:
    for name, value in zip(record._fields, record):
      path = prefix + name
      if getattr(value, '_fields', None):
        nested[path] = type(value)
        walk(value, path + '.')
      else:
        fields[path] = ArraySpec.of(value if hasattr(value, 'dtype') else np.asarray(value))

  walk(example, '')
  return RecordSpec(type(example), fields, nested)
