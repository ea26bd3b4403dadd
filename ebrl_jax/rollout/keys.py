"""One scheme for every random number of a run: each key is the run's root key folded with a named purpose and
then with the indices it depends on (iteration, group, ...), never with an offset added to the seed.

Because a key depends only on (seed, purpose, indices), every schedule and backend draws the same numbers for the
same iteration: `fused`, `sync` with one env group and the process schedules collect and train alike. Every
function is jittable (indices may be traced). Native MuJoCo pools take integer seeds: `env_seed` derives one from
the same (seed, purpose, index) triple with numpy's SeedSequence.
"""
from __future__ import annotations

import jax
import numpy as np

from ebrl_jax import types
from ebrl_jax.config_checks import check_seed
from ebrl_jax.sim import randomize

# Purposes: fixed numbers, so a key never changes when a purpose is added.
INIT = 1  # network and train state initialisation
ENV_RESET = 2  # an env group's first reset (per group)
ROLLOUT = 3  # actions and episodic resets of one iteration's collection (per iteration, group)
TRAIN = 4  # minibatch shuffles of one iteration's update (per iteration)
EVAL = 5  # an evaluation (per trainer iteration at which it runs)
EVAL_ENV = 6  # the evaluation envs (native MuJoCo pool seed)
GENERATION = 7  # a generation worker's sampling
CELL = 8  # a cell's own envs and rollouts (per cell > 0; cell 0 draws the keys of a one-cell run)
# Domain randomisation: folded into each MJX env's reset key; a native-MuJoCo pool's draws are seeded with
# (pool seed, ENV_RANDOMIZE). See ebrl_jax.sim.randomize.
ENV_RANDOMIZE = randomize.KEY_PURPOSE


def root(seed: int) -> types.PRNGKey:
  """The run's root key; `seed` in [0, 2**32 - 1] (`config_checks.MAX_SEED`: JAX keeps a seed's low 32 bits)."""
  if isinstance(seed, (int, np.integer)):  # a traced seed is checked where it was made
    check_seed(int(seed))
  return jax.random.PRNGKey(seed)


def _fold(key: types.PRNGKey, purpose: int, *indices) -> types.PRNGKey:
  key = jax.random.fold_in(key, purpose)
  for index in indices:
    key = jax.random.fold_in(key, index)
  return key


def cell_key(root_key: types.PRNGKey, cell: int) -> types.PRNGKey:
  """The root of cell `cell`'s rollout keys: the run's root for cell 0 (a one-cell run is unchanged), else the root
  folded with CELL and the cell. Init, train and evaluation keys stay the run's: the same on every cell."""
  return root_key if cell == 0 else _fold(root_key, CELL, cell)


def init_key(root_key: types.PRNGKey) -> types.PRNGKey:
  return _fold(root_key, INIT)


def env_reset_key(root_key: types.PRNGKey, group) -> types.PRNGKey:
  return _fold(root_key, ENV_RESET, group)


def rollout_key(root_key: types.PRNGKey, iteration, group) -> types.PRNGKey:
  return _fold(root_key, ROLLOUT, iteration, group)


def train_key(root_key: types.PRNGKey, iteration) -> types.PRNGKey:
  return _fold(root_key, TRAIN, iteration)


def eval_key(root_key: types.PRNGKey, iteration) -> types.PRNGKey:
  return _fold(root_key, EVAL, iteration)


def generation_key(root_key: types.PRNGKey) -> types.PRNGKey:
  return _fold(root_key, GENERATION)


def env_seed(seed: int, purpose: int, index: int = 0, cell: int = 0) -> int:
  """An integer seed for a native-MuJoCo env pool (`purpose` ENV_RESET with the group, or EVAL_ENV); cell > 0:
  that cell's own pool (cell 0's seed is a one-cell run's)."""
  entropy = (int(seed), int(purpose), int(index)) + ((CELL, int(cell)) if cell else ())
  return int(np.random.SeedSequence(entropy).generate_state(1)[0])
