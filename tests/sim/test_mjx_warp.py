"""--backend=mjx_warp: MJX's Warp implementation under the project's Brax envs (`make_mjx_env(..., impl='warp')`).

On a machine without a CUDA GPU (CI) only the clear error, the backend plumbing, the Warp-aware env selection and
the once-per-process overflow report are tested; the physics tests need a CUDA GPU with warp-lang (or warp-lang
and EBRL_WARP_ALLOW_CPU=1, Warp's slow CPU kernels) and are skipped otherwise.
"""
import importlib.util
import logging
import os

import flax
import jax
import numpy as np
import pytest
from jax import numpy as jnp

from ebrl_jax import config
from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import stages
from ebrl_jax.sim import warp as warp_lib


def _has_cuda():
  try:
    return bool(jax.devices('cuda'))
  except RuntimeError:
    return False


HAS_WARP = importlib.util.find_spec('warp') is not None
CAN_RUN = HAS_WARP and (_has_cuda() or os.environ.get('EBRL_WARP_ALLOW_CPU') == '1')
needs_warp_device = pytest.mark.skipif(
    not CAN_RUN,
    reason='MJX-Warp physics needs warp-lang and a CUDA GPU (or EBRL_WARP_ALLOW_CPU=1 for Warp\'s '
    'CPU kernels); this machine has ' + ('no CUDA GPU' if HAS_WARP else 'no warp-lang'))


def test_backend_name_and_impl():
  assert 'mjx_warp' in config.BACKENDS
  assert config.SimConfig(backend='mjx_warp').backend == 'mjx_warp'
  assert mjx_env.impl_for_backend('mjx') == 'jax'
  assert mjx_env.impl_for_backend('mjx_warp') == 'warp'
  with pytest.raises(ValueError, match='mujoco_cpu'):
    mjx_env.impl_for_backend('mujoco_cpu')


def test_unknown_impl_is_refused():
  with pytest.raises(ValueError, match="impl='cpp'.*jax, warp"):
    mjx_env.make_mjx_env('inverted_pendulum', 10, 1, True, impl='cpp')


@pytest.mark.skipif(_has_cuda(), reason='checks the error on a machine without a CUDA GPU')
def test_warp_without_gpu_names_the_flag(monkeypatch):
  monkeypatch.delenv('EBRL_WARP_ALLOW_CPU', raising=False)
  with pytest.raises(warp_lib.WarpUnavailableError) as info:
    mjx_env.make_mjx_env('hopper', 1000, 1, True, impl='warp')
  msg = str(info.value)
  assert '--backend=mjx_warp' in msg and 'CUDA GPU' in msg and '--backend=mjx' in msg
  if not HAS_WARP:
    assert "pip install 'ebrl_jax[warp]'" in msg and 'warp-lang' in msg and 'mujoco-mjx[warp]==3.17.0' in msg
  # Not memoised as a failure: the same call raises again (and would build the env once a GPU is there).
  with pytest.raises(warp_lib.WarpUnavailableError):
    mjx_env.make_mjx_env('hopper', 1000, 1, True, impl='warp')


def test_missing_warp_names_the_extra(monkeypatch):
  monkeypatch.setattr(warp_lib, 'warp_installed', lambda: False)
  monkeypatch.setenv('EBRL_WARP_ALLOW_CPU', '1')  # so that only the missing package is reported
  with pytest.raises(warp_lib.WarpUnavailableError, match=r"--backend=mjx_warp.*warp-lang.*ebrl_jax\[warp\]"):
    warp_lib.check_available()


@flax.struct.dataclass
class _FakeWarpData:
  qpos: jax.Array  # [B, 3]: one row per env
  contact__pos: jax.Array  # [C, 3]: shared by all envs
  naconmax: int = flax.struct.field(pytree_node=False, default=5)


def test_where_envs_keeps_leaves_without_env_axis(monkeypatch):
  monkeypatch.setattr(mjx_env, '_warp_non_vmap', lambda: (_FakeWarpData, frozenset({'contact__pos', 'naconmax'})))
  b, c = 4, 5  # C != B; with C == B a plain where would silently mix contact rows of different envs
  x = {'d': _FakeWarpData(jnp.zeros((b, 3)), jnp.zeros((c, 3))), 'obs': jnp.zeros((b, 2))}
  y = {'d': _FakeWarpData(jnp.ones((b, 3)), jnp.ones((c, 3))), 'obs': jnp.ones((b, 2))}
  mask = jnp.array([True, False, True, False])
  out = jax.jit(mjx_env.where_envs)(mask, x, y)
  np.testing.assert_array_equal(out['d'].qpos[:, 0], [0, 1, 0, 1])
  np.testing.assert_array_equal(out['obs'][:, 0], [0, 1, 0, 1])
  np.testing.assert_array_equal(out['d'].contact__pos, np.ones((c, 3)))  # y's (the newer state's) buffer
  assert out['d'].naconmax == 5


