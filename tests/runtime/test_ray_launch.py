"""--launcher=ray (runtime/ray_launch.py): the cells' placement over a cluster's nodes, the host agent starting a
node's cells and the driver watching them through it (without Ray: the agent is a plain object behind a stand-in
of Ray's calls), the error without Ray, and (opt-in) a short async run over a local 2-node Ray cluster."""
import importlib.machinery
import os
import re
import subprocess
import sys
import time
import types

import pytest

from ebrl_jax.runtime import launch
from ebrl_jax.runtime import ray_launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _node(node_id, host, gpus=0, cells=None, alive=True):
  resources = {'CPU': 4.0, **({'GPU': float(gpus)} if gpus else {}), **({'ebrl_cells': cells} if cells else {})}
  return {'NodeID': node_id, 'NodeManagerAddress': host, 'Alive': alive, 'Resources': resources}


def test_cells_fill_the_drivers_node_first_one_per_gpu_and_refuse_what_does_not_fit():
  nodes = ray_launch.nodes_of([
      _node('b' * 8, '10.0.0.2', cells=2),
      _node('a' * 8, '10.0.0.1', cells=3),
      _node('c' * 8, '10.0.0.3'),
      _node('d' * 8, '10.0.0.4', cells=8, alive=False)
  ],
                              platform='cpu')
  assert [(n.host, n.slots, n.gpus) for n in nodes] == [('10.0.0.2', 2, False), ('10.0.0.1', 3, False),
                                                        ('10.0.0.3', 1, False)]  # ebrl_cells, else one
  placed = ray_launch.plan(nodes, 5, first_node='b' * 8)  # the driver's node holds rank 0 (the coordinator)
  assert [(n.host, ranks) for n, ranks in placed] == [('10.0.0.2', [0, 1]), ('10.0.0.1', [2, 3, 4])]
  assert [(n.host, r) for n, r in ray_launch.plan(nodes, 6)] == [('10.0.0.1', [0, 1, 2]), ('10.0.0.2', [3, 4]),
                                                                 ('10.0.0.3', [5])]
  with pytest.raises(ValueError, match=r'--launcher=ray --num_processes=7: the cluster takes 6 cells'):
    ray_launch.plan(nodes, 7)
  gpu_nodes = ray_launch.nodes_of([_node('h', '10.0.0.9'), _node('g', '10.0.0.8', gpus=8), _node('f', 'x', gpus=2)])
  assert [(n.host, n.slots, n.gpus) for n in gpu_nodes] == [('10.0.0.8', 8, True), ('x', 2, True)]  # no CPU head


class _FakeRay:
  """Ray's calls as the driver makes them (`ray.get(agent.method.remote(...))`), answered in this process."""

  class exceptions:  # pylint: disable=invalid-name
    RayError = RuntimeError

  @staticmethod
  def get(value, timeout=None):
    del timeout
    return value


class _Handle:

  def __init__(self, agent):
    self._agent = agent

  def __getattr__(self, name):
    method = getattr(self._agent, name)
    return type('Method', (), {'remote': staticmethod(method)})


def test_an_agents_cell_that_dies_stops_the_run_naming_its_rank_and_host(monkeypatch, tmp_path, capsys):
  # Rank 1 dies at once; rank 0, a survivor, notices 1 s later and exits with 3 (as a cell's FATAL does).
  scripts = {0: 'import time, sys; time.sleep(1); sys.exit(3)', 1: 'import sys; sys.exit(5)'}
  commands = []

  def command(argv, rank, num, address):
    commands.append((list(argv), rank, num, address))
    return [sys.executable, '-c', scripts[rank]]

  monkeypatch.setattr(launch, 'cell_command', command)
  agent = ray_launch.HostAgent(platform='cpu')
  pids = agent.start(['--flag'], [0, 1], 2, '10.0.0.1:1234', str(tmp_path), {'JAX_PLATFORMS': 'cpu'})
  assert commands == [(['--flag'], 0, 2, '10.0.0.1:1234'), (['--flag'], 1, 2, '10.0.0.1:1234')]
  cells = [ray_launch.RemoteCell(_FakeRay, _Handle(agent), r, pids[r]) for r in (0, 1)]
  t0 = time.monotonic()
  code = launch.watch(cells, ['h0', 'h1 (10.0.0.2, node cccccccc)'], str(tmp_path), 1, lambda: None, 0.05)
  err = capsys.readouterr().err
  assert code == 3 and time.monotonic() - t0 < 10, err
  assert re.search(
      rf'FATAL: cell rank 1 \(pid {pids[1]} on h1 \(10.0.0.2, node cccccccc\)\) died \(exit code 5\); '
      r'the other cells stopped: rank 0 after [\d.]+ s \(exit code 3\)', err), err
  assert agent.poll() == {0: 3, 1: 5}


def _fake_ray(monkeypatch, nodes, options):
  """A stand-in `ray` module for `run_ray` (the cluster `nodes`, the driver on the first), the agents' actor
  options recorded in `options` and the agents plain objects in this process."""

  class Actor:

    def __init__(self, cls):
      self._cls = cls

    def options(self, **kwargs):
      options.append(kwargs)
      return self

    def remote(self, *args):
      return _Handle(self._cls(*args))

  ray = types.ModuleType('ray')
  ray.__spec__ = importlib.machinery.ModuleSpec('ray', None)  # found by require_ray's find_spec
  ray.init = lambda **kwargs: None
  ray.nodes = lambda: nodes
  ray.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: nodes[0]['NodeID'])
  ray.remote = Actor
  ray.get, ray.exceptions, ray.shutdown = _FakeRay.get, _FakeRay.exceptions, lambda: None
  util, strategies = types.ModuleType('ray.util'), types.ModuleType('ray.util.scheduling_strategies')
  strategies.NodeAffinitySchedulingStrategy = lambda node_id, soft: (node_id, soft)
  ray.util, util.scheduling_strategies = util, strategies
  for name, module in (('ray', ray), ('ray.util', util), ('ray.util.scheduling_strategies', strategies)):
    monkeypatch.setitem(sys.modules, name, module)


