"""MJX env groups served by a separate generation worker (`--nocolocate_generation` on --backend=mjx) through the
host path: one short `async` run (two groups, thread transport so the MJX programs compile once in one process)
ends with every segment consumed once, the generation worker having batched both groups' requests, and the
summary saying where generation ran and why. The served group's segment equals the co-located program's given the
same keys (opt-in: two more MJX compiles); the per-request keys' contract is test_generation_transport.py's."""
import threading

import jax
import numpy as np
import runs_testlib  # pylint: disable=g-bad-import-order

from ebrl_jax import controller
from ebrl_jax import transport
from ebrl_jax.controller import topology
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.rollout import groups
from ebrl_jax.rollout import keys


def test_async_mjx_groups_served_by_a_generation_worker_deliver_every_segment_once(tmp_path):
  cfg = runs_testlib.tiny_mjx_config(tmp_path,
                                     unroll_length=5,
                                     name='async',
                                     num_groups=2,
                                     max_staleness=1,
                                     colocate_generation=False,
                                     generation_transport='auto',
                                     evaluator='trainer',
                                     num_timesteps=400,
                                     num_evals=0)
  # 16 segments of 5 steps per iteration (2 unrolls of each of the 8 envs): 400 env steps are 5 iterations x 2
  # groups, each record once.
  extra = runs_testlib.assert_each_segment_once(controller.run(cfg), 400, 10, max_staleness=1)
  generation = extra['generation']
  # (a reply may find its group's worker gone when the run stops: at most one outstanding request per group)
  assert generation['transport'] == 'host' and generation['dropped_replies'] <= 2
  # Every step of every consumed segment was acted on there: 10 requests of 4 envs per group and iteration (and
  # the groups' steps past the last trained iteration, until the run stopped them).
  assert generation['rows'] >= 10 * 40 and generation['rows'] % 4 == 0 and generation['padded_rows'] == 0
  assert set(generation['batches_per_bucket']) <= {'4', '8'}
  assert extra['generation_layout'] == {
      'colocated': False,
      'transport': 'host',
      'reason': 'set by --nocolocate_generation; hand-off host (--generation_transport=auto)'
  }


def test_served_mjx_group_collects_the_colocated_segment_given_the_same_keys():
  """One group's iteration, co-located (the jitted collect program) and served (host loop, generation server in a
  thread with per-request keys): the same segment, bit for bit on the CPU (measured: max |diff| 0 on every field),
  held here to 1e-5 for other backends' batched matmuls. Opt-in (EBRL_FULL_TESTS=1, conftest's OPT_IN): ~70 s of
  MJX compiles."""
  cfg = runs_testlib.tiny_mjx_config(unroll_length=5,
                                     name='async',
                                     num_groups=2,
                                     colocate_generation=False,
                                     generation_transport='host')
  top = topology.make_topology(cfg)
  network = policies.make_network(cfg.policy, top.env_spec.obs_dim, top.env_spec.action_dim)
  params = gen_stages.init_policy_params(network, jax.random.PRNGKey(0), top.env_spec.obs_dim)
  mailbox = transport.make_mailbox('thread', top.request_spec, top.reply_spec, 2, slice_field='env_slice')
  server = generation_worker.make_server(top.generation, mailbox, network, top.env_spec)
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      try:
        server.serve(mailbox.gather(2, timeout=0.2), params, 3, None, 0)
      except TimeoutError:
        continue

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  try:
    key = keys.rollout_key(keys.root(top.rollout.seed), 0, 1)
    local, local_stats = groups.make_group(top.rollout, 1, network, None).collect(params, 3, key)
    served, served_stats = groups.make_group(top.rollout, 1, network, None, mailbox, stop).collect(params, 3, key)
  finally:
    stop.set()
    thread.join(5)
  for name, a, b in zip(local._fields, local, served):
    np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)
  assert served_stats == local_stats
