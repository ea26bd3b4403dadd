"""One iteration of a process schedule as a graph of named tasks, and the overlap windows derived from it.

A task names the process that runs it and the data it reads and writes. `sync` runs the tasks in `phase` order
with a barrier between phases (every group's segment in, then the train step, then the next version out, then
evaluation and checkpoint, then the next iteration's collect). A WINDOW is a task that may start before a task of
an earlier phase has ended because it reads nothing that task (or anything after it) writes: exactly the work
that is independent of the pending update. `--schedule=overlap` runs the windows that this code base realises
(`REALISATIONS`) and leaves every data dependency as in `sync`, so every update sees the
same batch, keys and parameters, and its numbers are sync's bit for bit.

The graph is a value built from the config (`make_graph`): printed at start, kept in `summary.extra
['iteration_graph']`, and the source of the workers' window switches (`IterationGraph.switches`). Its task names are the
names the timeline (`experiments/bench/timeline.py`) and the slack-aware quotas (`resources/slack.py`) use.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

from ebrl_jax import config as config_lib


@dataclasses.dataclass(frozen=True)
class Task:
  """`name` is unique in the graph ('collect/0'); `kind` is the name without its group ('collect')."""
  name: str
  process: str  # 'rollout/<g>' or 'trainer'
  phase: int  # its place in sync's order
  inputs: Tuple[str, ...]
  outputs: Tuple[str, ...]

  @property
  def kind(self) -> str:
    return self.name.split('/')[0]


@dataclasses.dataclass(frozen=True)
class Window:
  """`sync` runs `task` after the tasks `beside`, though `task` reads nothing they write (even indirectly)."""
  task: str
  beside: Tuple[str, ...]
  switch: str  # the worker switches that realise it, comma-separated ('' when none)
  realised: bool
  how: str  # how overlap runs it, or why it does not


# How this code base realises a window, by (kind of the task, kind of a task beside it; '*': any kind):
# (switch, realised, how or why not). A window the graph derives and this table does not name is not realised.
REALISATIONS: Dict[Tuple[str, str], Tuple[str, bool, str]] = {
    ('h2d', 'collect'): ('h2d', True, 'the trainer copies each group\'s segment to the device as it arrives, while '
                         'later groups still simulate; the batch is concatenated on the device (the values sync '
                         'concatenates on the host)'),
    ('update_next', 'evaluate'): ('evaluate', True, 'the trainer evaluates version v on a host copy of its '
                                  'parameters in a thread, beside the next iterations\' wait and train steps; the '
                                  'curve is joined in order'),
    ('update_next', 'checkpoint'): ('checkpoint', True, 'orbax\'s asynchronous save: the device-to-host copy in '
                                    'line, the write in the background'),
    ('reset_next', '*'): ('reset_next', True, 'native MuJoCo: the rollout worker resets its envs for the next '
                          'episodes right after it hands in its segment, while the trainer trains (the pool\'s '
                          'reset draws the same numbers whenever it runs)'),
    ('advantages', '*'): ('', False, 'GRPO\'s per-group returns and normalisation run inside the one jitted train '
                          'step; taking them out changes the compiled program (and its floating-point order) for '
                          'microseconds of work'),
    ('normalizer_stats', '*'): ('', False, 'the running observation statistics fold the whole batch in one pass; '
                                'per-group partial sums add in another order, so every update would differ in the '
                                'last bits'),
    ('gather', 'update'): ('', False, 'the next minibatch\'s gather and the current one\'s update are one lax.scan '
                           'in one XLA program: XLA\'s scheduler places the copies, nothing above it can'),
}
_MJX_RESET = 'MJX resets inside the jitted collect program; a separate reset would be another program'

OVERLAP = 'overlap'  # the schedule that runs the realised windows; sync and async run none


def _group_tasks(g: int, episodic: bool) -> List[Task]:
  p = f'rollout/{g}'
  tasks = []
  if episodic:  # GRPO: a group reset starts each iteration's episodes
    tasks.append(Task(f'reset/{g}', p, 0, (f'envs/{g}',), (f'obs0/{g}',)))
  tasks += [
      Task(f'collect/{g}', p, 1, ('params/v', f'obs0/{g}' if episodic else f'envs/{g}'),
           (f'segment/{g}', f'envs_after/{g}')),
      Task(f'h2d/{g}', 'trainer', 2, (f'segment/{g}',), (f'device_segment/{g}',)),
      Task(f'normalizer_stats/{g}', 'trainer', 3, (f'device_segment/{g}',), (f'obs_stats/{g}',)),
  ]
  if episodic:  # GRPO groups lie inside an env group: its advantages need its segment only
    tasks.append(Task(f'advantages/{g}', 'trainer', 3, (f'device_segment/{g}',), (f'advantages/{g}',)))
    # The next episodes' reset needs only the envs. PPO's envs go on where they stopped: nothing to prepare.
    tasks.append(Task(f'reset_next/{g}', p, 9, (f'envs_after/{g}',), (f'obs0_next/{g}',)))
  tasks.append(
      Task(f'collect_next/{g}', p, 10, ('params_store/v+1', f'obs0_next/{g}' if episodic else f'envs_after/{g}'),
           (f'segment_next/{g}',)))
  return tasks


def _trainer_tasks(groups: int, episodic: bool, target: bool, evaluator: str = 'trainer') -> List[Task]:
  """The trainer's tasks; `evaluator`: the process that evaluates ('evaluator' with --evaluator=process: the
  trainer then never waits for an evaluation, not even with --target_return, as in sync)."""
  segs = tuple(f'device_segment/{g}' for g in range(groups))
  stats = tuple(f'obs_stats/{g}' for g in range(groups))
  adv = tuple(f'advantages/{g}' for g in range(groups)) if episodic else ()
  # With --target_return the run may stop at this evaluation: the next train step waits for its answer.
  go_on = ('eval_return/v+1',) if target and evaluator == 'trainer' else ()
  return [
      Task('concat', 'trainer', 3, segs, ('batch',)),
      Task('normalizer', 'trainer', 4, stats + ('params/v',), ('normalizer/v+1',)),
      # Two minibatches stand for all of them: minibatch k+1's gather needs the batch and the epoch's permutation,
      # not minibatch k's update.
      Task('gather/0', 'trainer', 4, ('batch',), ('minibatch/0',)),
      Task('update/0', 'trainer', 5, ('minibatch/0', 'params/v', 'normalizer/v+1') + adv, ('params/v.0',)),
      Task('gather/1', 'trainer', 6, ('batch',), ('minibatch/1',)),
      Task('update/1', 'trainer', 7, ('minibatch/1', 'params/v.0'), ('params/v+1', 'train_state/v+1')),
      Task('publish', 'trainer', 8, ('params/v+1',), ('params_store/v+1',)),
      Task('evaluate', evaluator, 9, ('params/v+1',), ('eval_return/v+1',)),
      Task('checkpoint', 'trainer', 10, ('train_state/v+1',), ('checkpoint/v+1',)),
      Task('update_next', 'trainer', 11,
           ('train_state/v+1',) + tuple(f'segment_next/{g}' for g in range(groups)) + go_on, ('train_state/v+2',)),
  ]


def _sync_edges(tasks: Tuple[Task, ...]) -> Dict[str, Set[str]]:
  """What `sync` makes each task wait for beyond its data: a process runs its tasks in phase order, the trainer
  takes every group's segment before its first task, and a group's next iteration (its reset first) starts once
  the next version is published."""
  edges: Dict[str, Set[str]] = {t.name: set() for t in tasks}
  for t in tasks:
    for u in tasks:
      if u.process == t.process and u.phase < t.phase:
        edges[t.name].add(u.name)
      if t.kind == 'h2d' and u.kind == 'collect':
        edges[t.name].add(u.name)
      if t.kind == 'reset_next' and u.name == 'publish':
        edges[t.name].add(u.name)
  return edges


@dataclasses.dataclass(frozen=True)
class IterationGraph:
  schedule: str
  tasks: Tuple[Task, ...]
  windows: Tuple[Window, ...] = ()

  def task(self, name: str) -> Task:
    return next(t for t in self.tasks if t.name == name)

  def dependencies(self) -> Dict[str, Tuple[str, ...]]:
    """Task -> the tasks whose outputs it reads."""
    producer = {out: t.name for t in self.tasks for out in t.outputs}
    return {t.name: tuple(dict.fromkeys(producer[i] for i in t.inputs if i in producer)) for t in self.tasks}

  def ancestors(self, name: str, extra: Optional[Dict[str, Set[str]]] = None) -> FrozenSet[str]:
    """Every task `name` waits for through data (and through `extra` edges too, when given)."""
    deps, seen, todo = self.dependencies(), set(), [name]
    while todo:
      t = todo.pop()
      for d in set(deps[t]) | (extra or {}).get(t, set()):
        if d not in seen:
          seen.add(d)
          todo.append(d)
    return frozenset(seen)

  def switches(self) -> Tuple[str, ...]:
    """The worker switches of the realised windows ('h2d', 'evaluate', 'checkpoint', 'reset_next')."""
    return tuple(sorted({s for w in self.windows if w.realised for s in w.switch.split(',')}))

  def describe(self) -> dict:
    """JSON-able (kept in the summary)."""
    deps = self.dependencies()
    return {
        'schedule': self.schedule,
        'tasks': [{
            'name': t.name,
            'process': t.process,
            'phase': t.phase,
            'inputs': list(t.inputs),
            'outputs': list(t.outputs),
            'after': list(deps[t.name])
        } for t in self.tasks],
        'windows': [dataclasses.asdict(w) for w in self.windows],
        'realised': list(self.switches())
    }

  def lines(self) -> str:
    """The windows, one a line, for the log."""
    out = [
        f'iteration graph ({self.schedule}): {len(self.tasks)} tasks, {len(self.windows)} windows, realised: '
        f'{", ".join(self.switches()) or "none"}'
    ]
    for w in self.windows:
      out.append(f'  {w.task} beside {", ".join(w.beside)}: {"realised" if w.realised else "not realised"}')
    return '\n'.join(out)


def derive_windows(graph: IterationGraph, backend: str) -> Tuple[Window, ...]:
  """Per task: what `sync` makes it wait for (through its data and sync's order, transitively) less what its data
  needs (transitively). Realised only in `overlap`, and where `REALISATIONS` names a realisation for the task
  beside one of those tasks."""
  sync = _sync_edges(graph.tasks)
  windows = []
  for t in graph.tasks:
    free = graph.ancestors(t.name, sync) - graph.ancestors(t.name)
    beside = tuple(u.name for u in graph.tasks if u.name in free)
    if not beside:
      continue
    found = [REALISATIONS.get((t.kind, k)) for k in dict.fromkeys(graph.task(u).kind for u in beside)]
    found = [f for f in found if f is not None] or [REALISATIONS.get((t.kind, '*'))]
    found = [f for f in found if f is not None] or [('', False, 'no realisation in this code base')]
    if t.kind == 'reset_next' and backend != 'mujoco_cpu':
      found = [('', False, _MJX_RESET)]
    realised = [f for f in found if f[1]]
    switch = ','.join(f[0] for f in realised)
    how = '; '.join(f[2] for f in (realised or found))
    windows.append(Window(t.name, beside, switch, bool(realised) and graph.schedule == OVERLAP, how))
  return tuple(windows)


def make_graph(cfg: config_lib.Config) -> IterationGraph:
  """The iteration graph of `cfg`'s process schedule (PPO or GRPO, its groups, --target_return)."""
  episodic = cfg.algo.episodic
  tasks: List[Task] = []
  for g in range(cfg.schedule.num_groups):
    tasks += _group_tasks(g, episodic)
  tasks += _trainer_tasks(cfg.schedule.num_groups, episodic, cfg.schedule.target_return is not None,
                          'evaluator' if cfg.evaluator_process else 'trainer')
  tasks.sort(key=lambda t: (t.phase, t.process, t.name))
  graph = IterationGraph(cfg.schedule.name, tuple(tasks))
  return dataclasses.replace(graph, windows=derive_windows(graph, cfg.sim.backend))
