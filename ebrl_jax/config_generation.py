"""Where generation runs and how a separate generation worker's hand-off travels: the checks `config.Config` runs
on `--colocate_generation` and `--generation_transport` (kept here so that `config.py` stays under 400 lines).

`--nocolocate_generation`: one generation worker acts for every env group. Native-MuJoCo groups send their
observations through the shared-memory mailbox (they simulate on CPU cores). MJX groups step their jitted
simulation stage on the device and hand each step's observations over by `--generation_transport`:
  host      the shared-memory mailbox, a device_get / device_put in each process (what runs on CPU and in CI);
  cuda_ipc  one device buffer per env group, opened by the generation worker through CUDA IPC and read zero-copy
            by JAX through DLPack; only the small request / reply records cross the host (needs CuPy, the `ipc`
            extra, and a CUDA GPU);
  auto      host for now. The CUDA IPC path is right on the H200 (experiments/ipc_generation_check.py: 0 of 2200
            replies differ, its round trip 3.1x faster than host's), but a W1 run over it was slower than over host
            (0.33x vs 0.61x of co-located, without MPS; ipc_generation_check_h200.json), so it is taken only when
            asked for by name; AUTO_PICKS_IPC makes auto choose it where CuPy is installed and the run is on a GPU.

The value network of the transformer and token policies (`--critic`, `critic_of`):
  shared    a value head on the policy's own trunk (the value token / the BOS position);
  mlp       a separate Brax-style MLP critic (`--value_hidden_sizes`) on the normalised state observation, so the
            value loss moves none of the policy's parameters;
  auto      mlp for state observations, shared with camera observations (a critic of the state alone sees what
            the camera sees only where the task's state carries it, as push_cube's 31 values do: there
            --critic=mlp is an asymmetric critic, the usual choice in robot learning). Why mlp: with a shared
            trunk the value loss's gradient (targets of tens to hundreds after --reward_scaling) outweighs the
            normalised-advantage policy loss's in every trunk parameter (experiments/critic_gradients.py
            measures it), and W2's 25 M transformer did not learn to move.
"""
from __future__ import annotations

GENERATION_TRANSPORTS = ('auto', 'host', 'cuda_ipc')
AUTO_PICKS_IPC = False  # see the module doc: not while runs over IPC measure slower than over host
CRITICS = ('auto', 'shared', 'mlp')


def check_critic(policy) -> None:
  """`--critic` of a `PolicyConfig`: a choice of CRITICS; the MLP policy's critic is always its own MLP."""
  if policy.critic not in CRITICS:
    raise ValueError(f'--critic={policy.critic!r} is not valid; allowed values: {", ".join(CRITICS)}.')
  if policy.kind == 'mlp' and policy.critic == 'shared':
    raise ValueError('--critic=shared needs --policy=transformer or token (the MLP policy has no trunk to share: '
                     'its critic is its own MLP).')


def critic_of(policy, pixels: bool) -> str:
  """'shared' or 'mlp': the value network `policy` (a `PolicyConfig`) gets (the module doc). With camera
  observations 'mlp' is an asymmetric critic: it reads the state beside the pixels, never the pixels."""
  if policy.critic == 'auto':
    return 'shared' if pixels else 'mlp'
  return policy.critic


def check_grad_clip_critic(cfg) -> None:
  """--grad_clip_scope=per_network clips the critic's gradient apart from the policy's: the critic must share no
  parameter with the policy (a shared trunk, or the MLP policy's CNN encoder with camera observations)."""
  if cfg.algo.grad_clip_scope != 'per_network':
    return
  pixels = cfg.sim.obs == 'pixels'
  if (pixels if cfg.policy.kind == 'mlp' else critic_of(cfg.policy, pixels) == 'shared'):
    raise ValueError(f'--grad_clip_scope=per_network needs a critic that shares no parameter with the policy: '
                     f'--policy={cfg.policy.kind} --critic={cfg.policy.critic} --obs={cfg.sim.obs} shares the '
                     'trunk (use --critic=mlp, or --grad_clip_scope=global).')


def check_generation(cfg) -> None:
  """`--colocate_generation` / `--generation_transport` of a `Config` against the backend and the schedule."""
  schedule, backend = cfg.schedule, cfg.sim.backend
  if schedule.generation_transport == 'cuda_ipc':
    if schedule.colocate_generation or backend == 'mujoco_cpu':
      raise ValueError('--generation_transport=cuda_ipc carries an MJX group\'s observations to a separate '
                       'generation worker on the GPU: it needs --nocolocate_generation and --backend=mjx or '
                       f'mjx_warp (got --colocate_generation={schedule.colocate_generation}, '
                       f'--backend={backend}).')
    if cfg.resources.platform == 'cpu' or schedule.transport != 'shm':
      raise ValueError('--generation_transport=cuda_ipc needs a CUDA GPU and worker processes (got '
                       f'--platform={cfg.resources.platform or "(JAX chooses)"}, --transport={schedule.transport}); '
                       'use --generation_transport=host or auto.')


def resolve_transport(requested: str, backend: str, platform: str, ipc_reason) -> str:
  """The hand-off a run's MJX groups use: 'host' or 'cuda_ipc'. `ipc_reason` is None where CUDA IPC can run
  (transport/cuda_ipc.unavailable_reason, asked only when needed), else why not; native MuJoCo is always host."""
  if backend == 'mujoco_cpu' or requested == 'host':
    return 'host'
  if requested == 'cuda_ipc':
    return 'cuda_ipc'
  return 'cuda_ipc' if AUTO_PICKS_IPC and platform != 'cpu' and ipc_reason() is None else 'host'
