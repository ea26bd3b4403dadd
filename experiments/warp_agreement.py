r"""MJX-Warp vs MJX-JAX on the project's own tasks (`make_mjx_env(..., impl='warp'|'jax')`), on a CUDA GPU.

    python -m experiments.warp_agreement --out=$OUT/warp_agreement_h200.json

Sections (each written to the JSON as soon as it is done; a time budget skips the rest, saying so):
  agreement   per task and batch size, both implementations from the same initial states (same reset key, so the
              same Brax reset draws) under the same action sequence (uniform in [-1, 1], auto-reset on):
              per-step max |obs_jax - obs_warp| and |reward_jax - reward_warp| over envs (and the median over envs
              of each env's max), done mismatches; lower+compile seconds of `stages.reset` and of a K-step
              `lax.scan` of `stages.step`, the first execution (Warp loads its kernels and captures its graphs
              there), and env steps/s of the scan (median of repeats; obs, reward and wrappers included);
              Warp's contact/constraint use (peak nacon per env, peak nefc) and overflow bits; lines MuJoCo
              Warp printed to stdout.
  buffers     one jitted `stages.step` per call from Python, Ant: with `donate_argnums` on the env state, without
              (the old state dropped), and with fresh buffers (every state kept alive, so XLA never reuses an
              address): ms per step and how many CUDA graphs Warp captured during the timed loop.
  sizes       naconmax / njmax too small for Ant and humanoid: what MuJoCo Warp prints, the overflow bits, how far
              the run departs from MJX-JAX.
  variants    Warp graph_mode 'jax' (XLA captures) vs 'warp' (default); the once-per-process overflow report's
              `jax.debug.callback` on vs off; MuJoCo Warp's per-step iteration-limit print left on (how much it
              prints).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import jax
from jax import numpy as jnp
import numpy as np

from ebrl_jax.sim import mjx_env
from ebrl_jax.sim import registry
from ebrl_jax.sim import stages

_CAPTURES = {'count': 0}


def _count_warp_graph_captures():
  """Counts the CUDA graphs Warp captures (its FFI calls `warp.ScopedCapture` at call time)."""
  import warp  # pylint: disable=g-import-not-at-top
  base = warp.ScopedCapture

  class Counting(base):

    def __enter__(self):
      _CAPTURES['count'] += 1
      return super().__enter__()

  warp.ScopedCapture = Counting


@contextlib.contextmanager
def capture_stdout(sink: dict):
  """Captures what is written to fd 1 (MuJoCo Warp's kernel printf lands there) into sink['lines']."""
  sys.stdout.flush()
  saved = os.dup(1)
  with tempfile.TemporaryFile(mode='w+b') as tmp:
    os.dup2(tmp.fileno(), 1)
    try:
      yield
    finally:
      try:
        import warp  # pylint: disable=g-import-not-at-top
        warp.synchronize()
      except Exception:  # pylint: disable=broad-except
        pass
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
      tmp.seek(0)
      lines = tmp.read().decode(errors='replace').splitlines()
  uniq = []
  for line in lines:
    if line not in uniq and len(uniq) < 6:
      uniq.append(line)
  sink['stdout_lines'] = sink.get('stdout_lines', 0) + len(lines)
  sink['stdout_iteration_limit_lines'] = sink.get('stdout_iteration_limit_lines', 0) + sum(
      'iterations limit reached' in line for line in lines)
  sink['stdout_first_unique'] = (sink.get('stdout_first_unique', []) + uniq)[:6]


class _Records(logging.Handler):

  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def build_env(task: str, impl: str, episode_length: int = 1000, **warp_kw):
  """make_mjx_env's env, with the Warp knobs of `warp.make_brax_env` exposed (not memoised); opt_overrides
  (MjOption fields on top of Brax's) applies to both implementations."""
  if not warp_kw:
    return stages.make_mjx_env(task, episode_length, 1, True, impl)
  from brax import envs as brax_envs  # pylint: disable=g-import-not-at-top
  from brax.envs.wrappers import training as brax_training  # pylint: disable=g-import-not-at-top
  from ebrl_jax.sim import warp as warp_lib  # pylint: disable=g-import-not-at-top
  brax_name = registry.load(task).brax_name
  if impl == 'jax':
    env = brax_envs.get_environment(brax_name, backend='mjx')
    env.sys = env.sys.tree_replace({f'opt.{k}': v for k, v in warp_kw.pop('opt_overrides').items()})
    assert not warp_kw, warp_kw
    env = brax_training.EpisodeWrapper(brax_training.VmapWrapper(env), episode_length, 1)
    return brax_training.AutoResetWrapper(env)
  report = warp_kw.pop('report_overflow', None)
  env = warp_lib.WarpVmapWrapper(warp_lib.make_brax_env(brax_name, **warp_kw), report)
  env = brax_training.EpisodeWrapper(env, episode_length, 1)
  return mjx_env.WhereAutoResetWrapper(env)


def _rollout(env, state, actions):
  """K steps of `stages.step` (actions [K, B, A]); per step obs, reward, done and Warp's usage figures."""
  warp = mjx_env.env_impl(env) == 'warp'

  def body(s, a):
    s, r = stages.step(env, s, a)
    ps = s.brax_state.pipeline_state
    if warp:
      extra = (
          ps._impl.nacon.reshape(-1)[0],
          jnp.max(ps._impl.nefc),  # pylint: disable=protected-access
          jax.lax.reduce(ps._impl.overflow.reshape(-1), jnp.int32(0), jax.lax.bitwise_or, (0,)))  # pylint: disable=protected-access
    else:
      extra = (jnp.int32(0), jnp.int32(0), jnp.int32(0))
    return s, (r.obs, r.reward, r.done, extra)

  return jax.lax.scan(body, state, actions)


def _timed(fn, *args):
  t = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t


def run_env(env, num_envs: int, actions, key, repeats: int, sink: dict):
  """Compiles and runs reset + the K-step rollout; fills sink with timings; returns the rollout outputs."""
  reset = jax.jit(stages.reset, static_argnums=(0, 2, 3))
  t = time.perf_counter()
  reset_c = reset.lower(env, key, num_envs, 1).compile()
  sink['reset_compile_s'] = time.perf_counter() - t
  with capture_stdout(sink):
    state, sink['reset_first_run_s'] = _timed(reset_c, key)
    roll = jax.jit(_rollout, static_argnums=0)
    t = time.perf_counter()
    roll_c = roll.lower(env, state, actions).compile()
    sink['rollout_compile_s'] = time.perf_counter() - t
    captures0 = _CAPTURES['count']
    (_, outs), sink['rollout_first_run_s'] = _timed(roll_c, state, actions)
    sink['graph_captures_first_run'] = _CAPTURES['count'] - captures0
    times = []
    captures0 = _CAPTURES['count']
    for _ in range(repeats):
      times.append(_timed(roll_c, state, actions)[1])
    sink['graph_captures_repeats'] = _CAPTURES['count'] - captures0
  k = actions.shape[0]
  sink['rollout_steps'] = k
  sink['rollout_run_s'] = times
  sink['env_steps_per_s'] = num_envs * k / statistics.median(times)
  obs, reward, done, (nacon, nefc, overflow) = jax.device_get(outs)
  if mjx_env.env_impl(env) == 'warp':
    sink['peak_contacts_per_env'] = float(np.max(nacon)) / num_envs
    sink['peak_nefc_per_env'] = int(np.max(nefc))
    sink['overflow_bits'] = int(np.bitwise_or.reduce(overflow))
    pipeline = env.unwrapped._pipeline  # pylint: disable=protected-access
    sink['nconmax_per_env'], sink['njmax'] = pipeline.nconmax, pipeline.njmax
  return np.asarray(obs), np.asarray(reward), np.asarray(done)


def compare(ref, other) -> dict:
  (o1, r1, d1), (o2, r2, d2) = ref, other
  obs_env = np.abs(o1 - o2).max(axis=2)  # [K, B]
  rew = np.abs(r1 - r2)
  out = {
      'obs_max_abs_diff_per_step': obs_env.max(axis=1).tolist(),
      'obs_median_env_max_abs_diff_per_step': np.median(obs_env, axis=1).tolist(),
      'reward_max_abs_diff_per_step': rew.max(axis=1).tolist(),
      'reward_median_abs_diff_per_step': np.median(rew, axis=1).tolist(),
      'done_mismatches_per_step': (d1 != d2).sum(axis=1).astype(int).tolist(),
      'obs_max_abs_jax': float(np.abs(o1).max()),
      'reward_max_abs_jax': float(np.abs(r1).max()),
  }
  for s in (1, 10, 50, len(obs_env)):
    if s <= len(obs_env):
      out[f'at_step_{s}'] = {
          'obs_max': float(obs_env[s - 1].max()),
          'obs_median_env': float(np.median(obs_env[s - 1])),
          'reward_max': float(rew[s - 1].max())
      }
  return out


def _actions(task_env, steps, num_envs, seed=1):
  return jax.random.uniform(jax.random.PRNGKey(seed), (steps, num_envs, task_env.action_size), minval=-1.0, maxval=1.0)


def section_agreement(args, result, refs):
  key = jax.random.PRNGKey(0)
  for task in args.tasks:
    for num_envs in args.num_envs:
      name = f'{task}/{num_envs}'
      entry = result['agreement'].setdefault(name, {})
      outs = {}
      for impl in ('jax', 'warp'):
        env = build_env(task, impl)
        actions = _actions(env, args.steps, num_envs)
        sink = entry.setdefault(impl, {})
        try:
          outs[impl] = run_env(env, num_envs, actions, key, args.repeats, sink)
        except Exception as e:  # pylint: disable=broad-except
          sink['error'] = f'{type(e).__name__}: {e}'[:2000]
        _log(f'{name} {impl}: {_brief(sink)}')
      if len(outs) == 2:
        entry['diff'] = compare(outs['jax'], outs['warp'])
        entry['speedup_warp_over_jax'] = entry['warp']['env_steps_per_s'] / entry['jax']['env_steps_per_s']
        _log(f'{name} diff at steps 1/10/last: ' + ', '.join(
            f"{k}={v['obs_max']:.2e}/{v['reward_max']:.2e}" for k, v in entry['diff'].items() if k.startswith('at_')))
      if num_envs == args.sizes_envs and 'jax' in outs:
        refs[task] = outs['jax']
        np.savez(f'{args.refs_prefix}_{task}.npz', *outs['jax'])
      write_result(args, result)
      if over_budget(args, result, f'agreement after {name}'):
        return


def section_buffers(args, result):
  task, num_envs = 'ant', args.buffers_envs
  key = jax.random.PRNGKey(0)
  for impl in ('jax', 'warp'):
    env = build_env(task, impl)
    acts = list(_actions(env, args.buffer_steps + 5, num_envs, seed=2))
    sink = result['buffers'].setdefault(impl, {'task': task, 'num_envs': num_envs, 'steps': args.buffer_steps})
    state0 = jax.jit(stages.reset, static_argnums=(0, 2, 3))(env, key, num_envs, 1)
    for mode in args.buffer_modes:
      fn = jax.jit(stages.step, static_argnums=0, donate_argnums=(1,) if mode.startswith('donated') else ())
      t = time.perf_counter()
      state = jax.tree.map(jnp.copy, state0)
      compiled = fn.lower(env, state, acts[0]).compile()
      m = sink.setdefault(mode, {})
      m['compile_s'] = time.perf_counter() - t
      keep = []
      for a in acts[:5]:  # warm-up: first captures happen here
        state, _ = compiled(state, a)
      jax.block_until_ready(state)
      c0, t = _CAPTURES['count'], time.perf_counter()
      for a in acts[5:]:
        state, res = compiled(state, a)
        if mode == 'fresh':
          keep.append((state, res))
        if mode.endswith('_blocking'):  # the next call only after this one is done: XLA may reuse its buffers
          jax.block_until_ready(state)
      jax.block_until_ready(state)
      m['ms_per_step'] = (time.perf_counter() - t) * 1e3 / args.buffer_steps
      m['graph_captures_in_timed_loop'] = _CAPTURES['count'] - c0
      del keep
      _log(f'buffers {impl} {mode}: {m}')
    write_result(args, result)


def section_sizes(args, result, refs):
  key = jax.random.PRNGKey(0)
  num_envs = args.sizes_envs
  configs = {
      'ant': {
          'nconmax_small': {
              'nconmax': 1
          },
          'njmax_small': {
              'njmax': 4
          }
      },
      'humanoid': {
          'nconmax_small': {
              'nconmax': 1
          },
          'njmax_small': {
              'njmax': 4
          }
      }
  }
  for task, cases in configs.items():
    path = f'{args.refs_prefix}_{task}.npz'
    if task not in refs and os.path.exists(path):
      with np.load(path) as f:
        refs[task] = tuple(f[f'arr_{i}'] for i in range(3))
    if task not in refs:
      result['skipped'].append(f'sizes {task}: no MJX-JAX reference at {num_envs} envs')
      continue
    for case, kw in cases.items():
      sink = result['sizes'].setdefault(f'{task}/{num_envs}/{case}', {'kwargs': kw})
      try:
        env = build_env(task, 'warp', **kw)
        out = run_env(env, num_envs, _actions(env, args.steps, num_envs), key, 1, sink)
        d = compare(refs[task], out)
        sink['diff'] = {k: v for k, v in d.items() if k.startswith('at_')}
      except Exception as e:  # pylint: disable=broad-except
        sink['error'] = f'{type(e).__name__}: {e}'[:2000]
      _log(f'sizes {task} {case}: {_brief(sink)}')
      write_result(args, result)


def section_converged(args, result):
  """Ant with the solver run to convergence (iterations=ls_iterations=50) in both implementations: separates
  implementation differences from those of Brax's truncated solve (iterations=1, ls_iterations=4)."""
  key = jax.random.PRNGKey(0)
  num_envs = args.sizes_envs
  for task in ('ant',):
    overrides = {'iterations': 50, 'ls_iterations': 50}
    entry = result['converged'].setdefault(f'{task}/{num_envs}', {'opt_overrides': overrides})
    outs = {}
    for impl in ('jax', 'warp'):
      sink = entry.setdefault(impl, {})
      try:
        env = build_env(task, impl, opt_overrides=dict(overrides))
        outs[impl] = run_env(env, num_envs, _actions(env, args.steps, num_envs), key, 1, sink)
      except Exception as e:  # pylint: disable=broad-except
        sink['error'] = f'{type(e).__name__}: {e}'[:2000]
      _log(f'converged {task} {impl}: {_brief(sink)}')
    if len(outs) == 2:
      entry['diff'] = compare(outs['jax'], outs['warp'])
    write_result(args, result)


def section_precision(args, result):
  """MJX-JAX with float32 matmuls at full precision (jax_default_matmul_precision='highest'; on this GPU the
  default lets XLA use TF32) against MJX-Warp, for hopper and the converged Ant."""
  key = jax.random.PRNGKey(0)
  num_envs = args.sizes_envs
  for task, overrides in (('hopper', None), ('ant', {'iterations': 50, 'ls_iterations': 50})):
    entry = result['precision'].setdefault(f'{task}/{num_envs}', {'opt_overrides': overrides})
    outs = {}
    for impl, precision in (('jax', 'highest'), ('jax', 'default'), ('warp', 'default')):
      sink = entry.setdefault(f'{impl}_{precision}', {})
      try:
        with jax.default_matmul_precision(precision):
          env = build_env(task, impl, **({'opt_overrides': dict(overrides)} if overrides else {}))
          outs[f'{impl}_{precision}'] = run_env(env, num_envs, _actions(env, args.steps, num_envs), key, 1, sink)
      except Exception as e:  # pylint: disable=broad-except
        sink['error'] = f'{type(e).__name__}: {e}'[:2000]
      _log(f'precision {task} {impl} {precision}: {_brief(sink)}')
    for ref in ('jax_highest', 'jax_default'):
      if ref in outs and 'warp_default' in outs:
        d = compare(outs[ref], outs['warp_default'])
        entry[f'diff_{ref}_vs_warp'] = {k: v for k, v in d.items() if k.startswith('at_')}
        _log(f'precision {task} {ref} vs warp: {entry[f"diff_{ref}_vs_warp"]}')
    write_result(args, result)


def section_variants(args, result):
  key = jax.random.PRNGKey(0)
  task, num_envs = 'ant', args.buffers_envs
  for case, kw in (('graph_mode_jax', {
      'graph_mode': 'jax'
  }), ('graph_mode_none', {
      'graph_mode': 'none'
  }), ('overflow_callback_off', {
      'report_overflow': False
  }), ('overflow_callback_on', {
      'report_overflow': True
  })):
    sink = result['variants'].setdefault(case, {'task': task, 'num_envs': num_envs})
    try:
      env = build_env(task, 'warp', **kw)
      run_env(env, num_envs, _actions(env, args.steps, num_envs), key, args.repeats, sink)
    except Exception as e:  # pylint: disable=broad-except
      sink['error'] = f'{type(e).__name__}: {e}'[:2000]
    _log(f'variants {case}: {_brief(sink)}')
    write_result(args, result)
    if over_budget(args, result, f'variants after {case}'):
      return
  # MuJoCo Warp's own per-step prints left on (warn_overflow unmasked): how much lands on stdout.
  sink = result['variants'].setdefault('iteration_limit_print_on', {'task': task, 'num_envs': 1024, 'steps': 10})
  try:
    env = build_env(task, 'warp', warn_overflow_mask=~0)
    run_env(env, 1024, _actions(env, 10, 1024), key, 1, sink)
  except Exception as e:  # pylint: disable=broad-except
    sink['error'] = f'{type(e).__name__}: {e}'[:2000]
  _log(f'variants print_on: {_brief(sink)}')
  write_result(args, result)


_T0 = time.perf_counter()


def _log(msg):
  print(f'[{time.perf_counter() - _T0:7.1f}s] {msg}', flush=True)


def _brief(sink):
  keys = ('reset_compile_s', 'rollout_compile_s', 'rollout_first_run_s', 'env_steps_per_s', 'overflow_bits',
          'peak_contacts_per_env', 'peak_nefc_per_env', 'stdout_lines', 'error')
  return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sink.items() if k in keys}


