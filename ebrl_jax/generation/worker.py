"""Generation worker: serves actions to every env group from one process, batching whichever groups are ready.

Batch shapes come from a small set of buckets (multiples of the group size), so XLA compiles at most
`num_groups` act programs. Parameters are refreshed from the store whenever a newer version is published
(async), and a request is never answered with a version older than its `min_version` (sync: exactly the
version of the group's iteration, which the trainer cannot pass before the group's segment arrives).
"""
from __future__ import annotations

from typing import Any, Optional

from absl import logging
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import types


def generation_main(cfg: config_lib.Config, mailbox: Any, store: Any, stop: Any, env: Optional[dict] = None):
  """Process entry point. Runs until the stop event is set (or its parent has gone)."""
  from ebrl_jax import resources  # pylint: disable=g-import-not-at-top
  resources.apply_worker_env(env)
  import jax  # pylint: disable=g-import-not-at-top
  from ebrl_jax import sim, tracing  # pylint: disable=g-import-not-at-top
  from ebrl_jax.controller import runner  # pylint: disable=g-import-not-at-top
  from ebrl_jax.generation import policies  # pylint: disable=g-import-not-at-top
  from ebrl_jax.rollout import cpu as cpu_rollout  # pylint: disable=g-import-not-at-top
  from ebrl_jax.sim import worker as sim_worker  # pylint: disable=g-import-not-at-top
  from ebrl_jax.transport import ChannelClosed  # pylint: disable=g-import-not-at-top
  runner.configure_jax(cfg)
  stop = sim_worker.ParentWatch(stop)
  tracer = tracing.Tracer(cfg.schedule.trace_dir, 'generation')
  spec = sim.env_spec(cfg.sim.task, cfg.sim.episode_length, cfg.sim.action_repeat)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  act = cpu_rollout.make_act(network, cfg.policy.min_std)
  group_envs = cfg.sim.num_envs // cfg.schedule.num_groups
  key = jax.random.PRNGKey(cfg.schedule.seed + 2)
  version, params, calls = -1, None, 0
  try:
    while not stop.is_set():
      try:
        requests = mailbox.gather(cfg.schedule.num_groups, timeout=0.5)
      except TimeoutError:
        continue
      need = max(int(r.min_version) for _, r in requests)
      if store.version() > version or need > version:
        with tracer.span('gen/refresh_params'):
          if not sim_worker.wait_for_version(store, need, stop):
            break
          version, host = store.latest()
          params = jax.device_put(host)
      with tracer.span('gen/act', batch=len(requests) * group_envs):
        obs = np.concatenate([r.obs for _, r in requests], axis=0)
        out = act(params, obs, key, calls)
        actions, raw, log_probs = (np.asarray(out.actions), np.asarray(out.raw_actions),
                                   np.asarray(out.log_probs))
      calls += 1
      for i, (group, request) in enumerate(requests):
        rows = slice(i * group_envs, (i + 1) * group_envs)
        reply = types.ActReply(group=np.int32(group), seq=np.int32(request.seq), version=np.int32(version),
                               actions=actions[rows], raw_actions=raw[rows], log_probs=log_probs[rows])
        try:
          mailbox.reply(group, reply, timeout=2.0)
        except TimeoutError:  # nobody reads that group's replies (its sim worker is being restarted)
          logging.warning('generation worker: dropped a reply to group %d (seq %d).', group, int(request.seq))
  except ChannelClosed:
    pass
  finally:
    tracer.close()