def test_overflow_is_reported_once_per_kind(caplog):
  warp_lib.reset_reported()
  with caplog.at_level(logging.WARNING, logger='ebrl_jax.sim.warp'):
    warp_lib._report_bits(np.int32(0))  # pylint: disable=protected-access
    for _ in range(3):
      warp_lib._report_bits(np.int32(1 << 9))  # pylint: disable=protected-access
    warp_lib._report_bits(np.int32((1 << 9) | (1 << 0)))  # pylint: disable=protected-access
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 2, messages
  assert 'ITERATIONS' in messages[0] and 'once' in messages[0]
  assert 'NEFC' in messages[1] and 'EBRL_WARP_NJMAX' in messages[1]
  warp_lib.reset_reported()


def test_report_mode(monkeypatch):
  monkeypatch.delenv('EBRL_WARP_OVERFLOW_CALLBACK', raising=False)
  assert warp_lib._report_mode() == 'reset'  # pylint: disable=protected-access
  assert warp_lib._report_mode(True) == 'step' and warp_lib._report_mode(False) == 'off'  # pylint: disable=protected-access
  for value, mode in (('0', 'off'), ('1', 'step'), ('step', 'step'), ('off', 'off')):
    monkeypatch.setenv('EBRL_WARP_OVERFLOW_CALLBACK', value)
    assert warp_lib._report_mode() == mode  # pylint: disable=protected-access
  monkeypatch.setenv('EBRL_WARP_OVERFLOW_CALLBACK', 'often')
  with pytest.raises(ValueError, match='EBRL_WARP_OVERFLOW_CALLBACK'):
    warp_lib._report_mode()  # pylint: disable=protected-access


def test_silenced_bits_are_mujoco_warps():
  assert warp_lib.SILENCED_BITS == (1 << 9) | (1 << 10)
  if HAS_WARP:
    from mujoco.mjx.third_party.mujoco_warp._src import types as mjwp_types  # pylint: disable=import-outside-toplevel
    assert warp_lib.SILENCED_BITS == mjwp_types.OverflowType.ITERATIONS | mjwp_types.OverflowType.LS_ITERATIONS
    for bit, (name, _) in warp_lib.OVERFLOW_BITS.items():
      assert getattr(mjwp_types.OverflowType, name) == bit


# --------------------------------------------------------------------------------------------------------------
# Physics (CUDA GPU with warp-lang; or EBRL_WARP_ALLOW_CPU=1).


@needs_warp_device
def test_warp_env_is_memoised_and_silences_iteration_prints():
  env = stages.make_mjx_env('hopper', 20, 1, True, impl='warp')
  assert stages.make_mjx_env('hopper', 20, 1, True, 'warp') is env
  assert stages.make_mjx_env('hopper', 20, 1, auto_reset=True, impl='warp') is env
  assert stages.make_mjx_env('hopper', 20, 1) is not env
  assert mjx_env.env_impl(env) == 'warp' and mjx_env.is_auto_reset(env)
  sys = env.unwrapped.sys
  assert str(sys.impl).endswith('WARP')
  assert not sys.opt._impl.warn_overflow & warp_lib.SILENCED_BITS  # pylint: disable=protected-access
  assert env.env.env.report_overflow in ('reset', 'off')  # WhereAutoReset -> Episode -> WarpVmapWrapper


def _run_hopper(impl, auto_reset, num_envs, group, steps):
  """obs [T+1, B, O], reward, done [T, B], step_chunk's reward and final obs."""
  env = stages.make_mjx_env('hopper', 8, 1, auto_reset, impl)
  state = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(3), num_envs, group)
  step = jax.jit(stages.step, static_argnums=0)
  acts = jax.random.uniform(jax.random.PRNGKey(4), (steps, num_envs, env.action_size), minval=-1, maxval=1)
  obs, rew, done = [state.brax_state.obs], [], []
  for a in acts:
    state, res = step(env, state, a)
    obs.append(res.obs)
    rew.append(res.reward)
    done.append(res.done)
  chunk_state, chunk = jax.jit(stages.step_chunk,
                               static_argnums=0)(env, jax.jit(stages.reset,
                                                              static_argnums=(0, 2, 3))(env, jax.random.PRNGKey(3),
                                                                                        num_envs, group),
                                                 jnp.swapaxes(acts[:5], 0, 1))
  return [
      np.asarray(x) for x in (jnp.stack(obs), jnp.stack(rew), jnp.stack(done), chunk.reward, chunk_state.brax_state.obs)
  ]


@needs_warp_device
@pytest.mark.parametrize('auto_reset', [True, False])
def test_warp_matches_jax_with_group_resets(auto_reset):
  num_envs, group, steps = 4, 2, 12
  outs = {}
  # Full float32 matmuls for MJX-JAX (on a GPU XLA's default may use TF32); MuJoCo Warp's kernels are float32.
  with jax.default_matmul_precision('highest'):
    for impl in ('jax', 'warp'):
      outs[impl] = _run_hopper(impl, auto_reset, num_envs, group, steps)
  o_jax, o_warp = outs['jax'], outs['warp']
  np.testing.assert_array_equal(o_warp[0][0, 0], o_warp[0][0, 1])  # a group shares its initial state
  np.testing.assert_array_equal(o_warp[2], o_jax[2])  # episodes end at the same steps (episode_length=8)
  assert o_warp[2].sum() > 0
  for a, b in zip(o_jax, o_warp):
    np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-3)
