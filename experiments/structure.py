"""The package's structure, checked from its source alone (the `ast` of every module under `ebrl_jax/`, nothing
imported): the import graph among its modules, import cycles, imports against the layering, function-level
imports with no `# lazy:` reason, files over 400 lines, functions over 60 lines (worker mains over 120), and the
third-party roots each stage module imports.

    python -m experiments.structure [--json PATH]

prints a report (counts first, then details) and exits 1 where a cycle, a layering violation, an unexplained
function-level import, a file over 400 lines, a worker main over 120 lines or a stage's disallowed third-party
import is found. Functions over 60 lines are reported, not fatal. tests/test_layering.py uses it as a library.
"""
import argparse
import ast
import io
import json
import os
import re
import sys
import tokenize

PACKAGE = 'ebrl_jax'
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Worker process entry points (name ends in `_main`) set up and tear down a whole process: allowed twice as long.
MAX_WORKER_MAIN_LINES = 120

# The layer of each module by dotted name, first match wins. `x.*` matches `x` itself (a package's __init__ is in
# its package's layer) and every module under it. Role modules come before the stage wildcards they would match.
#   0 base: the package __init__, config, types.        1 stages: sim/generation/rollout/trainer, roles excepted.
#   2 services: runtime, transport, resources.         3 roles: the workers and drivers of one package each.
#   4 controller.                                       5 entry: main.
LAYERS = (
    ('ebrl_jax', 0),
    ('ebrl_jax.config', 0),
    ('ebrl_jax.config_checks', 0),
    ('ebrl_jax.config_resources', 0),
    ('ebrl_jax.config_cells', 0),
    ('ebrl_jax.config_randomize', 0),
    ('ebrl_jax.config_vision', 0),
    ('ebrl_jax.config_generation', 0),
    ('ebrl_jax.types', 0),
    ('ebrl_jax.generation.worker', 3),
    ('ebrl_jax.rollout.evaluator', 3),
    ('ebrl_jax.rollout.groups', 3),
    ('ebrl_jax.rollout.mjx_remote', 3),
    ('ebrl_jax.rollout.worker', 3),
    ('ebrl_jax.trainer.driver', 3),
    ('ebrl_jax.trainer.ranks', 3),
    ('ebrl_jax.trainer.remote_eval', 3),
    ('ebrl_jax.trainer.worker', 3),
    ('ebrl_jax.sim.*', 1),
    ('ebrl_jax.generation.*', 1),
    ('ebrl_jax.rollout.*', 1),
    ('ebrl_jax.trainer.*', 1),
    ('ebrl_jax.runtime.*', 2),
    ('ebrl_jax.transport.*', 2),
    ('ebrl_jax.resources.*', 2),
    ('ebrl_jax.controller.*', 4),
    ('ebrl_jax.main', 5),
)
LAYER_NAMES = ('base', 'stage', 'service', 'role', 'controller', 'entry')
# Services import less than their layer would allow: runtime is what every process uses (no role, no stage);
# transport builds on runtime only; resources may measure stages. Values: the layers and subsystems allowed.
SERVICE_IMPORTS = {
    'runtime': ({0}, {'runtime'}),
    'transport': ({0}, {'runtime', 'transport'}),
    'resources': ({0, 1}, {'runtime', 'transport', 'resources'}),
}
ENTRY = 'ebrl_jax.main'

# Third-party (and stdlib) roots a stage module may import: brax, mujoco and ctypes only in sim; orbax only in the
# trainer.
STAGE_COMMON = frozenset({
    'jax', 'flax', 'optax', 'chex', 'numpy', 'typing', 'functools', 'dataclasses', '__future__', 'math', 'collections',
    'os', 'concurrent', 'threading', 'enum', 'abc', 'itertools', 'time', 'json', 'shutil', 'contextlib', 'logging',
    'etils', 'importlib', 'pathlib', 'warnings'
})
STAGE_EXTRA = {
    'sim': {'brax', 'mujoco', 'mujoco_playground', 'ctypes'},  # ctypes: gl_check loads MuJoCo's GL library
    'generation': set(),
    'trainer': {'orbax'},
    'rollout': set()
}

# A reason after `lazy:` in a comment, e.g. `# lazy: mujoco is heavy and only the cpu path needs it`.
_LAZY_REASON = re.compile(r'(?:^|#)\s*lazy:\s*\S')


