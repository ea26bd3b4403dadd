"""ebrl_jax: embodied RL in JAX with pipelined, resource-managed simulation, generation and training stages."""
__version__ = '0.1.0'
