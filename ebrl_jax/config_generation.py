"""Where generation runs and how a separate generation worker's hand-off travels: the checks `config.Config` runs
on `--colocate_generation` and `--generation_transport` (kept here so that `config.py` stays under 400 lines).

`--nocolocate_generation`: one generation worker acts for every env group. Native-MuJoCo groups send their
observations through the shared-memory mailbox (they simulate on CPU cores). MJX groups step their jitted
simulation stage on the device and hand each step's observations over by `--generation_transport`:
  host      the shared-memory mailbox, a device_get / device_put in each process (what runs on CPU and in CI);
  cuda_ipc  one device buffer per env group, opened by the generation worker through CUDA IPC and read zero-copy
            by JAX through DLPack; only the small request / reply records cross the host (needs CuPy, the `ipc`
            extra, and a CUDA GPU);
  auto      host for now. The CUDA IPC path has not yet run on a GPU (its check, experiments/ipc_generation_check.py,
            is written but unrun), so it is taken only when asked for by name; once the check passes on a GPU,
            AUTO_PICKS_IPC makes auto choose cuda_ipc where CuPy is installed and the run is on a GPU.
"""
from __future__ import annotations

GENERATION_TRANSPORTS = ('auto', 'host', 'cuda_ipc')
AUTO_PICKS_IPC = False  # see the module doc: not until the IPC path is verified on a GPU


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
