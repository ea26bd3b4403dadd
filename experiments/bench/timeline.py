r"""One iteration's timeline of a traced process-schedule run, as JSON: (task, process, start, end) per task, with
its critical path and each task's slack (`ebrl_jax.resources.slack`).

  python -m ebrl_jax.main --flagfile=experiments/w2_transformer.flags --schedule=overlap --trace_dir=/tmp/tr ...
  python -m experiments.bench.timeline --traces=/tmp/tr --timeline_iteration=20 --timeline_out=/tmp/it20.json

Reads the per-process trace files (`<trace_dir>/<role>.trace.json`, written by `runtime.tracing.Tracer`; the
role names the process, also when the workers are threads of one process) and maps their spans to the iteration
graph's task names (controller/iteration_graph.py): `rollout/collect` of iteration N -> collect/<g>,
`rollout/reset_next` for iteration N+1 -> reset_next/<g>, the trainer's `train/h2d` -> h2d/<g>, `train/train_step`
-> train (the graph's normaliser, gathers and updates: one jitted program), `train/publish_params` -> publish,
and any `train/evaluate` that overlaps the iteration -> evaluate. Times are seconds from the iteration's first
span.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List

from absl import app
from absl import flags

from ebrl_jax.resources import slack

# Names of their own: `--trace_dir` and the like are ebrl_jax.main's flags, defined in the same process by a test.
_TRACE_DIR = flags.DEFINE_string('traces', None, 'The run\'s --trace_dir.')
_ITERATION = flags.DEFINE_integer('timeline_iteration', 10, 'Which iteration (a steady one: past the first compiles).')
_OUT = flags.DEFINE_string('timeline_out', None, 'Where to write the JSON.')


def read_traces(trace_dir: str) -> Dict[str, List[dict]]:
  """role -> its complete ('X') events, from every `<role>.trace.json` of `trace_dir`."""
  out = {}
  for path in sorted(glob.glob(os.path.join(trace_dir, '*.trace.json'))):
    with open(path) as f:
      events = json.load(f)['traceEvents']
    role = next((e['args']['name'] for e in events if e.get('ph') == 'M'), os.path.basename(path))
    out[role] = [e for e in events if e.get('ph') == 'X']
  return out


def _task(role: str, event: dict, iteration: int):
  """The graph task of one span of iteration `iteration`, or None."""
  name, args = event['name'], event.get('args', {})
  group = role.split('/')[1] if role.startswith('rollout/') else None
  if name == 'rollout/collect' and args.get('iteration') == iteration:
    return f'collect/{group}'
  if name == 'rollout/reset_next' and args.get('iteration') == iteration + 1:
    return f'reset_next/{group}'
  if name == 'train/h2d' and args.get('version') == iteration:
    return f'h2d/{args.get("group")}'
  if name == 'train/train_step' and args.get('version') == iteration:
    return 'train'
  if name == 'train/publish_params' and args.get('version') == iteration:
    return 'publish'
  return None


def iteration_timeline(traces: Dict[str, List[dict]], iteration: int) -> List[slack.Span]:
  """The spans of one iteration (seconds from its first span), evaluations overlapping it included."""
  spans = []
  for role, events in traces.items():
    for e in events:
      task = _task(role, e, iteration)
      if task is not None:
        spans.append((task, role, e['ts'] / 1e6, (e['ts'] + e['dur']) / 1e6))
  if not spans:
    raise ValueError(f'no span of iteration {iteration} in the traces (roles: {", ".join(sorted(traces))}).')
  lo, hi = min(s[2] for s in spans), max(s[3] for s in spans)
  evals = [(role, e) for role, events in traces.items() for e in events if e['name'] == 'train/evaluate']
  for i, (role, e) in enumerate(x for x in evals if x[1]['ts'] / 1e6 < hi and (x[1]['ts'] + x[1]['dur']) / 1e6 > lo):
    spans.append((f'evaluate/{i}' if i else 'evaluate', role + '/evaluate', e['ts'] / 1e6, (e['ts'] + e['dur']) / 1e6))
  return [slack.Span(t, p, round(a - lo, 6), round(b - lo, 6)) for t, p, a, b in sorted(spans, key=lambda s: s[2])]


def dependencies(spans: List[slack.Span]) -> Dict[str, List[str]]:
  """The graph's data edges among the timeline's tasks: h2d/g after collect/g, the train step after every
  group's segment, publish after the train step."""
  names = [s.task for s in spans]
  collects = [n for n in names if n.startswith('collect/')]
  h2d = [n for n in names if n.startswith('h2d/')]
  deps = {n: [n.replace('h2d/', 'collect/')] for n in h2d}
  deps['train'] = collects + h2d
  deps['publish'] = ['train']
  return deps


def report(trace_dir: str, iteration: int) -> dict:
  spans = iteration_timeline(read_traces(trace_dir), iteration)
  analysis = slack.analyse(spans, dependencies(spans))
  return {
      'iteration': iteration,
      'spans': [{
          'task': s.task,
          'process': s.process,
          'start_s': s.start,
          'end_s': s.end
      } for s in spans],
      'iteration_s': max(s.end for s in spans),
      'critical_path': list(analysis.critical_path),
      'slack_s': {
          t: round(v, 6) for t, v in analysis.slack.items()
      }
  }


def main(argv):
  del argv
  if not _TRACE_DIR.value or not _OUT.value:
    raise app.UsageError('--traces and --timeline_out are required.')
  try:
    out = report(_TRACE_DIR.value, _ITERATION.value)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from None
  with open(_OUT.value, 'w') as f:
    json.dump(out, f, indent=1)
  print(f'iteration {out["iteration"]}: {out["iteration_s"]:.4f} s, critical path {" -> ".join(out["critical_path"])}; '
        f'{_OUT.value}')


if __name__ == '__main__':
  app.run(main)
