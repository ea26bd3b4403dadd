"""The fault suite (issue 17): N trials of each fault kind against tiny real runs on this machine, and one JSON table.

  python -m experiments.faults --out experiments/results/faults_cpu.json            # the long version
  python -m experiments.faults --short                                               # what CI runs (a few trials)
  python -m experiments.faults --kinds=kill_trainer,bad_input --trials=5             # some kinds
  python -m experiments.faults merge OUT.json A.json B.json ...                      # one table from several

Kinds (each trial is a real `python -m ebrl_jax.main` unless said otherwise; runs are `async`, 2 env groups, shared
memory, native MuJoCo, inverted_pendulum, 32 envs, so a trial costs seconds, not minutes):

  kill_rollout, kill_generation,  one run per `--kills_per_run` SIGKILLs of a rollout (or the generation, or the
  kill_evaluator                  evaluator) worker,
                                  each a random delay after that worker started (so kills land in its start-up,
                                  its compile and its collecting); after each kill the run must restart the worker
                                  and train on. Ends with a SIGTERM; survived: the restarts match the kills, every
                                  trained iteration consumed one segment per group, none duplicated, and the
                                  evaluation curve's versions come in order, each once.
  kill_trainer                    SIGKILL of the trainer; the run must stop by itself with one FATAL line naming the
                                  trainer, exit 3, and its newest checkpoint intact.
  kill_controller                 SIGKILL of the controller (experiments/faults_kill_controller.py); every worker
                                  must go within seconds and the next run's sweep must free its shared memory.
  sigterm, sigint                 SIGTERM to the controller (`kill`), SIGINT to the whole process group (Ctrl-C at
                                  a terminal); exit 143 / 130, one STOPPED line, nothing left.
  channel_lock                    in-process: a peer SIGKILLed while holding a channel's or the parameter store's
                                  lock, or in the middle of a put / get / publish copy; the survivors must go on
                                  within a second, the dead peer's slot or lock recovered and counted.
  truncated_checkpoint            a finished run's newest checkpoint step damaged (a file truncated at a random
                                  length, or deleted); `--resume` must continue from the newest intact step, naming
                                  the damaged one.
  disk_full                       the run's disk (a 64 MiB tmpfs in a private mount namespace) filled at a random
                                  moment after the first checkpoint; one FATAL line, exit 3, then `--resume`
                                  continues. Skipped, with the reason, where `unshare -rm` cannot mount.
  bad_input                       invocations generated from the flag definitions and the config's own validators
                                  (every numeric flag given text, every choice flag a name it does not have, every
                                  value the validators refuse) plus run-directory, file and MPS cases; each must be
                                  one FATAL line, exit 2, no worker started, no file of the previous run changed.

Every trial records its time to stop, the processes of the run still alive (found in /proc by a marker in their
environment) and the run's shared-memory bytes left in /dev/shm; leftovers are killed and swept so the next trial
starts clean.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# pylint: disable=wrong-import-position
from absl import flags as absl_flags

from ebrl_jax import main as main_lib
from ebrl_jax import transport
from ebrl_jax.runtime import lifecycle
from ebrl_jax.trainer import checkpoint
from ebrl_jax.transport import shm
from experiments import fault_children as children
from experiments import faults_kill_controller as kill_controller
# pylint: enable=wrong-import-position

TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--noprogress_bar', '--telemetry_period_s=0')
RUN = ('--schedule=async', '--num_groups=2', '--transport=shm', '--num_timesteps=100000000', '--num_evals=100000')
NUM_GROUPS = 2
CTX = multiprocessing.get_context('spawn')


def _env(marker: str) -> Dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS='cpu', **{kill_controller.MARKER: marker})


class Launch(NamedTuple):
  proc: subprocess.Popen
  run_dir: str
  marker: str
  log_path: str


def launch(run_dir: str, *flags: str, cache_dir: str = '', new_session: bool = False) -> Launch:
  """Starts `python -m ebrl_jax.main` on the tiny run (console to `<run_dir>.log`)."""
  marker = uuid.uuid4().hex
  log_path = run_dir.rstrip('/') + '.log'
  with open(log_path, 'w') as log:
    proc = subprocess.Popen([
        sys.executable, '-m', 'ebrl_jax.main', f'--run_dir={run_dir}', f'--compilation_cache_dir={cache_dir}', *TINY,
        *flags
    ],
                            cwd=ROOT,
                            env=_env(marker),
                            stdout=subprocess.DEVNULL,
                            stderr=log,
                            start_new_session=new_session)
  return Launch(proc, run_dir, marker, log_path)


def workers(run_dir: str) -> Dict[str, int]:
  """{role: pid} as the controller last wrote it (workers.json), or {} before."""
  try:
    with open(os.path.join(run_dir, 'workers.json')) as f:
      return {k: int(v) for k, v in json.load(f)['workers'].items()}
  except (OSError, ValueError, KeyError):
    return {}


def iterations(run_dir: str) -> int:
  try:
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
      return sum('"train/' in line and 'total_loss' in line for line in f)
  except OSError:
    return 0


def _summary(run_dir: str) -> Optional[dict]:
  try:
    with open(os.path.join(run_dir, 'summary.json')) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _stderr_lines(path: str) -> List[str]:
  """The console's own lines (absl's log lines, which start with a level letter and a date, left out)."""
  with open(path, errors='replace') as f:
    lines = [l.rstrip() for l in f if l.strip()]
  return [l for l in lines if l.startswith(('FATAL', 'STOPPED', 'Traceback'))]


def _wait(predicate: Callable[[], bool], timeout: float, proc: Optional[subprocess.Popen] = None) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    if proc is not None and proc.poll() is not None:
      return predicate()
    time.sleep(0.02)
  return predicate()


def _shm_bytes(pid: int) -> int:
  total = 0
  for name in kill_controller.segments_of(pid):
    try:
      total += os.stat(os.path.join(shm.SHM_DIR, name)).st_size
    except OSError:
      pass
  return total


def finish(run: Launch, stop_timeout_s: float, settle_s: float = 5.0) -> Dict:
  """Waits (bounded) for the controller to exit; then counts and clears what the run left. A controller still
  running after `stop_timeout_s` is a hang (it is killed)."""
  t0 = time.monotonic()
  try:
    code = run.proc.wait(timeout=stop_timeout_s)
    hung = False
  except subprocess.TimeoutExpired:
    hung, code = True, None
    run.proc.kill()
    run.proc.wait()
  stop_s = time.monotonic() - t0
  left = kill_controller.marked_processes(run.marker)
  while left and time.monotonic() - t0 - stop_s < settle_s:
    time.sleep(0.05)
    left = kill_controller.marked_processes(run.marker)
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  time.sleep(0.1)
  leaked = _shm_bytes(run.proc.pid)
  if leaked:  # cleared for the next trial (the next real run's start-up sweep would do the same)
    shm.ShmRegistry.sweep()
  return {
      'exit_code': code,
      'hung': hung,
      'time_to_stop_s': round(stop_s, 3),
      'processes_left': len(left),
      'shm_bytes_left': leaked
  }


# --------------------------------------------------------------------------------------------------------------
# Worker kills: many per run, each a random delay after the killed worker started.


def _role_pid(run_dir: str, prefix: str, rng: random.Random, not_pids: Sequence[int]) -> Optional[Tuple[str, int]]:
  live = [(r, p)
          for r, p in sorted(workers(run_dir).items())
          if r.startswith(prefix) and p not in not_pids and lifecycle.pid_alive(p)]
  return rng.choice(live) if live else None


def worker_kills(run_dir: str, prefix: str, kills: int, rng: random.Random, max_delay_s: float, cache_dir: str,
                 extra_flags: Sequence[str], progress_timeout_s: float) -> Dict:
  """One run; `kills` SIGKILLs of a worker whose role starts with `prefix`. Half the kills land `U(0, max_delay_s)`
  after the victim (re)started, in its start-up; the other half wait for an iteration trained since the previous
  kill (the victim is collecting or acting) and land `U(0, 2 s)` after it. After the last kill the run must train
  on (two more iterations) before it is stopped with SIGTERM."""
  run = launch(run_dir,
               *RUN,
               '--worker_fault=restart',
               f'--max_restarts={kills + 1}',
               *extra_flags,
               cache_dir=cache_dir)
  kills_landed, killed, stalls = [], [], []
  for _ in range(kills):
    if not _wait(lambda: _role_pid(run_dir, prefix, rng, killed) is not None, progress_timeout_s, run.proc):
      stalls.append('no live worker to kill' if run.proc.poll() is None else 'the run ended')
      break
    before = iterations(run_dir)
    while_working = rng.random() < 0.5
    if while_working and not _wait(lambda b=before: iterations(run_dir) > b, progress_timeout_s, run.proc):
      stalls.append(f'no iteration trained within {progress_timeout_s:.0f} s')
      break
    target = _role_pid(run_dir, prefix, rng, killed)
    if target is None:
      continue
    role, pid = target
    delay = rng.uniform(0.0, 2.0 if while_working else max_delay_s)
    time.sleep(delay)
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      continue
    killed.append(pid)
    kills_landed.append({
        'role': role,
        'moment': 'working' if while_working else 'start-up',
        'delay_s': round(delay, 2),
        'iterations_before': iterations(run_dir)
    })
  after = iterations(run_dir)
  if not stalls and not _wait(lambda: iterations(run_dir) >= after + 2, progress_timeout_s, run.proc):
    stalls.append(f'fewer than 2 iterations trained within {progress_timeout_s:.0f} s of the last kill')
  if run.proc.poll() is None:
    run.proc.send_signal(signal.SIGTERM)
  record = finish(run, stop_timeout_s=60.0)
  summary = _summary(run_dir) or {}
  extra = summary.get('extra', {})
  trained = int(summary.get('iterations', 0))
  consumed = int(extra.get('segments_consumed', -1))
  record.update({
      'kills': kills_landed,
      'stalls': stalls,
      'iterations': trained,
      'worker_restarts': extra.get('worker_restarts'),
      'segments_consumed': consumed,
      # every trained iteration took one segment per group (resumed-free run): anything else was lost on the way
      'segments_lost': max(0, trained * NUM_GROUPS - consumed) if consumed >= 0 else None,
      'segments_duplicated': extra.get('segments_duplicated'),
      'segments_dropped_stale': extra.get('segments_dropped_stale'),
      'recovered_slots': extra.get('recovered_slots'),
      'recovered_locks': extra.get('recovered_locks'),
      'stopped': summary.get('stopped'),
      'eval_versions': [e.get('version') for e in summary.get('eval_curve', [])],
  })
  in_order = record['eval_versions'] == sorted(set(record['eval_versions']))  # each version once, in order
  record['survived'] = (not stalls and not record['hung'] and record['exit_code'] == 143 and
                        record['worker_restarts'] == len(kills_landed) and record['segments_lost'] == 0 and
                        record['segments_duplicated'] == 0 and not record['processes_left'] and
                        not record['shm_bytes_left'] and in_order)
  return record


# --------------------------------------------------------------------------------------------------------------
# One fault per run: the trainer killed, the controller killed, SIGTERM, SIGINT (Ctrl-C).

ANCHORS = ('launch', 'workers', 'training')


def _anchor_reached(anchor: str, run_dir: str) -> bool:
  if anchor == 'workers':
    return bool(workers(run_dir))
  return anchor == 'launch' or iterations(run_dir) > 0


def _wait_anchor(run: Launch, anchor: str, delay: float, timeout: float) -> Dict:
  _wait(lambda: _anchor_reached(anchor, run.run_dir), timeout, run.proc)
  time.sleep(delay)
  return {
      'anchor': anchor,
      'delay_s': round(delay, 2),
      'workers_started': bool(workers(run.run_dir)),
      'iterations_before': iterations(run.run_dir),
      'ended_before_the_fault': run.proc.poll() is not None
  }


def _checkpoint_state(run_dir: str) -> Dict:
  directory = os.path.join(run_dir, 'checkpoints')
  steps = checkpoint.committed_steps(directory) if os.path.isdir(directory) else []
  newest = max(steps) if steps else None
  return {'newest_checkpoint': newest, 'newest_damage': checkpoint.damage(directory, newest) if steps else None}


def kill_trainer(run_dir: str, rng: random.Random, max_delay_s: float, cache_dir: str) -> Dict:
  run = launch(run_dir, *RUN, cache_dir=cache_dir)
  moment = _wait_anchor(run, rng.choice(ANCHORS[1:]), rng.uniform(0.0, max_delay_s), 300.0)
  pid = workers(run_dir).get('trainer')
  killed = False
  if pid and run.proc.poll() is None:
    try:
      os.kill(pid, signal.SIGKILL)
      killed = True
    except ProcessLookupError:
      pass
  record = {**moment, 'killed': killed, **finish(run, stop_timeout_s=60.0), **_checkpoint_state(run_dir)}
  lines = _stderr_lines(run.log_path)
  record['console'] = lines
  newest = record['newest_checkpoint']
  truthful = bool(lines) and ((newest is None and 'No checkpoint had been written' in lines[0]) or
                              (newest is not None and f'checkpoint {newest} in' in lines[0]))
  record['truthful_about_checkpoint'] = truthful
  record['survived'] = (killed and not record['hung'] and record['exit_code'] == 3 and len(lines) == 1 and
                        lines[0].startswith('FATAL') and 'trainer' in lines[0] and truthful and
                        not record['processes_left'] and not record['shm_bytes_left'] and
                        record['newest_damage'] is None)
  return record


def stop_signal(run_dir: str, rng: random.Random, max_delay_s: float, cache_dir: str, sig: str) -> Dict:
  """SIGTERM to the controller (as `kill` sends it) or SIGINT to the process group (as a terminal's Ctrl-C)."""
  run = launch(run_dir, *RUN, cache_dir=cache_dir, new_session=sig == 'sigint')
  moment = _wait_anchor(run, rng.choice(ANCHORS), rng.uniform(0.0, max_delay_s), 300.0)
  if run.proc.poll() is None:
    if sig == 'sigint':
      os.killpg(run.proc.pid, signal.SIGINT)
    else:
      run.proc.send_signal(signal.SIGTERM)
  record = {**moment, **finish(run, stop_timeout_s=60.0), **_checkpoint_state(run_dir)}
  lines = _stderr_lines(run.log_path)
  summary = _summary(run_dir)
  record.update({'console': lines, 'summary_written': summary is not None})
  expected = 143 if sig == 'sigterm' else 130
  record['survived'] = (not record['hung'] and record['exit_code'] == expected and len(lines) == 1 and
                        lines[0].startswith('STOPPED') and not record['processes_left'] and
                        not record['shm_bytes_left'] and record['newest_damage'] is None and
                        (summary is not None or 'before the run' in lines[0]))
  return record


def kill_the_controller(run_dir: str, rng: random.Random, max_delay_s: float) -> Dict:
  """The controller SIGKILLed: its workers must go by themselves (parent-death signal, getppid); its segments stay
  until the next run's start-up sweep (`ShmRegistry.sweep`), which the trial runs."""
  record = kill_controller.trial(run_dir, rng.uniform(0.0, max_delay_s), rng.choice(ANCHORS))
  record['survived'] = kill_controller.survived(record)
  record['time_to_stop_s'] = record['processes_gone_s']  # the workers' time to go, from the kill
  record['processes_left'] = len(record['processes_left'])
  record['shm_bytes_left'] = len(record['segments_after_the_sweep'])  # segments the sweep could not free
  return record


# --------------------------------------------------------------------------------------------------------------
# A peer killed inside the transport: holding a lock, or in the middle of a copy.

CHANNEL_FAULTS = ('channel_lock', 'store_lock', 'put_mid_copy', 'get_mid_copy', 'publish_mid_copy')


def _kill_inside(target, obj) -> bool:
  reader, writer = CTX.Pipe(duplex=False)
  child = CTX.Process(target=target, args=(obj, writer), daemon=True)
  child.start()
  inside = reader.poll(60)
  os.kill(child.pid, signal.SIGKILL)
  child.join(10)
  return inside


def channel_fault(fault: str) -> Dict:
  """A child SIGKILLed inside a transport call; the owner must then put, get and publish within a second."""
  with transport.ShmRegistry() as registry:
    channel = transport.ShmChannel(children.ITEM_SPEC, 2, registry=registry)
    store = transport.ShmParamStore({'w': np.zeros((4096,), np.float32)}, registry=registry)
    if fault == 'get_mid_copy':
      channel.put(children.item(3))
    target, obj = {
        'channel_lock': (children.take_lock_and_hang, channel),
        'store_lock': (children.take_lock_and_hang, store),
        'put_mid_copy': (children.put_mid_copy, channel),
        'get_mid_copy': (children.get_mid_copy, channel),
        'publish_mid_copy': (children.publish_mid_copy, store),
    }[fault]
    inside = _kill_inside(target, obj)
    t0 = time.monotonic()
    error = None
    try:
      got = []
      if fault == 'get_mid_copy':  # the dead reader's record is delivered to the next one, once
        got.append(int(channel.get(timeout=2).seq))
      for seq in range(2):  # the whole capacity: a dead writer's slot is free again
        channel.put(children.item(10 + seq), timeout=2)
      got += [int(channel.get(timeout=2).seq) for _ in range(2)]
      store.publish(2, {'w': np.full((4096,), 2.0, np.float32)})
      version, params = store.latest()
      whole = version == 2 and bool(np.all(params['w'] == 2.0))
    except Exception as e:  # pylint: disable=broad-except
      error, got, whole = f'{type(e).__name__}: {e}', [], False
    recovered_s = time.monotonic() - t0
    counted = tuple(channel.recovered()) if fault != 'store_lock' and fault != 'publish_mid_copy' else tuple(
        store.recovered())
    expected = ([3] if fault == 'get_mid_copy' else []) + [10, 11]
  return {
      'fault':
          fault,
      'killed_inside':
          inside,
      'error':
          error,
      'delivered':
          got,
      'store_whole':
          whole,
      'recovered_s':
          round(recovered_s, 4),
      'recovered_counted':
          list(counted),
      'survived':
          bool(inside and error is None and got == expected and whole and recovered_s < 1.0 and sum(counted) >= 1)
  }


# --------------------------------------------------------------------------------------------------------------
# Damaged checkpoints, a full disk.


def finished_run(run_dir: str, cache_dir: str) -> str:
  """A tiny fused run with checkpoints 1..3 (what the checkpoint trials damage copies of)."""
  run = launch(run_dir, '--num_timesteps=3840', '--num_evals=3', cache_dir=cache_dir)
  if run.proc.wait(timeout=600) != 0:
    raise RuntimeError(f'the reference run failed; see {run.log_path}')
  return run_dir


def truncated_checkpoint(ref_dir: str, run_dir: str, rng: random.Random, cache_dir: str) -> Dict:
  shutil.copytree(ref_dir, run_dir)
  directory = os.path.join(run_dir, 'checkpoints')
  newest = max(checkpoint.committed_steps(directory))
  files = sorted(
      os.path.join(b, n)
      for b, _, ns in os.walk(os.path.join(directory, str(newest)))
      for n in ns
      if not n.startswith('.'))
  victim = rng.choice(files)
  size = os.path.getsize(victim)
  how = rng.choice(('truncate', 'truncate', 'delete'))
  if how == 'delete':
    os.unlink(victim)
  else:
    with open(victim, 'r+b') as f:
      f.truncate(rng.randrange(0, max(1, size)))
  detected = checkpoint.damage(directory, newest)
  run = launch(run_dir, '--num_timesteps=6400', '--num_evals=5', '--resume', cache_dir=cache_dir)
  record = finish(run, stop_timeout_s=300.0)
  summary = _summary(run_dir) or {}
  resumed = summary.get('extra', {}).get('resumed_from') or {}
  lines = _stderr_lines(run.log_path)
  with open(run.log_path, errors='replace') as f:
    named = f'checkpoint {newest} ({directory}/{newest}) is damaged' in f.read()
  record.update({
      'victim': os.path.relpath(victim, directory),
      'how': how,
      'bytes_before': size,
      'damage_detected': detected,
      'resumed_from': resumed.get('step'),
      'damaged_step_named': named,
      'console': lines
  })
  # Damage the checks find must make the resume fall back (and say so); damage to a file a restore never reads
  # may leave the newest step usable, in which case resuming from it is right.
  fell_back = resumed.get('step') == newest - 1 and newest in resumed.get('skipped_damaged', []) and named
  kept = detected is None and resumed.get('step') == newest
  record['survived'] = (record['exit_code'] == 0 and not record['hung'] and not lines and (fell_back or kept) and
                        not record['processes_left'])
  return record


DISK_SCRIPT = r'''
set -u
D=$(mktemp -d)
mount -t tmpfs -o size=64m tmpfs "$D" || exit 90
run() { "$PY" -m ebrl_jax.main "$@" --run_dir="$D/run" --checkpoint_every=1 --compilation_cache_dir= ; }
run $FLAGS > "$OUT/first.log" 2>&1 &
pid=$!
while ! ls "$D/run/checkpoints" 2>/dev/null | grep -qE '^[0-9]+$'; do
  kill -0 $pid 2>/dev/null || break
  sleep 0.05
done
sleep "$DELAY"
dd if=/dev/zero of="$D/fill" bs=1M >/dev/null 2>&1
wait $pid; first=$?
rm -f "$D/fill"
run $FLAGS --resume > "$OUT/second.log" 2>&1; second=$?
cp "$D/run/summary.json" "$OUT/summary.json" 2>/dev/null
umount "$D"
echo "$first $second" > "$OUT/exits"
'''


def can_mount_a_tmpfs() -> bool:
  if not shutil.which('unshare'):
    return False
  probe = subprocess.run(['unshare', '-rm', 'sh', '-c', 'd=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs "$d"'],
                         capture_output=True,
                         timeout=30)
  return probe.returncode == 0


def disk_full(out_dir: str, rng: random.Random, max_delay_s: float) -> Dict:
  os.makedirs(out_dir, exist_ok=True)
  delay = rng.uniform(0.0, max_delay_s)
  flags = ' '.join([*TINY, '--schedule=async', '--num_groups=2', '--num_timesteps=12800', '--num_evals=10'])
  marker = uuid.uuid4().hex
  t0 = time.monotonic()
  proc = subprocess.run(['unshare', '-rm', 'bash', '-c', DISK_SCRIPT],
                        cwd=ROOT,
                        env=dict(_env(marker), PY=sys.executable, FLAGS=flags, OUT=out_dir, DELAY=f'{delay:.2f}'),
                        capture_output=True,
                        timeout=900)
  wall = time.monotonic() - t0
  try:
    first, second = (int(v) for v in open(os.path.join(out_dir, 'exits')).read().split())
  except (OSError, ValueError):
    first = second = None
  lines = _stderr_lines(os.path.join(out_dir, 'first.log')) if os.path.exists(os.path.join(out_dir,
                                                                                           'first.log')) else []
  summary = _summary(out_dir) or {}
  left = kill_controller.marked_processes(marker)
  settle = time.monotonic() + 5.0  # as for every other kind: a process on its way out is given 5 s
  while left and time.monotonic() < settle:
    time.sleep(0.05)
    left = kill_controller.marked_processes(marker)
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  record = {
      'fill_after_first_checkpoint_s': round(delay, 2),
      'first_exit': first,
      'resume_exit': second,
      'console': lines,
      'resumed_from': summary.get('extra', {}).get('resumed_from', {}).get('step'),
      'wall_s': round(wall, 1),
      'processes_left': len(left),
      'script_rc': proc.returncode
  }
  # The disk may fill after the run had finished writing (it ended normally): then only the resume is checked.
  stopped_clearly = first == 0 or (first == 3 and len(lines) == 1 and 'No space left on device' in lines[0])
  record['survived'] = stopped_clearly and second == 0 and record['resumed_from'] is not None and not left
  return record


# --------------------------------------------------------------------------------------------------------------
# Bad inputs, generated from the flags and the config's validators.


def _fresh_flags() -> absl_flags.FlagValues:
  values = absl_flags.FlagValues()
  main_lib.define_flags(values)
  return values


def _refused_by_config(argv: Sequence[str]) -> bool:
  """True if `argv` parses as flags but the config's validators refuse it."""
  values = _fresh_flags()
  try:
    values(['faults', *TINY, *argv])
  except absl_flags.Error:
    return False  # a parse error: the parse cases cover those
  try:
    main_lib.config_from_flags(values)
  except ValueError:
    return True
  return False


def generated_bad_inputs() -> List[Tuple[str, Tuple[str, ...]]]:
  """(category, argv) cases: parse errors for every typed flag, refused values for every flag the validators
  check, and hand-written cases for what only the controller can see (run-dir state, files, MPS)."""
  values = _fresh_flags()
  cases: List[Tuple[str, Tuple[str, ...]]] = []
  names = sorted(n for n in values if len(n) > 1 and values[n].name == n and n in _config_flag_names())
  for name in names:
    kind = type(values[name]).__name__
    parser = type(values[name].parser).__name__
    if 'Boolean' in parser:
      cases.append(('parse: bool', (f'--{name}=maybe',)))
    elif 'Integer' in parser:
      cases.append(('parse: int', (f'--{name}=abc',)))
      cases.append(('parse: int', (f'--{name}=1.5',)))
    elif 'Float' in parser:
      cases.append(('parse: float', (f'--{name}=abc',)))
    elif 'List' in kind or 'List' in parser:
      cases.append(('parse: list', (f'--{name}=a,b',)))
    for value in ('-1', '0', '1e9', 'no_such_value', '-0.5', '2.5'):
      argv = (f'--{name}={value}',)
      if not any(c[1] == argv for c in cases) and _refused_by_config(argv):
        cases.append(('validator', argv))
  cases += [
      ('unknown flag', ('--no_such_flag',)),
      ('unknown flag', ('--num_env=32',)),
      ('positional', ('positional_argument',)),
      ('validator', ('--num_envs=30', '--schedule=async', '--num_groups=4')),
      ('validator', ('--batch_size=31',)),
      ('quotas', ('--schedule=async', '--num_groups=2', '--sm_quotas=trainer=30,trainer=40')),
      ('quotas', ('--schedule=async', '--num_groups=2', '--use_mps', '--sm_quotas=trainer=50,rollout=30')),
      ('quotas', ('--schedule=async', '--num_groups=2', '--sm_quotas=learner=30')),
      ('files', ('--memory_profile=/nonexistent/profile.json',)),
      ('files', ('--flagfile=/nonexistent/run.flags',)),
  ]
  if not shutil.which('nvidia-cuda-mps-control'):
    cases.append(('mps', ('--schedule=async', '--num_groups=2', '--use_mps')))
  return cases


def _config_flag_names() -> set:
  names = set()
  for _, cls, renames in main_lib._SECTIONS:  # pylint: disable=protected-access
    for field in dataclasses.fields(cls):
      names.add(renames.get(field.name, field.name))
  return names


def _snapshot(run_dir: str) -> Dict[str, Tuple[str, int]]:
  out = {}
  for base, _, files in os.walk(run_dir):
    for name in files:
      path = os.path.join(base, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, run_dir)] = (hashlib.sha1(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
  return out


def bad_input(category: str, argv: Sequence[str], previous_run: str) -> Dict:
  """One invocation pointed at a previous run's directory with --resume (so the run-dir state is not what is
  wrong): it must be one FATAL line, exit 2, no worker, and that directory unchanged to the byte."""
  before = _snapshot(previous_run)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  t0 = time.monotonic()
  try:
    result = subprocess.run(
        [sys.executable, '-m', 'ebrl_jax.main', *TINY, f'--run_dir={previous_run}', '--resume', *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180)
    code, stderr = result.returncode, result.stderr
  except subprocess.TimeoutExpired:
    code, stderr = None, ''
  lines = [l for l in stderr.splitlines() if l.strip()]
  unchanged = _snapshot(previous_run) == before
  return {
      'category':
          category,
      'argv':
          list(argv),
      'exit_code':
          code,
      'line':
          lines[0][:300] if len(lines) == 1 else None,
      'lines':
          len(lines),
      'seconds':
          round(time.monotonic() - t0, 2),
      'unchanged':
          unchanged,
      'survived': (code == 2 and len(lines) == 1 and lines[0].startswith('FATAL: ') and 'Traceback' not in stderr and
                   unchanged)
  }


def bad_run_dirs(root: str, previous_run: str) -> List[Dict]:
  """What only the run directory can make wrong (each must be one FATAL line before anything starts)."""
  a_file = os.path.join(root, 'a_file')
  with open(a_file, 'w') as f:
    f.write('x')
  cases = [
      ('run dir', ('--run_dir=/proc/ebrl_run',)),
      ('run dir', (f'--run_dir={a_file}',)),
      ('run dir', (f'--run_dir={os.path.join(root, "never_ran")}', '--resume')),
      ('run dir', (f'--run_dir={previous_run}',)),  # holds checkpoints, no --resume
  ]
  out = []
  for category, argv in cases:
    before = _snapshot(previous_run)
    result = subprocess.run([sys.executable, '-m', 'ebrl_jax.main', *TINY, *argv],
                            cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS='cpu'),
                            capture_output=True,
                            text=True,
                            timeout=180)
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    unchanged = _snapshot(previous_run) == before
    out.append({
        'category': category,
        'argv': list(argv),
        'exit_code': result.returncode,
        'line': lines[0][:300] if len(lines) == 1 else None,
        'lines': len(lines),
        'unchanged': unchanged,
        'survived': result.returncode == 2 and len(lines) == 1 and lines[0].startswith('FATAL: ') and unchanged
    })
  return out


# --------------------------------------------------------------------------------------------------------------
# The suite.

KINDS = ('kill_rollout', 'kill_generation', 'kill_evaluator', 'kill_trainer', 'kill_controller', 'sigterm', 'sigint',
         'channel_lock', 'truncated_checkpoint', 'disk_full', 'bad_input')
KILL_KINDS = ('kill_rollout', 'kill_generation', 'kill_evaluator', 'kill_trainer', 'kill_controller')
_WORKER_KILLS = {
    'kill_rollout': ('rollout/', ()),
    'kill_generation': ('generation', ('--nocolocate_generation',)),
    'kill_evaluator': ('evaluator', ())
}  # kind -> (role prefix, flags)


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  kinds: Tuple[str, ...] = KINDS
  trials: int = 20  # per one-fault-per-run kind
  worker_runs: int = 2  # runs per worker-kill kind
  kills_per_run: int = 10
  bad_inputs: int = 100  # 0: every generated case
  disk_trials: int = 3
  run_dir_cases: bool = True  # bad_input: also the run-directory cases (a file, /proc, no checkpoint, ...)
  max_delay_s: float = 6.0
  seed: int = 0


# CI's version: a trial or a few of two cheap kinds (tests/test_faults.py). The kill, signal, checkpoint and
# disk kinds have their own CI tests (tests/controller/test_pipeline.py, tests/test_signals.py,
# tests/runtime/test_liveness.py, tests/test_disk_full.py); the long version is what the README quotes.
SHORT = SuiteConfig(kinds=('channel_lock', 'bad_input'),
                    trials=1,
                    worker_runs=1,
                    kills_per_run=2,
                    bad_inputs=4,
                    run_dir_cases=False,
                    max_delay_s=3.0)


def _row(kind: str, records: List[Dict], kills: int) -> Dict:

  def total(key):
    return sum(int(r.get(key) or 0) for r in records)

  stops = [r['time_to_stop_s'] for r in records if r.get('time_to_stop_s') is not None]
  return {
      'kind': kind,
      'trials': len(records),
      'kills': kills,
      'survived': sum(bool(r['survived']) for r in records),
      'hangs': sum(bool(r.get('hung')) for r in records),
      'processes_left': total('processes_left'),
      'shm_bytes_left': total('shm_bytes_left'),
      'segments_lost': total('segments_lost'),
      'segments_duplicated': total('segments_duplicated'),
      'max_time_to_stop_s': max(stops) if stops else None,
  }


def run_suite(suite: SuiteConfig, root: str, log: Callable[[str], None] = print, checkpoint_to: str = '') -> Dict:
  rng = random.Random(suite.seed)
  cache_dir = os.path.join(root, 'xla_cache')  # shared by the trials: restarts compile from it
  lifecycle_dir = os.path.join(root, 'runs')
  os.makedirs(lifecycle_dir, mode=0o700, exist_ok=True)
  os.makedirs(cache_dir, mode=0o700, exist_ok=True)
  rows, records = [], {}
  counter = iter(range(10**6))

  def fresh(name):
    return os.path.join(lifecycle_dir, f'{name}{next(counter)}')

  reference = None

  def previous_run():
    nonlocal reference
    if reference is None:
      reference = finished_run(fresh('reference'), cache_dir)
    return reference

  for kind in suite.kinds:
    t0 = time.monotonic()
    kills = 0
    if kind in _WORKER_KILLS:
      prefix, extra = _WORKER_KILLS[kind]
      out = [
          worker_kills(fresh(kind), prefix, suite.kills_per_run, rng, suite.max_delay_s, cache_dir, extra, 300.0)
          for _ in range(suite.worker_runs)
      ]
      kills = sum(len(r['kills']) for r in out)
    elif kind == 'kill_trainer':
      out = [kill_trainer(fresh(kind), rng, suite.max_delay_s, cache_dir) for _ in range(suite.trials)]
      kills = sum(r['killed'] for r in out)
    elif kind == 'kill_controller':
      out = [kill_the_controller(fresh(kind), rng, suite.max_delay_s) for _ in range(suite.trials)]
      kills = len(out)
    elif kind in ('sigterm', 'sigint'):
      out = [stop_signal(fresh(kind), rng, suite.max_delay_s, cache_dir, kind) for _ in range(suite.trials)]
    elif kind == 'channel_lock':
      out = [channel_fault(CHANNEL_FAULTS[i % len(CHANNEL_FAULTS)]) for i in range(max(suite.trials, 5))]
    elif kind == 'truncated_checkpoint':
      out = [truncated_checkpoint(previous_run(), fresh(kind), rng, cache_dir) for _ in range(suite.trials)]
    elif kind == 'disk_full':
      if not can_mount_a_tmpfs():
        rows.append({'kind': kind, 'trials': 0, 'skipped': 'unshare -rm cannot mount a tmpfs on this machine'})
        continue
      out = [disk_full(fresh(kind), rng, suite.max_delay_s) for _ in range(suite.disk_trials)]
    elif kind == 'bad_input':
      cases = generated_bad_inputs()
      if suite.bad_inputs and suite.bad_inputs < len(cases):  # a seeded sample that keeps every category
        by_category: Dict[str, list] = {}
        for case in cases:
          by_category.setdefault(case[0], []).append(case)
        picked = [rng.choice(v) for v in by_category.values()][:suite.bad_inputs]
        rest = [c for c in cases if c not in picked]
        cases = picked + rng.sample(rest, suite.bad_inputs - len(picked))
      out = [bad_input(c, argv, previous_run()) for c, argv in cases]
      out += bad_run_dirs(lifecycle_dir, previous_run()) if suite.run_dir_cases else []
    else:
      raise ValueError(f'no fault kind {kind!r}; kinds: {", ".join(KINDS)}')
    row = _row(kind, out, kills)
    row['wall_s'] = round(time.monotonic() - t0, 1)
    rows.append(row)
    records[kind] = out
    log(json.dumps(row))
    if checkpoint_to:  # the table so far, so that a suite cut short keeps what it measured
      with open(checkpoint_to, 'w') as f:
        json.dump({'suite': dataclasses.asdict(suite), 'rows': rows, 'records': records, 'partial': True}, f)
  kill_rows = [r for r in rows if r['kind'] in KILL_KINDS]
  return {
      'suite': dataclasses.asdict(suite),
      'machine': {
          'cpus': os.cpu_count(),
          'python': sys.version.split()[0]
      },
      'rows': rows,
      'total_kills': sum(r.get('kills', 0) for r in kill_rows),
      'all_survived': all(r.get('survived') == r.get('trials') for r in rows if r.get('trials')),
      'records': records
  }


def _parse(argv: Optional[Sequence[str]] = None) -> Tuple[SuiteConfig, str]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--short', action='store_true', help='the CI version: a few trials of two kinds')
  parser.add_argument('--kinds', default='', help=f'comma-separated subset of {",".join(KINDS)}')
  for field in dataclasses.fields(SuiteConfig):
    if field.name != 'kinds':
      parser.add_argument(f'--{field.name}', type=type(field.default), default=None)
  parser.add_argument('--out', default='')
  args = parser.parse_args(argv)
  suite = SHORT if args.short else SuiteConfig()
  changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(SuiteConfig) if getattr(args, f.name, None)}
  changes.pop('kinds', None)
  if args.kinds:
    kinds = tuple(k for k in args.kinds.split(',') if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
      parser.error(f'--kinds: no fault kind {", ".join(unknown)}; kinds: {", ".join(KINDS)}')
    changes['kinds'] = kinds
  return dataclasses.replace(suite, **changes), args.out


def merge(paths: Sequence[str]) -> Dict:
  """One table from several suite outputs (kinds run as separate invocations, side by side or one after another):
  their rows and records side by side, each row keeping the suite settings and source file it came from."""
  rows, records, suites = [], {}, []
  for path in paths:
    with open(path) as f:
      table = json.load(f)
    suites.append({'file': os.path.basename(path), **table['suite'], 'partial': bool(table.get('partial'))})
    for row in table['rows']:
      rows.append({**row, 'from': os.path.basename(path)})
    for kind, out in table.get('records', {}).items():
      records.setdefault(kind, []).extend(out)
  kill_rows = [r for r in rows if r['kind'] in KILL_KINDS]
  return {
      'suites': suites,
      'rows': rows,
      'total_kills': sum(r.get('kills', 0) for r in kill_rows),
      'all_survived': all(r.get('survived') == r.get('trials') for r in rows if r.get('trials')),
      'records': records
  }


def main(argv: Optional[Sequence[str]] = None) -> int:
  if argv is None:
    argv = sys.argv[1:]
  if argv and argv[0] == 'merge':  # python -m experiments.faults merge OUT IN [IN ...]
    table = merge(argv[2:])
    with open(argv[1], 'w') as f:
      json.dump(table, f, indent=2)
    print(json.dumps({k: v for k, v in table.items() if k != 'records'}, indent=2))
    return 0 if table['all_survived'] else 1
  suite, out = _parse(argv)
  with tempfile.TemporaryDirectory(prefix='ebrl_faults_') as root:
    table = run_suite(suite, root, checkpoint_to=out)
  print(json.dumps({k: v for k, v in table.items() if k != 'records'}, indent=2))
  if out:
    with open(out, 'w') as f:
      json.dump(table, f, indent=2)
  return 0 if table['all_survived'] else 1


if __name__ == '__main__':
  sys.exit(main())
