r"""How much XLA compilation gains from cores: compiles the W2/W3 transformer's `act` at the generation worker's four
buckets (64..512 rows) in this process and prints the seconds. Run it pinned to different core sets, e.g.

  for c in 0 0-1; do JAX_PLATFORMS=cpu taskset -c $c python experiments/compile_cores_probe.py; done

Why: on the H200 machine W3's trainer and generation worker, pinned to one core each from the start, did not
finish compiling in 240 s; GPU feeders now take their own core only after compiling (resources.pin_after_startup).
On the 2-core CPU machine (XLA:CPU, no persistent cache): 5.5 s on one core, 3.6 s on two.
"""
import os, sys, time
import jax, jax.numpy as jnp
from ebrl_jax import config as config_lib, sim
from ebrl_jax.generation import policies, stages as gen_stages
from ebrl_jax.trainer import stages as trainer_stages

cfg = config_lib.Config(policy=config_lib.PolicyConfig(kind='transformer',
                                                       d_model=512,
                                                       num_layers=8,
                                                       num_heads=8,
                                                       mlp_ratio=4,
                                                       obs_token_size=4,
                                                       action_chunk=4),
                        algo=config_lib.AlgoConfig(unroll_length=8))
spec = sim.env_spec('ant', 1000, 1)
net = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
opt = trainer_stages.make_optimizer(cfg.algo)
ts = trainer_stages.init_train_state(net, opt, jax.random.PRNGKey(0), spec.obs_dim, cfg.policy.normalize_observations)
total = 0
for b in (64, 128, 256, 512):
  obs = jnp.zeros((b, spec.obs_dim))
  f = jax.jit(lambda p, o, k: gen_stages.act(net, p, o, k, min_std=cfg.policy.min_std))
  t = time.perf_counter()
  f.lower(ts.params, obs, jax.random.PRNGKey(1)).compile()
  total += time.perf_counter() - t
print(f'cores={len(os.sched_getaffinity(0))} act compile, 4 buckets: {total:.1f} s', flush=True)
