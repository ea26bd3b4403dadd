"""The generation hand-off's contract (`--generation_transport`): every reply answers its own request's
observations with the key that request carried, through the host path (shared-memory mailbox) here; the CUDA IPC
path (device buffers opened in the other process) runs the same round trips where CuPy and a CUDA GPU exist and
is skipped with the reason elsewhere. The flag's checks and `auto`'s resolution are here too."""
import threading

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import config_generation
from ebrl_jax import transport
from ebrl_jax import types
from ebrl_jax.controller import topology
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.rollout import groups
from ebrl_jax.transport import cuda_ipc
from experiments import handoff_round_trip

SMALL = handoff_round_trip.Shape(envs=4, obs_dim=3, chunk=2, action_dim=2)
IPC_REASON = cuda_ipc.unavailable_reason()


def _mjx_config(**schedule):
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', backend='mjx', num_envs=8),
                           algo=config_lib.AlgoConfig(batch_size=8, num_minibatches=2),
                           schedule=config_lib.ScheduleConfig(name='async',
                                                              num_groups=2,
                                                              colocate_generation=False,
                                                              **schedule))


def test_host_round_trips_answer_each_request_with_its_own_observations():
  result = handoff_round_trip.round_trips('host', n=40, warmup=5, shape=SMALL, process=False)
  assert (result['checked'], result['mismatches'], result['n']) == (45, 0, 40)
  assert result['p99_us'] >= result['p50_us'] > 0


@pytest.mark.skipif(IPC_REASON is not None, reason=f'CUDA IPC unavailable: {IPC_REASON}')
def test_cuda_ipc_round_trips_between_two_processes_answer_each_request():
  result = handoff_round_trip.round_trips('cuda_ipc', n=200, warmup=20, shape=SMALL)
  assert (result['checked'], result['mismatches']) == (220, 0)
  assert result['request_bytes'] + result['reply_bytes'] <= 1024  # only the flags cross the host


def test_ipc_records_carry_no_arrays_and_host_records_carry_the_slice():
  cfg, spec = _mjx_config(), types.EnvSpec('fake', 5, 2, 100, 0.01)
  host_request, host_reply = topology.mailbox_specs(cfg, spec)
  ipc_request, ipc_reply = topology.mailbox_specs(cfg, spec, ipc=True)
  assert host_request['obs'].shape == (4, 5) and ipc_request['obs'].shape == (0, 5)
  assert ipc_request['handle'].shape == (cuda_ipc.HANDLE_BYTES,) and ipc_request['key'].shape == (2,)
  assert host_reply['actions'].shape == (4, 1, 2) and ipc_reply['actions'].shape == (0, 1, 2)
  assert ipc_request.nbytes < host_request.nbytes and ipc_request.nbytes + ipc_reply.nbytes <= 1024


def test_per_request_keys_sample_what_each_slice_would_alone():
  """The generation worker's batched act for MJX groups: slice r of a batch draws what `act` draws on that slice
  alone with the key its request carried (a co-located MJX step), padding rows or not."""
  network = policies.make_network(config_lib.PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)), 3, 2)
  params = gen_stages.init_policy_params(network, jax.random.PRNGKey(0), 3)
  obs = np.random.default_rng(1).standard_normal((16, 3)).astype(np.float32)
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(7), 4))
  out = gen_stages.make_act_per_request(network, 0.001, 4)(params, obs, keys)
  act_alone = jax.jit(lambda p, o, k: gen_stages.act(network, p, o, k, min_std=0.001))
  for r in range(3):  # (the 4th is padding in a 3-request batch: its rows are discarded)
    alone = act_alone(params, obs[4 * r:4 * r + 4], keys[r])
    np.testing.assert_allclose(np.asarray(out.actions[4 * r:4 * r + 4]), np.asarray(alone.actions), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.log_probs[4 * r:4 * r + 4]), np.asarray(alone.log_probs), atol=1e-5)


def test_server_gives_each_request_its_key_and_pads_with_zero_keys():
  cfg, spec = _mjx_config(), types.EnvSpec('fake', 3, 2, 100, 0.01)
  request_spec, reply_spec = topology.mailbox_specs(cfg, spec)
  mailbox = transport.make_mailbox('thread', request_spec, reply_spec, 2, num_slices=1, slice_field='env_slice')
  seen = []

  def act(params, obs, keys):
    del params
    seen.append(np.array(keys))
    rows = np.repeat(np.asarray(keys, np.float32)[:, :1], 4, axis=0)  # each row answers its request's key
    return handoff_round_trip._Out(np.broadcast_to(rows[:, None, :1], (obs.shape[0], 1, 2)),
                                   np.zeros((obs.shape[0], 1, 2), np.float32), rows[:, 0])

  server = generation_worker.ActServer(mailbox, act, 4, 8, 3, per_request_keys=True)
  remote = groups.RemoteAct(mailbox, 1, stop=threading.Event())
  remote._seq = 1
  remote._ask(np.zeros((4, 3), np.float32), np.array([11, 12], np.uint32))
  assert server.serve(mailbox.gather(2, timeout=1), None, 5, None, 0) == 4
  np.testing.assert_array_equal(seen[0], [[11, 12]])
  reply = mailbox.receive(1, timeout=1)
  assert int(reply.version) == 5 and np.all(reply.log_probs == 11)


def test_generation_transport_flag_checks_and_auto():
  with pytest.raises(ValueError, match='--generation_transport=cuda_ipc .* needs --nocolocate_generation'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(generation_transport='cuda_ipc'))
  with pytest.raises(ValueError, match='--generation_transport=cuda_ipc needs a CUDA GPU'):
    _mjx_config(generation_transport='cuda_ipc', transport='thread')
  with pytest.raises(ValueError, match='generation_transport'):
    config_lib.ScheduleConfig(generation_transport='nvlink')
  resolve = config_generation.resolve_transport
  # auto stays on the host until the IPC path has run on a GPU (config_generation.AUTO_PICKS_IPC)
  assert resolve('auto', 'mjx', '', lambda: None) == ('cuda_ipc' if config_generation.AUTO_PICKS_IPC else 'host')
  assert resolve('auto', 'mjx', '', lambda: 'no CuPy') == 'host'
  assert resolve('auto', 'mjx', 'cpu', lambda: None) == 'host'
  assert resolve('auto', 'mujoco_cpu', '', lambda: None) == 'host'
  assert resolve('cuda_ipc', 'mjx_warp', '', lambda: 'x') == 'cuda_ipc'  # asked for: the worker says why not
  assert _mjx_config().schedule.colocate_generation is False  # MJX groups may have a generation worker now


def test_without_cupy_or_gpu_the_ipc_slot_refuses_with_the_reason():
  if IPC_REASON is None:
    pytest.skip('CUDA IPC is available here: the refusal is not reachable')
  with pytest.raises(RuntimeError, match='cuda_ipc cannot run here'):
    cuda_ipc.OwnedSlot(cuda_ipc.Layout(*SMALL))
