"""ebrl_jax.testing (filled in by the process-schedule work)."""
