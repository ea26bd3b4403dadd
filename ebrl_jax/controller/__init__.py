"""The controller: builds the run from a `Config` and drives the chosen schedule."""
from ebrl_jax.controller.runner import SCHEDULES, RunError, run

__all__ = ['SCHEDULES', 'RunError', 'run']