def test_the_agents_ask_for_the_cells_resource_only_on_nodes_that_have_it(monkeypatch, tmp_path, capsys):
  # The driver's node has no ebrl_cells (one cell), the other says 2: an actor asking a node for a resource it
  # lacks is never placed (the driver then failed on a timeout), so only the second node's agent asks for it.
  options = []
  _fake_ray(monkeypatch, [_node('a' * 8, '10.0.0.1'), _node('b' * 8, '10.0.0.2', cells=2)], options)
  monkeypatch.setenv('RAY_DEDUP_LOGS', '0')
  monkeypatch.setattr(launch, 'cell_command', lambda argv, rank, num, address: [sys.executable, '-c', 'pass'])
  code = ray_launch.run_ray(['--flag'], 3, 'cpu', str(tmp_path), 3, lambda: None, poll_s=0.05)
  assert code == 0, capsys.readouterr().err
  assert [(o['resources'], o['num_gpus']) for o in options] == [({}, 0), ({'ebrl_cells': 2}, 0)]
  assert '--launcher=ray: 3 cells on 2 nodes' in capsys.readouterr().err


def test_an_agent_that_no_longer_answers_counts_as_its_cells_killed():

  class Gone:

    def __getattr__(self, name):

      def fail(*args):
        raise RuntimeError('the actor died')

      return type('Method', (), {'remote': staticmethod(fail)})

  cell = ray_launch.RemoteCell(_FakeRay, Gone(), 0, 123)
  assert cell.poll() == -9 and cell.wait(1) == -9


def test_without_ray_the_launcher_names_itself_and_the_extra():
  code = ('import sys; sys.modules["ray"] = None; sys.argv = ["main", "--launcher=ray", "--num_processes=2"]; '
          'from ebrl_jax import main; main.run_main()')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "FATAL: --launcher=ray needs Ray, which is not installed here: pip install 'ebrl_jax[ray]'" in out.stderr


def test_a_two_node_ray_cluster_runs_async_cells_one_per_node(tmp_path, monkeypatch):
  """Opt-in (~90 s on 2 cores): Ray's own 2-node local cluster, a node resource of one cell each."""
  cluster_utils = pytest.importorskip('ray.cluster_utils')
  monkeypatch.setenv('PYTHONPATH', ROOT)  # the nodes' workers (the agents) import this checkout
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  cluster = cluster_utils.Cluster(initialize_head=True,
                                  head_node_args={
                                      'num_cpus': 1,
                                      'resources': {
                                          ray_launch.RESOURCE: 1
                                      },
                                      'include_dashboard': False
                                  })
  try:
    cluster.add_node(num_cpus=1, resources={ray_launch.RESOURCE: 1})
    cluster.wait_for_nodes()
    monkeypatch.syspath_prepend(os.path.join(ROOT, 'tests', 'controller'))
    import test_cells  # pylint: disable=g-import-not-at-top  (its tiny config and helpers)
    run_dir = tmp_path / 'run'
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    out = subprocess.run(test_cells._main(run_dir, '--launcher=ray', '--num_processes=2', '--num_timesteps=1600',
                                          *test_cells.ASYNC),
                         cwd=ROOT,
                         env=env,
                         capture_output=True,
                         text=True,
                         timeout=400)
  finally:
    cluster.shutdown()
  assert out.returncode == 0, out.stderr[-4000:]
  placed = re.search(
      r'--launcher=ray: 2 cells on 2 nodes .* rank 0: \d+ on \S+ \(\S+, node (\w+)\), '
      r'rank 1: \d+ on \S+ \(\S+, node (\w+)\)', out.stderr)
  assert placed and placed.group(1) != placed.group(2), out.stderr[-4000:]  # one cell per node
  rank0, rank1 = test_cells._summary(run_dir / 'summary.json'), test_cells._summary(run_dir / 'rank1' / 'summary.json')
  assert rank0['env_steps'] == 1600 and rank0['extra']['cells']['count'] == 2
  assert rank0['extra']['cells']['params_chain'] == rank1['extra']['cells']['params_chain']


def test_a_hosts_cells_get_their_own_cores_and_gpus_by_uuid(monkeypatch):
  assert [launch.cell_cores(list(range(10)), 3, i) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
  assert launch.cell_cores([0], 2, 1) == [0]  # fewer cores than cells: every cell may use them all
  smi = 'GPU 0: NVIDIA H200 (UUID: GPU-1a2b-3c)\nGPU 1: NVIDIA H200 (UUID: GPU-4d5e-6f)\n'
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)  # conftest's cpu: no GPUs (test_cells_launch.py)
  monkeypatch.setattr(launch.shutil, 'which', lambda name: '/usr/bin/' + name)
  monkeypatch.setattr(launch.subprocess, 'run', lambda *a, **k: subprocess.CompletedProcess(a, 0, smi, ''))
  assert launch.gpu_ids('') == ['GPU-1a2b-3c', 'GPU-4d5e-6f'] and launch.gpu_ids('cpu') == []
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '2,3')
  assert launch.gpu_ids('') == ['2', '3']
