"""MUJOCO_GL checked before `mujoco` is imported.

MuJoCo loads its headless GL backend from MUJOCO_GL when `mujoco` is first imported: with MUJOCO_GL=egl or
=osmesa and that library missing, the import dies inside PyOpenGL with an AttributeError on `None` that names
neither the variable nor the library (seen on the GPU machine here: `'NoneType' object has no attribute
'eglQueryString'`). Importing this module checks (`ebrl_jax.sim` imports it first), so the error names both and
what to install.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Mapping

# MUJOCO_GL value -> (the shared library PyOpenGL loads, its file name, what provides it)
_LIBRARIES = {
    'egl': ('EGL', 'libEGL.so.1', "apt libegl1 (GLVND's libEGL; the GPU driver or Mesa's libegl-mesa0 behind it)"),
    'osmesa': ('OSMesa', 'libOSMesa.so.8', 'apt libosmesa6'),
}


class MujocoGLError(ImportError):
  """MUJOCO_GL names a GL backend whose library cannot be loaded."""


def check_mujoco_gl(environ: Mapping[str, str] = os.environ,
                    find: Callable[[str], object] = ctypes.util.find_library,
                    load: Callable[[str], object] = ctypes.CDLL) -> None:
  """Raises `MujocoGLError` if MUJOCO_GL is egl or osmesa and that library does not load; else nothing (unset or
  another value is MuJoCo's business)."""
  backend = environ.get('MUJOCO_GL', '').strip().lower()
  if backend not in _LIBRARIES:
    return
  name, file_name, provider = _LIBRARIES[backend]
  try:
    load(find(name) or file_name)
  except OSError as err:
    raise MujocoGLError(
        f'MUJOCO_GL={backend}: its library {file_name} cannot be loaded ({err}), so `import mujoco` would fail. '
        f'Install it ({provider}), put its folder on LD_LIBRARY_PATH, or set MUJOCO_GL to a backend this machine '
        'has (egl / osmesa; unset for GLFW with a display). Only pixel observations on --backend=mujoco_cpu '
        'render with it.') from err


check_mujoco_gl()
