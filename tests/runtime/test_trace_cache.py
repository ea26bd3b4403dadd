"""The trace cache (ebrl_jax/runtime/trace_cache.py): a stored program gives what tracing gives, keys separate what
differs, unexportable programs and damaged files fall back to tracing, and a warm MJX fused run traces nothing."""
import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ebrl_jax import controller
from ebrl_jax.runtime import trace_cache
from tests import runs_testlib


class Carry(NamedTuple):
  x: jax.Array
  stats: dict


def _step(scale, carry, key):
  """A small program with a pytree in and out, randomness and a Python-side constant (`scale`)."""
  noise = jax.random.normal(key, carry.x.shape)
  x = carry.x * scale + noise
  return Carry(x, {'sum': carry.stats['sum'] + x.sum(), 'n': carry.stats['n'] + 1}), {'mean': x.mean()}


def _args():
  return (Carry(jnp.arange(6.0).reshape(2, 3), {
      'sum': jnp.zeros(()),
      'n': jnp.zeros((), jnp.int32)
  }), jax.random.PRNGKey(3))


def _run(cache_dir, scale=2.0, key_parts=(2.0,), args=None):
  args = args or _args()
  lowered, stats = trace_cache.lower(str(cache_dir), 'step', lambda c, k: _step(scale, c, k), args, key_parts)
  return lowered, lowered.compile()(*args), stats


def test_stored_program_gives_what_tracing_gives(tmp_path):
  expected = jax.jit(lambda c, k: _step(2.0, c, k))(*_args())
  lowered, first, stats1 = _run(tmp_path)
  _, second, stats2 = _run(tmp_path)
  assert (stats1.outcome, stats2.outcome) == ('miss', 'hit') and stats1.key == stats2.key
  for out in (first, second):
    assert jax.tree.structure(out) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert jax.tree.structure(lowered.out_info) == jax.tree.structure(expected)
  assert os.listdir(tmp_path) == [f'step-{stats1.key}.bin']


def test_key_separates_config_shapes_and_code(tmp_path, monkeypatch):
  _, _, base = _run(tmp_path)
  # The closure's constant differs: the caller names it in key_parts, and the stored 2.0 is not reused.
  _, out, other = _run(tmp_path, scale=3.0, key_parts=(3.0,))
  assert other.outcome == 'miss' and other.key != base.key
  want = jax.jit(lambda c, k: _step(3.0, c, k))(*_args())
  np.testing.assert_array_equal(np.asarray(out[1]['mean']), np.asarray(want[1]['mean']))
  carry, key = _args()
  _, _, shaped = _run(tmp_path, args=(carry._replace(x=jnp.zeros((4, 3))), key))
  assert shaped.outcome == 'miss' and shaped.key not in (base.key, other.key)
  # Another version of a library that shapes traces changes every key.
  trace_cache.clear_memo()
  monkeypatch.setattr(trace_cache, '_versions', lambda: 'jax=another')
  assert trace_cache.program_key('step', (2.0,), _args(), ()) != base.key
  monkeypatch.undo()
  trace_cache.clear_memo()


def test_unexportable_program_is_traced_and_marked(tmp_path):
  calls = []

  def fn(x):
    return jax.pure_callback(lambda v: calls.append(1) or np.asarray(v) + 1, jax.ShapeDtypeStruct((3,), jnp.float32), x)

  x = jnp.ones(3)
  lowered, stats = trace_cache.lower(str(tmp_path), 'callback', fn, (x,))
  assert stats.outcome == 'refused'
  np.testing.assert_array_equal(np.asarray(lowered.compile()(x)), np.full(3, 2.0))
  assert calls
  marker = tmp_path / f'callback-{stats.key}.refused'
  assert 'callback' in marker.read_text().lower()
  _, again = trace_cache.lower(str(tmp_path), 'callback', fn, (x,))
  assert again.outcome == 'refused'


