"""Install with `pip install -e .[test]` (see README.md)."""
import os
import re

from setuptools import find_packages, setup

_here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_here, 'ebrl_jax', '__init__.py')) as f:
  _version = re.search(r"__version__ = '([^']+)'", f.read()).group(1)
with open(os.path.join(_here, 'README.md')) as f:
  _readme = f.read()

_PLAYGROUND = ['playground==0.2.0', 'warp-lang==1.18.0']

setup(
    name='ebrl_jax',
    version=_version,
    description='Accelerator-native embodied RL in JAX: MJX or native MuJoCo simulation, policy generation and '
    'PPO/GRPO training as separate jitted stages, pipelined and resource-managed on one GPU.',
    long_description=_readme,
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    packages=find_packages(include=['ebrl_jax', 'ebrl_jax.*']),
    package_data={'ebrl_jax.sim': ['assets/*.xml']},
    python_requires='>=3.11,<3.13',
    # Versions tested together on Python 3.11 (CPU, jax 0.10.2) and 3.12 (H200, jax 0.11.2).
    install_requires=[
        'jax>=0.10,<0.12',
        'flax>=0.12,<0.13',
        'optax>=0.2.6,<0.3',
        'chex>=0.1.90,<0.2',
        'absl-py>=2.1,<3',
        'numpy>=1.26,<3',
        'nvidia-ml-py>=12.0',
        'brax==0.14.2',
        'mujoco==3.17.0',
        'mujoco-mjx==3.17.0',
        'orbax-checkpoint>=0.11,<0.13',
        'tensorboardX>=2.6,<3',
        'tqdm>=4.66,<5',
        'matplotlib>=3.8,<4',
        # jax.export's serialisation (the trace cache, ebrl_jax/runtime/trace_cache.py)
        'flatbuffers>=24.3',
    ],
    extras_require={
        # Notebooks run headless in the tests: nbclient drives an ipykernel.
        'test': [
            'pytest>=8,<10', 'pytest-xdist>=3.5,<4', 'nbformat>=5.9,<6', 'nbclient>=0.10,<0.12', 'ipykernel>=6.29,<8',
            'yapf==0.43.0', *_PLAYGROUND
        ],
        'cuda': ['jax[cuda12]>=0.10,<0.12'],
        # --backend=mjx_warp: MJX's Warp implementation (warp-lang comes with it); needs a CUDA GPU.
        'warp': ['mujoco-mjx[warp]==3.17.0'],
        # --task=playground:NAME: MuJoCo Playground's envs (imports as mujoco_playground). warp-lang pinned to the
        # version mujoco-mjx[warp] pins, so the two extras install together. In the test extra too: ~30-50 s of
        # CI install (most of it unpacking warp-lang), and the Playground tests run there.
        'playground': _PLAYGROUND,
        # --generation_transport=cuda_ipc: an MJX group's observations and actions cross to the generation worker
        # in device buffers opened through CUDA IPC (CuPy), read zero-copy by JAX through DLPack. CUDA 13
        # machines take the cupy-cuda13x wheel instead.
        'ipc': ['cupy-cuda12x>=13,<15'],
        # --launcher=ray: cells placed over a Ray cluster's nodes (runtime/ray_launch.py). Not in the test extra:
        # its one run over a 2-node cluster is opt-in (tests/conftest.py, OPT_IN) and skips without Ray.
        'ray': ['ray>=2.10,<3'],
    },
    entry_points={'console_scripts': ['ebrl_jax=ebrl_jax.main:run_main']},
    classifiers=[
        'Programming Language :: Python :: 3.11',
        'Programming Language :: Python :: 3.12',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
