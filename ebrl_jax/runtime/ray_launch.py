"""--launcher=ray: the cells of a run placed over the nodes of a Ray cluster, one host agent per node.

The command run with --launcher=ray (the driver) connects to the cluster (RAY_ADDRESS, else the cluster that
`ray start` runs on this machine, else a Ray of its own on this machine), plans the cells over the alive nodes
(`plan`: a node takes as many cells as it has GPUs, else as its `ebrl_cells` resource says, else one; rank 0 on
the driver's node when it has room, the coordinator on rank 0's host), and starts one `HostAgent` actor on each
node that gets cells, holding those GPUs (or the `ebrl_cells` a node without GPUs has, where it has that resource:
a cluster whose nodes lack it is not asked for it). Each agent starts its node's cells as ordinary
subprocesses: the `python -m ebrl_jax.main` cell command of --launcher=local, with the coordinator address and
the process ids given (`launch.cell_command`), one GPU each. Ray stays off the per-step path: the cells train
through jax.distributed and their own shared memory; the driver only asks the agents, twice a second, whether
their cells still run, and watches them as --launcher=local does (`launch.watch`): a dead cell stops the others
and one `FATAL:` line names its rank and host; a stop of the driver reaches every cell through its agent. A cell
ends with its agent (`PR_SET_PDEATHSIG`), and the agents with the driver's Ray job.

Ray is optional (`pip install 'ebrl_jax[ray]'`): this module imports it only when --launcher=ray runs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ebrl_jax.runtime import launch

RESOURCE = 'ebrl_cells'  # a node's custom resource: how many cells it takes (on a node without GPUs)
POLL_S = 0.5  # how often the driver asks the agents about their cells
_RPC_S = 60.0  # the longest the driver waits for an agent's answer


def require_ray() -> None:
  """Raises ValueError (a usage error) when Ray is not installed."""
  if importlib.util.find_spec('ray') is None:
    raise ValueError("--launcher=ray needs Ray, which is not installed here: pip install 'ebrl_jax[ray]' (or run "
                     'the cells with --launcher=local, or start them yourself with --coordinator_address, '
                     '--num_processes and --process_id).')


@dataclasses.dataclass(frozen=True)
class Node:
  """An alive node of the cluster: its Ray id, its address, how many cells it takes, whether those hold GPUs and
  whether the node has the RESOURCE (only then do its agent's cells ask for it)."""
  node_id: str
  host: str
  slots: int
  gpus: bool
  resource: bool = False


def nodes_of(ray_nodes: Sequence[dict], platform: str = '') -> List[Node]:
  """The alive nodes of `ray.nodes()` that take cells, each with how many: its GPUs, else its RESOURCE, else one.
  Where some node has GPUs (and --platform is not cpu), only the nodes with GPUs take cells (a CPU-only head node
  takes none)."""
  alive = [n for n in ray_nodes if n.get('Alive')]
  gpus_of = {n['NodeID']: int(n.get('Resources', {}).get('GPU', 0)) for n in alive}
  gpu_cluster = platform != 'cpu' and any(gpus_of.values())
  out = []
  for n in alive:
    gpus = gpus_of[n['NodeID']] if platform != 'cpu' else 0
    if gpu_cluster and not gpus:
      continue
    slots = gpus or int(n.get('Resources', {}).get(RESOURCE, 1))
    out.append(Node(n['NodeID'], n.get('NodeManagerAddress', ''), slots, gpus > 0, RESOURCE in n.get('Resources', {})))
  return out


def plan(nodes: Sequence[Node], num: int, first_node: str = '') -> List[Tuple[Node, List[int]]]:
  """Ranks 0..num-1 over `nodes`, filled node by node (`first_node`, the driver's, first; then by address): each
  node's share of ranks is contiguous, so a host's cells are neighbours. Raises ValueError when they do not fit."""
  ordered = sorted(nodes, key=lambda n: (n.node_id != first_node, n.host, n.node_id))
  if sum(n.slots for n in ordered) < num:
    have = ', '.join(f'{n.host}: {n.slots}' for n in ordered) or 'no alive node'
    raise ValueError(f'--launcher=ray --num_processes={num}: the cluster takes {sum(n.slots for n in ordered)} '
                     f'cells ({have}; a node takes one per GPU, else its "{RESOURCE}" resource, else one); give '
                     'fewer cells or more nodes.')
  out, rank = [], 0
  for node in ordered:
    ranks = list(range(rank, min(num, rank + node.slots)))
    if ranks:
      out.append((node, ranks))
    rank += len(ranks)
  return out


class HostAgent:
  """One per node (a Ray actor there; a plain object in tests): starts that node's cells as subprocesses, says
  whether they still run, signals and reaps them. Cell k of the node gets the k-th GPU the agent was given."""

  def __init__(self, platform: str = ''):
    self._platform = platform
    self._procs: Dict[int, subprocess.Popen] = {}

  def where(self) -> Tuple[str, int]:
    """(this host's name, a port free on every interface here: rank 0's coordinator)."""
    return socket.gethostname(), launch.free_port('')

  def start(self, argv: Sequence[str], ranks: Sequence[int], num: int, address: str, cwd: str,
            env: Dict[str, str]) -> Dict[int, int]:
    """Starts cells `ranks` of `num` (the driver's `argv`, coordinator `address`); returns their pids."""
    gpus = launch.gpu_ids(self._platform)
    if gpus and len(ranks) > len(gpus):
      raise ValueError(f'{socket.gethostname()} was given {len(gpus)} GPUs for {len(ranks)} cells.')
    here = cwd if os.path.isdir(cwd) else None  # the driver's directory, where this host has it
    for i, rank in enumerate(ranks):
      cell_env = dict(os.environ, **env, **({'CUDA_VISIBLE_DEVICES': gpus[i]} if gpus else {}))
      self._procs[rank] = launch.start_cell(launch.cell_command(argv, rank, num, address), cell_env, cwd=here)
    return {rank: p.pid for rank, p in self._procs.items()}

  def poll(self) -> Dict[int, Optional[int]]:
    """Each cell's exit code (None: still running)."""
    return {rank: p.poll() for rank, p in self._procs.items()}

  def send_signal(self, rank: int, sig: int) -> None:
    if self._procs[rank].poll() is None:
      self._procs[rank].send_signal(sig)

  def wait(self, rank: int, timeout: float) -> Optional[int]:
    """The cell's exit code once it ended within `timeout` s, else None."""
    try:
      return self._procs[rank].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      return None


class RemoteCell:
  """A cell on an agent, as `launch.watch` sees a subprocess. An agent that no longer answers (its node died)
  counts as its cells killed by SIGKILL."""

  def __init__(self, ray, agent, rank: int, pid: int):
    self._ray, self._agent, self.rank, self.pid = ray, agent, rank, pid
    self.returncode: Optional[int] = None

  def _call(self, method: str, *args):
    try:
      return self._ray.get(getattr(self._agent, method).remote(*args), timeout=_RPC_S)
    except self._ray.exceptions.RayError:
      self.returncode = -signal.SIGKILL
      return None

  def poll(self) -> Optional[int]:
    if self.returncode is None:
      code = (self._call('poll') or {}).get(self.rank)
      self.returncode = code if self.returncode is None else self.returncode
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      self._call('send_signal', self.rank, int(sig))

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def wait(self, timeout: Optional[float] = None) -> int:
    """As `Popen.wait`, in waits on the agent of at most _RPC_S / 2 each (an answer within the RPC's limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      left = _RPC_S / 2 if deadline is None else min(_RPC_S / 2, deadline - time.monotonic())
      if left <= 0:
        raise subprocess.TimeoutExpired(f'cell {self.rank}', timeout)
      code = self._call('wait', self.rank, left)
      self.returncode = code if self.returncode is None else self.returncode
    return self.returncode


def _passed_env() -> Dict[str, str]:
  """The driver's JAX, XLA and ebrl_jax settings, for every cell (each host's own environment otherwise)."""
  return {k: v for k, v in os.environ.items() if k.startswith(('JAX_', 'XLA_', 'EBRL_'))}


def run_ray(argv: Sequence[str],
            num: int,
            platform: str,
            run_dir: str,
            heartbeat_timeout_s: int,
            stop_requested,
            poll_s: float = POLL_S) -> int:
  """Places `num` cells of `argv` over the Ray cluster and watches them; returns the run's exit code."""
  require_ray()
  os.environ.setdefault('RAY_DEDUP_LOGS', '0')  # the cells' lines reach the driver each, not deduplicated
  import ray  # pylint: disable=g-import-not-at-top  (optional: see the module's docstring)
  from ray.util import scheduling_strategies  # pylint: disable=g-import-not-at-top
  ray.init(address=os.environ.get('RAY_ADDRESS') or None, log_to_driver=True, configure_logging=False)
  try:
    placed = plan(nodes_of(ray.nodes(), platform), num, ray.get_runtime_context().get_node_id())
    agent_cls = ray.remote(HostAgent)
    agents = []
    for node, ranks in placed:
      strategy = scheduling_strategies.NodeAffinitySchedulingStrategy(node.node_id, soft=False)
      # RESOURCE only where the node has it: an actor asking for a resource no node has is never placed
      held = {RESOURCE: len(ranks)} if node.resource and not node.gpus else {}
      agents.append(
          agent_cls.options(num_cpus=0,
                            num_gpus=len(ranks) if node.gpus else 0,
                            resources=held,
                            scheduling_strategy=strategy).remote(platform))
    wheres = ray.get([a.where.remote() for a in agents], timeout=_RPC_S)  # (host name, a free port) each
    address = f'{placed[0][0].host}:{wheres[0][1]}'  # rank 0's node
    cells: List[Optional[RemoteCell]] = [None] * num
    hosts = [''] * num
    for agent, (node, ranks), (name, _) in zip(agents, placed, wheres):
      pids = ray.get(agent.start.remote(list(argv), ranks, num, address, os.getcwd(), _passed_env()), timeout=_RPC_S)
      for rank in ranks:
        cells[rank], hosts[rank] = RemoteCell(ray, agent, rank,
                                              pids[rank]), f'{name} ({node.host}, node {node.node_id[:8]})'
    print(f'--launcher=ray: {num} cells on {len(placed)} nodes (coordinator {address}), pids ' +
          ', '.join(f'rank {r}: {c.pid} on {hosts[r]}' for r, c in enumerate(cells)) + '.',
          file=sys.stderr,
          flush=True)
    return launch.watch(cells, hosts, run_dir, heartbeat_timeout_s, stop_requested, poll_s)
  finally:
    ray.shutdown()  # the job's actors (the agents) go with it, and their cells with them
