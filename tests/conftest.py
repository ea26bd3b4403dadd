"""Test speed: the tests compile many small XLA programs on the CPU, where LLVM's optimisation passes dominate
compile time and buy nothing at these sizes. Takes effect only if no JAX backend is initialised yet; test
subprocesses inherit it through the environment."""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0').strip()