def test_damaged_file_is_traced_again_and_rewritten(tmp_path):
  _, _, stats = _run(tmp_path)
  path = tmp_path / f'step-{stats.key}.bin'
  path.write_bytes(path.read_bytes()[:40])
  _, out, again = _run(tmp_path)
  assert again.outcome == 'miss'
  assert float(out[1]['mean']) == float(jax.jit(lambda c, k: _step(2.0, c, k))(*_args())[1]['mean'])
  assert _run(tmp_path)[2].outcome == 'hit'


def test_a_cache_that_cannot_be_created_is_off_and_the_program_still_runs(tmp_path):
  blocker = tmp_path / 'xla'
  blocker.write_text('a file where the cache would go')
  _, out, stats = _run(blocker / 'export')
  assert stats.outcome == 'off' and int(out[0].stats['n']) == 1


def test_a_cache_others_may_write_is_refused(tmp_path):
  """Its files would be loaded and run: refused with the flag's name, as the XLA cache is."""
  cache = tmp_path / 'export'
  cache.mkdir()
  os.chmod(cache, 0o777)
  with pytest.raises(ValueError, match='--compilation_cache_dir=.*writable by other users'):
    _run(cache)


def test_off_without_a_directory():
  _, out, stats = _run('')
  assert stats.outcome == 'off' and int(out[0].stats['n']) == 1


def _mjx_curves(tmp_path, runs):
  """Evaluation curves of tiny fused MJX runs, one per (name, cache_dir) of `runs` in order, and the stamps of the
  trace files the first run wrote."""
  before = jax.config.jax_compilation_cache_dir
  curves, stamps = [], None
  try:
    for name, cache_dir in runs:
      cfg = runs_testlib.tiny_mjx_config(tmp_path / name, num_timesteps=8 * 4 * 2 * 3, num_evals=2)
      cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, compilation_cache_dir=cache_dir))
      curves.append([(p['env_steps'], p['return']) for p in controller.run(cfg).eval_curve])
      if stamps is None and cache_dir:
        export = os.path.join(cache_dir, 'export')
        stamps = {n: os.stat(os.path.join(export, n)).st_mtime_ns for n in os.listdir(export)}
  finally:  # the rest of this test process compiles without it
    jax.config.update('jax_compilation_cache_dir', before)
  return curves, stamps


def test_warm_mjx_fused_run_reuses_its_traces_and_learns_the_same(tmp_path):
  """Two fused MJX runs on one compilation cache: the second lowers the chunk, the evaluation scan, the reset and
  the train state's init from the stored traces (no new key: still one file each), and its evaluation curve equals
  the first's."""
  cache = tmp_path / 'xla'
  curves, stamps = _mjx_curves(tmp_path, (('cold', str(cache)), ('warm', str(cache))))
  assert sorted(n.split('-')[0] for n in stamps) == ['fused_chunk', 'init_train_state', 'mjx_eval', 'mjx_reset'], stamps
  assert {n: os.stat(cache / 'export' / n).st_mtime_ns for n in os.listdir(cache / 'export')} == stamps
  assert curves[0] == curves[1], curves


def test_exported_mjx_programs_learn_as_the_traced_ones(tmp_path):
  """A run through the stored traces (a cold cache stores, then runs the exported module) and a run without any
  cache give one evaluation curve (opt-in: a third MJX compile; test_stored_program_gives_what_tracing_gives stays in CI)."""
  curves, _ = _mjx_curves(tmp_path, (('cold', str(tmp_path / 'xla')), ('none', '')))
  assert curves[0] == curves[1], curves


def test_model_digest_follows_the_models_arrays():
  """A model loaded from outside the package (a user's MJCF, Playground's assets) reaches the key by its arrays."""

  class Env(NamedTuple):
    sys: dict

  base = Env({'body_mass': np.ones(3, np.float32), 'opt': {'timestep': np.float32(0.01)}})
  same = Env({'body_mass': np.ones(3, np.float32), 'opt': {'timestep': np.float32(0.01)}})
  heavier = Env({'body_mass': np.full(3, 2.0, np.float32), 'opt': {'timestep': np.float32(0.01)}})
  assert trace_cache.env_model_digest(base) == trace_cache.env_model_digest(same)
  assert trace_cache.env_model_digest(base) != trace_cache.env_model_digest(heavier)
  assert trace_cache.env_model_digest(object()) == ''