def discover(root, package=PACKAGE):
  """{dotted module name: path} of every .py file under root/package (a package's __init__ by the package's name)."""
  modules = {}
  for folder, dirs, files in os.walk(os.path.join(root, package)):
    dirs[:] = sorted(d for d in dirs if d != '__pycache__')
    for name in sorted(f for f in files if f.endswith('.py')):
      parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
      modules['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = os.path.join(folder, name)
  return modules


def _comments(source):
  """({line: comment text}, {lines holding only a comment})."""
  comments, alone = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string
      if not tok.line[:tok.start[1]].strip():
        alone.add(tok.start[0])
  return comments, alone


def _is_type_checking(test):
  return (isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING') or (isinstance(test, ast.Attribute) and
                                                                         test.attr == 'TYPE_CHECKING')


def _scan(body, scope, function, found):
  """Collects (import node, enclosing function or None) and (function, line, length) from statements, skipping
  `if TYPE_CHECKING:` bodies. Class bodies run at import time: their imports are module-level."""
  for node in body:
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      _scan(node.orelse, scope, function, found)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      qualname = scope + node.name
      found['functions'].append((qualname, node.lineno, node.end_lineno - node.lineno + 1))
      _scan(node.body, qualname + '.', qualname, found)
    elif isinstance(node, ast.ClassDef):
      _scan(node.body, scope + node.name + '.', function, found)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      found['imports'].append((node, function))
    else:
      children = []
      for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
          children.append(child)
        elif isinstance(child, (ast.excepthandler, ast.match_case)):
          children.extend(child.body)
      _scan(children, scope, function, found)


def _resolve(name, modules):
  """The longest prefix of a dotted name that is a package module (None outside the package)."""
  parts = name.split('.')
  while parts:
    if '.'.join(parts) in modules:
      return '.'.join(parts)
    parts.pop()
  return None


def _targets(node, module, modules):
  """(dotted name as written, package module it is an edge to) for each name an import statement brings in."""
  if isinstance(node, ast.Import):
    return [(a.name, _resolve(a.name, modules)) for a in node.names]
  base = node.module or ''
  if node.level:
    parts = module.split('.') if modules[module].endswith('__init__.py') else module.split('.')[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    base = '.'.join(parts + ([node.module] if node.module else []))
  out = []
  for alias in node.names:
    full = f'{base}.{alias.name}'
    out.append((full, full) if full in modules else (base, _resolve(base, modules)))
  return out


def parse_module(module, modules, package=PACKAGE):
  """One module's lines, functions, package imports (edges) and external import roots."""
  path = modules[module]
  with open(path) as f:
    source = f.read()
  comments, alone = _comments(source)
  found = {'imports': [], 'functions': []}
  _scan(ast.parse(source, path).body, '', None, found)
  edges, external = [], []
  for node, function in found['imports']:
    span = range(node.lineno, node.end_lineno + 1)
    lazy = any(_LAZY_REASON.search(comments.get(n, '')) for n in span) or (node.lineno - 1 in alone and bool(
        _LAZY_REASON.search(comments[node.lineno - 1])))
    seen = set()
    for written, target in _targets(node, module, modules):
      if target is None:
        root = written.split('.')[0]
        if root != package and root not in seen:
          seen.add(root)
          external.append({'root': root, 'name': written, 'line': node.lineno})
      elif target not in seen:
        seen.add(target)
        edges.append({'src': module, 'dst': target, 'line': node.lineno, 'function': function, 'lazy': lazy})
  functions = [{'module': module, 'name': n, 'line': line, 'lines': length} for n, line, length in found['functions']]
  return {'path': path, 'lines': len(source.splitlines()), 'edges': edges, 'external': external, 'functions': functions}


def layer_of(module):
  """The module's layer (0-5) by LAYERS, None where no rule matches."""
  for pattern, layer in LAYERS:
    if module == pattern.removesuffix('.*') or (pattern.endswith('.*') and module.startswith(pattern[:-1])):
      return layer
  return None


def _subsystem(module):
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def layering_error(src, dst):
  """Why an import of dst by src is against the layering; None where it is allowed."""
  if dst == ENTRY:
    return 'nothing imports the entry point'
  a, b = layer_of(src), layer_of(dst)
  if a is None or b is None:
    return None  # Unplaced modules are reported once each, not per edge.
  sub_a, sub_b = _subsystem(src), _subsystem(dst)
  if a == 2:
    layers, subsystems = SERVICE_IMPORTS.get(sub_a, ({0, 1}, {sub_a}))
    if b not in layers and not (b == 2 and sub_b in subsystems):
      return f'{sub_a} imports only layers {sorted(layers)} and {"/".join(sorted(subsystems))}'
    return None
  if a == 1 and b > 1:
    return f'a stage imports no {LAYER_NAMES[b]} module'
  if b > a:
    return f'upward: {LAYER_NAMES[a]} (layer {a}) imports {LAYER_NAMES[b]} (layer {b})'
  if a == 3 and b == 3 and sub_a != sub_b:
    return f'a {sub_a} role imports no role of {sub_b}'
  return None


def find_cycles(edges):
  """Strongly connected components of more than one module, and modules importing themselves (Tarjan, iterative)."""
  graph = {}
  for e in edges:
    graph.setdefault(e['src'], set()).add(e['dst'])
    graph.setdefault(e['dst'], set())
  index, low, stack, on_stack, sccs = {}, {}, [], set(), []
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is None:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          scc = []
          while not scc or scc[-1] != node:
            scc.append(stack.pop())
            on_stack.discard(scc[-1])
          if len(scc) > 1 or node in graph[node]:
            sccs.append(sorted(scc))
      elif child not in index:
        index[child] = low[child] = len(index)
        stack.append(child)
        on_stack.add(child)
        work.append((child, iter(sorted(graph[child]))))
      elif child in on_stack:
        low[node] = min(low[node], index[child])
  return sorted(sccs)


def example_cycle(scc, edges):
  """One shortest import cycle through the first module of an SCC, as the list of edges that close it."""
  members = set(scc)
  by_src = {}
  for e in edges:
    if e['src'] in members and e['dst'] in members:
      by_src.setdefault(e['src'], {}).setdefault(e['dst'], e)
  start, paths, frontier = scc[0], {scc[0]: []}, [scc[0]]
  while frontier:
    nxt = []
    for node in frontier:
      for dst, e in sorted(by_src.get(node, {}).items()):
        if dst == start:
          return paths[node] + [e]
        if dst not in paths:
          paths[dst] = paths[node] + [e]
          nxt.append(dst)
    frontier = nxt
  return []


def _inside(scc, edges):
  """The edges among an SCC's modules, the first import statement of each (src, dst) pair: the ones to cut."""
  first = {}
  for e in edges:
    if e['src'] in scc and e['dst'] in scc:
      first.setdefault((e['src'], e['dst']), e)
  return [first[k] for k in sorted(first)]


def _stage_external(info, module):
  allowed = STAGE_COMMON | STAGE_EXTRA.get(_subsystem(module), set())
  return [dict(x, module=module) for x in info['external'] if x['root'] not in allowed]


def analyze(root, package=PACKAGE):
  """Every figure of the structure of root/package, as plain data (see main for the JSON it becomes)."""
  modules = discover(root, package)
  infos = {m: parse_module(m, modules, package) for m in modules}
  edges = [e for m in sorted(infos) for e in infos[m]['edges']]
  functions = [f for m in sorted(infos) for f in infos[m]['functions']]
  mains = [f for f in functions if f['name'].rsplit('.', 1)[-1].endswith('_main')]
  rel = lambda m: os.path.relpath(modules[m], root)
  return {
      'modules': {
          m: {
              'path': rel(m),
              'lines': infos[m]['lines'],
              'layer': layer_of(m)
          } for m in sorted(infos)
      },
      'edges': edges,
      'cycles': [{
          'modules': scc,
          'example': example_cycle(scc, edges),
          'inside': _inside(scc, edges)
      } for scc in find_cycles(edges)],
      'unplaced': sorted(m for m in infos if layer_of(m) is None),
      'layering': [dict(e, why=why) for e in edges if (why := layering_error(e['src'], e['dst']))],
      'unexplained_lazy': [e for e in edges if e['function'] and not e['lazy']],
      'long_files': [{
          'module': m,
          'path': rel(m),
          'lines': infos[m]['lines']
      } for m in sorted(infos) if infos[m]['lines'] > MAX_FILE_LINES],
      'long_functions': [f for f in functions if f not in mains and f['lines'] > MAX_FUNCTION_LINES],
      'worker_mains': mains,
      'long_worker_mains': [f for f in mains if f['lines'] > MAX_WORKER_MAIN_LINES],
      'stage_external': [x for m in sorted(infos) if layer_of(m) == 1 for x in _stage_external(infos[m], m)],
  }


# The findings that fail the check, as (key in analyze's result, label).
FATAL = (('cycles', 'import cycles'), ('layering', 'imports against the layering'), ('unplaced', 'modules in no layer'),
         ('unexplained_lazy', 'function-level imports with no `# lazy:` reason'),
         ('long_files', f'files over {MAX_FILE_LINES} lines'), ('long_worker_mains',
                                                                f'worker mains over {MAX_WORKER_MAIN_LINES} lines'),
         ('stage_external', 'stage imports of disallowed third-party roots'))


def failures(result):
  """The labels of the fatal findings present in an analyze() result (empty: the tree passes)."""
  return [label for key, label in FATAL if result[key]]


def _where(result, e):
  inside = f' in {e["function"]}()' if e.get('function') else ''
  return f'{result["modules"][e["src"]]["path"]}:{e["line"]}{inside}'


def _counts(result):
  edges = result['edges']
  lazy = sum(1 for e in edges if e['function'])
  cycle_modules = sum(len(c['modules']) for c in result['cycles'])
  lines = [
      f'{PACKAGE}: {len(result["modules"])} modules, {sum(m["lines"] for m in result["modules"].values())} '
      f'lines, {len(edges)} import edges ({len(edges) - lazy} module-level, {lazy} function-level)'
  ]
  lines += [
      f'  {label}: {len(result[key])}' + (f' ({cycle_modules} modules)' if key == 'cycles' else '')
      for key, label in FATAL
  ]
  lines.append(f'  functions over {MAX_FUNCTION_LINES} lines (reported, not fatal): {len(result["long_functions"])}')
  lines.append(f'  worker mains: {len(result["worker_mains"])}')
  bad = failures(result)
  lines.append('FAIL: ' + ', '.join(bad) if bad else 'OK')
  return lines


def _cycle_lines(result, c):
  lines = [f'cycle of {len(c["modules"])}: {", ".join(c["modules"])}', '  a shortest cycle:']
  lines += [f'    {e["src"]} -> {e["dst"]}  ({_where(result, e)})' for e in c['example']]
  lines.append(f'  the {len(c["inside"])} imports inside it:')
  return lines + [f'    {e["src"]} -> {e["dst"]}  ({_where(result, e)})' for e in c['inside']]


def details(result, key):
  """The report's lines for one finding (a key of analyze's result); empty where there is none."""
  path = lambda f: f'{result["modules"][f["module"]]["path"]}:{f["line"]}'
  listed = lambda f: f'{f["lines"]:4d}  {path(f)} {f["name"]}'
  describe = {
      'layering': lambda e: f'{_where(result, e)}: {e["src"]} -> {e["dst"]}: {e["why"]}',
      'unplaced': lambda m: f'{m} ({result["modules"][m]["path"]}) matches no rule in LAYERS',
      'unexplained_lazy': lambda e: f'{_where(result, e)}: {e["dst"]}',
      'long_files': lambda f: f'{f["path"]}: {f["lines"]} lines',
      'long_worker_mains': lambda f: f'{path(f)} {f["name"]}: {f["lines"]} lines',
      'stage_external': lambda x: f'{path(x)}: {x["name"]}',
      'long_functions': listed,
      'worker_mains': listed,
  }
  labels = dict(FATAL, long_functions=f'functions over {MAX_FUNCTION_LINES} lines', worker_mains='worker mains')
  if not result[key]:
    return []
  if key == 'cycles':
    return [line for c in result['cycles'] for line in ['', *_cycle_lines(result, c)]]
  items = result[key]
  if key in ('long_functions', 'worker_mains'):
    items = sorted(items, key=lambda f: -f['lines'])  # Longest first: the ones to split.
  return ['', f'{labels[key]}:'] + ['  ' + describe[key](x) for x in items]


def format_report(result):
  """The human-readable report: counts first, then the details of each finding."""
  lines = _counts(result)
  for key in [k for k, _ in FATAL] + ['long_functions', 'worker_mains']:
    lines += details(result, key)
  return '\n'.join(lines)


def main(argv=None):
  """Prints the report for the package next to this script (or --root); 1 where a fatal finding is present."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--json', help='also write every figure to this JSON file')
  parser.add_argument('--root',
                      default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      help='the repository root holding the package (default: this checkout)')
  args = parser.parse_args(argv)
  result = analyze(args.root)
  print(format_report(result))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(result, failures=failures(result)), f, indent=1, sort_keys=True)
  return 1 if failures(result) else 0


if __name__ == '__main__':
  sys.exit(main())
