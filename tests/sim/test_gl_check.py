"""MUJOCO_GL naming a GL library this machine lacks: a clear error before `import mujoco`, not a crash inside it."""
import ctypes.util
import os
import subprocess
import sys

import pytest

from ebrl_jax.sim import gl_check


def _missing(path):
  raise OSError(f'{path}: cannot open shared object file')


@pytest.mark.parametrize('value,library', [('egl', 'libEGL.so.1'), ('OSMesa', 'libOSMesa.so.8')])
def test_missing_library_is_named_with_the_variable(value, library):
  with pytest.raises(gl_check.MujocoGLError, match=f'MUJOCO_GL={value.lower()}: its library {library}') as err:
    gl_check.check_mujoco_gl({'MUJOCO_GL': value}, find=lambda name: None, load=_missing)
  assert 'apt ' in str(err.value) and isinstance(err.value, ImportError)


def test_found_library_unset_or_other_backend_pass():
  loaded = []
  gl_check.check_mujoco_gl({'MUJOCO_GL': 'egl'}, find=lambda name: f'/lib/lib{name}.so.1', load=loaded.append)
  assert loaded == ['/lib/libEGL.so.1']
  for environ in ({}, {'MUJOCO_GL': 'glfw'}):
    gl_check.check_mujoco_gl(environ, find=lambda name: None, load=_missing)  # MuJoCo's business: no check


@pytest.mark.skipif(ctypes.util.find_library('OSMesa') is not None, reason='this machine has OSMesa')
def test_a_real_import_with_a_missing_backend_says_so():
  env = dict(os.environ, MUJOCO_GL='osmesa')
  proc = subprocess.run([sys.executable, '-c', 'import ebrl_jax.sim.cpu_env'],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=False,
                        timeout=120)
  assert proc.returncode != 0
  assert 'MujocoGLError: MUJOCO_GL=osmesa: its library libOSMesa.so.8 cannot be loaded' in proc.stderr