def over_budget(args, result, where):
  if time.perf_counter() - _T0 > args.budget_s:
    result['skipped'].append(f'time budget {args.budget_s}s reached at {where}')
    write_result(args, result)
    return True
  return False


def write_result(args, result):
  result['wall_s'] = time.perf_counter() - _T0
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + '.tmp', 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(args.out + '.tmp', args.out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default=os.path.join(os.environ.get('OUT', '/tmp'), 'warp_agreement_h200.json'))
  p.add_argument('--tasks', default='ant,humanoid,hopper')
  p.add_argument('--num_envs', default='1024,4096')
  p.add_argument('--steps', type=int, default=100, help='K: steps of the agreement / throughput rollout')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--buffers_envs', type=int, default=4096)
  p.add_argument('--buffer_steps', type=int, default=200)
  p.add_argument('--sizes_envs', type=int, default=1024)
  p.add_argument('--sections', default='agreement,buffers,sizes,converged,variants,precision')
  p.add_argument('--buffer_modes', default='donated,not_donated,fresh')
  p.add_argument('--resume', default='', help='a JSON of an earlier (partial) run to add these sections to')
  p.add_argument('--refs_prefix',
                 default='/tmp/warp_agreement_refs',
                 help='where the MJX-JAX outputs at --sizes_envs are kept for the sizes section of a later call')
  p.add_argument('--budget_s', type=float, default=480.0, help='skip later sections after this many seconds')
  args = p.parse_args(argv)
  args.tasks = args.tasks.split(',')
  args.num_envs = [int(n) for n in args.num_envs.split(',')]
  args.buffer_modes = args.buffer_modes.split(',')
  sections = args.sections.split(',')

  records = _Records()
  logging.getLogger('ebrl_jax.sim.warp').addHandler(records)
  logging.getLogger('ebrl_jax.sim.warp').setLevel(logging.INFO)
  from ebrl_jax.sim import warp as warp_lib  # pylint: disable=g-import-not-at-top
  warp_lib.check_available()
  import mujoco  # pylint: disable=g-import-not-at-top
  import warp  # pylint: disable=g-import-not-at-top
  _count_warp_graph_captures()
  result = {
      'command': 'python -m experiments.warp_agreement ' + ' '.join(argv if argv is not None else sys.argv[1:]),
      'device': str(jax.devices()[0].device_kind),
      'platform': jax.devices()[0].platform,
      'versions': {
          'jax': jax.__version__,
          'mujoco': mujoco.__version__,
          'warp': warp.__version__
      },
      'env': {
          k: os.environ.get(k)
          for k in ('WARP_CACHE_PATH', 'XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_PREALLOCATE',
                    'EBRL_WARP_NCONMAX', 'EBRL_WARP_NJMAX', 'EBRL_WARP_GRAPH_MODE')
      },
      'args': {
          k: v for k, v in vars(args).items()
      },
      'notes': ('env steps/s: K-step lax.scan of ebrl_jax.sim.stages.step with random actions (Brax obs, reward, '
                'EpisodeWrapper, auto-reset included), median of repeats, from the same reset state; compile: '
                'lower+compile seconds; first_run: the first execution (Warp kernel load and CUDA graph capture '
                'happen there); graph captures counted by wrapping warp.ScopedCapture.'),
      'agreement': {},
      'buffers': {},
      'sizes': {},
      'converged': {},
      'variants': {},
      'precision': {},
      'skipped': [],
      'once_reports': records.messages,
  }
  if args.resume and os.path.exists(args.resume):
    with open(args.resume) as f:
      earlier = json.load(f)
    for k in ('agreement', 'buffers', 'sizes', 'converged', 'variants', 'precision'):
      result[k] = dict(earlier.get(k, {}))  # this run's sections add (or redo) entries
    result['command'] = earlier.get('command', '') + ' ; then ' + result['command']
    result['skipped'] = earlier.get('skipped', [])
    result['once_reports'] = records.messages = earlier.get('once_reports', []) + records.messages
    result['earlier_wall_s'] = earlier.get('wall_s')
  refs = {}
  for name in ('agreement', 'buffers', 'sizes', 'converged', 'variants', 'precision'):
    if name not in sections:
      continue
    if name != 'agreement' and over_budget(args, result, f'before {name}'):
      break
    _log(f'--- {name}')
    try:
      if name == 'agreement':
        section_agreement(args, result, refs)
      elif name == 'buffers':
        section_buffers(args, result)
      elif name == 'sizes':
        section_sizes(args, result, refs)
      elif name == 'converged':
        section_converged(args, result)
      elif name == 'precision':
        section_precision(args, result)
      else:
        section_variants(args, result)
    except Exception as e:  # pylint: disable=broad-except
      result['skipped'].append(f'{name} failed: {type(e).__name__}: {e}'[:2000])
      _log(f'{name} failed: {type(e).__name__}: {e}')
    write_result(args, result)
  write_result(args, result)
  _log(f'wrote {args.out}')


if __name__ == '__main__':
  main()
