"""--launcher=local: N cells of this command on one host, watched.

The launcher starts `python -m ebrl_jax.main <the same flags> --process_id=k` for k in 0..N-1 with rank 0's
coordinator on localhost at a free port (on a GPU host, cell k sees GPU k only: CUDA_VISIBLE_DEVICES, by UUID; with
--pin_cpus each cell gets its own share of the host's cores, which its planner splits between its workers), and
watches them (`watch`, which --launcher=ray shares: runtime/ray_launch.py); it never imports JAX. A cell that dies stops the others: they notice at their next all-reduce and exit
naming it (`runtime.distributed.failed_rank`); the launcher measures how long that took, ends what is left (SIGTERM,
then SIGKILL), and returns one `FATAL:` line naming the rank, its host and pid. Rank 0 writes the checkpoints, so
what it committed stays loadable for `--resume`, with any number of cells. A stop of the launcher (SIGTERM,
Ctrl-C) is passed on to every cell, whose ranks agree to stop after one step (`trainer.ranks`: rank 0 saves a
checkpoint there, each rank writes its summary); the launcher waits up to STOP_GRACE_S for them (longer for rank
0's checkpoint save: runtime/stop_grace.py) and returns one `STOPPED:` line. No cell outlives the launcher (`PR_SET_PDEATHSIG`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import stop_grace

GRACE_S = 10.0  # after SIGTERM, before SIGKILL
STOP_GRACE_S = 120.0  # after a stop passed on to the cells (they end their step, write their summaries), besides
# rank 0's checkpoint save there: as long as the run's saves took, and while it is written (runtime/stop_grace.py)
_STOPPED = {128 + signal.SIGTERM: 'SIGTERM', 128 + signal.SIGINT: 'SIGINT'}  # a cell's exit code after a stop
NOTICE_S = 10.0  # beyond 2 heartbeat timeouts: how long the other cells are given to notice a cell that died
SUMMARY_WAIT_S = 3.0  # how long a cell that ended on a stop's exit code is given to show its summary (`_agreed_stop`)


def free_port(interface: str = '127.0.0.1') -> int:
  """A TCP port free on `interface` ('': every interface, for a coordinator other hosts reach)."""
  with socket.socket() as s:
    s.bind((interface, 0))
    return s.getsockname()[1]


def gpu_ids(platform: str) -> List[str]:
  """The GPUs this host gives its cells (CUDA_VISIBLE_DEVICES' entries, else nvidia-smi's GPUs by UUID); none with
  --platform=cpu, with no --platform and JAX_PLATFORMS naming no GPU platform (JAX_PLATFORMS=cpu; a --platform
  overrides it in each cell: `startup.configure_jax`), or with CUDA_VISIBLE_DEVICES empty or -1 (CUDA sees no GPU
  past an entry of -1). A UUID names the same GPU under the cell's own MPS daemon, which renumbers its visible
  GPUs from 0 (an index would not)."""
  platforms = [p.strip().lower() for p in (platform or os.environ.get('JAX_PLATFORMS', '')).split(',') if p.strip()]
  if platforms and not set(platforms) & {'cuda', 'gpu', 'rocm'}:
    return []
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  if visible is not None:
    entries = [g.strip() for g in visible.split(',')]
    shown = entries[:next((i for i, g in enumerate(entries) if g.startswith('-')), len(entries))]
    return [g for g in shown if g]
  if shutil.which('nvidia-smi') is None:
    return []
  try:
    out = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True, timeout=30, check=False).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  gpus = [line for line in out.splitlines() if line.startswith('GPU ')]
  return [m.group(1) if (m := re.search(r'UUID: (GPU-[0-9a-fA-F-]+)', g)) else str(i) for i, g in enumerate(gpus)]


def cell_cores(cores: Sequence[int], num: int, index: int) -> List[int]:
  """Cell `index`'s share of this host's `cores` among `num` cells (contiguous, near-equal blocks), so that each
  cell's planner pins its workers inside its own share; all of them where there are fewer cores than cells."""
  if len(cores) < num:
    return list(cores)
  size, extra = divmod(len(cores), num)
  start = index * size + min(index, extra)
  return list(cores[start:start + size + (index < extra)])


def start_cell(command: Sequence[str], env: Dict[str, str], cores: Sequence[int] = (), cwd: Optional[str] = None):
  """One cell as a subprocess: its own process group (a terminal's Ctrl-C reaches the launcher alone, which passes
  it on once), on `cores` (none given: wherever it may run), ended with its launcher (`PR_SET_PDEATHSIG`)."""

  def prepare():
    lifecycle.arm_parent_death_signal()
    if cores:
      os.sched_setaffinity(0, set(cores))

  return subprocess.Popen(list(command), env=env, cwd=cwd, process_group=0, preexec_fn=prepare)  # pylint: disable=subprocess-popen-preexec-fn


def cell_command(argv: Sequence[str], rank: int, num: int, address: str) -> List[str]:
  """This command as cell `rank`: the same flags, the launcher's own replaced (absl: the last value wins)."""
  return [
      sys.executable, '-m', 'ebrl_jax.main', *argv, '--launcher=', f'--coordinator_address={address}',
      f'--num_processes={num}', f'--process_id={rank}'
  ]


def _describe(rc: Optional[int]) -> str:
  if rc is None:
    return 'still running'
  return f'killed by {signal.Signals(-rc).name}' if rc < 0 else f'exit code {rc}'


def _newest_checkpoint(run_dir: str) -> str:
  directory = os.path.join(run_dir, 'checkpoints')
  try:
    steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)  # committed: digits only
  except OSError:
    steps = []
  if not steps:
    return 'no checkpoint had been written, so there is nothing to resume'
  return f'checkpoint {steps[0]} in {directory} is loadable: continue with --resume (with any --num_processes)'


def _end(procs: Sequence[subprocess.Popen], sig: Optional[int], grace_s: float, checkpoints: str = '') -> None:
  """`sig` to every cell still running (None: none), SIGKILL to those left after `grace_s`, every one reaped. With
  `checkpoints` (rank 0's checkpoint directory: a stop, whose step rank 0 saves) the grace also holds the time the
  run's saves took, and goes on while the stop's save is written (runtime/stop_grace.py), up to its cap."""
  for p in procs:
    if sig is not None and p.poll() is None:
      p.send_signal(sig)
  asked = time.time()
  deadline = asked + grace_s + (stop_grace.save_allowance(checkpoints) if checkpoints else 0.0)
  while any(p.poll() is None for p in procs):
    now = time.time()
    if checkpoints:
      deadline = stop_grace.moved_deadline(deadline, asked, grace_s, now, checkpoints)
    if now >= deadline:
      break
    time.sleep(min(0.1, max(0.0, deadline - now)))
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def run_local(argv: Sequence[str],
              num: int,
              platform: str,
              run_dir: str,
              heartbeat_timeout_s: int,
              stop_requested: Callable[[], Optional[str]],
              poll_s: float = 0.1,
              pin_cpus: bool = True) -> int:
  """Starts `num` cells of `argv` and watches them; returns the exit code of the run (0, 3, or a signal's)."""
  gpus = gpu_ids(platform)
  if gpus and num > len(gpus):
    print(
        f'FATAL: --launcher=local --num_processes={num}: this host gives {len(gpus)} GPUs ({",".join(gpus)}); '
        'one cell per GPU.',
        file=sys.stderr)
    return 2
  address, host = f'127.0.0.1:{free_port()}', socket.gethostname()
  cores = sorted(os.sched_getaffinity(0))
  procs = []
  for rank in range(num):
    env = dict(os.environ, **({'CUDA_VISIBLE_DEVICES': gpus[rank]} if gpus else {}))
    procs.append(
        start_cell(cell_command(argv, rank, num, address), env,
                   cell_cores(cores, num, rank) if pin_cpus else ()))
  print(
      f'--launcher=local: {num} cells on {host} (coordinator {address}), pids '
      f'{", ".join(f"rank {r}: {p.pid}" for r, p in enumerate(procs))}.',
      file=sys.stderr,
      flush=True)
  return watch(procs, [host] * num, run_dir, heartbeat_timeout_s, stop_requested, poll_s)


def watch(procs: Sequence, hosts: Sequence[str], run_dir: str, heartbeat_timeout_s: int,
          stop_requested: Callable[[], Optional[str]], poll_s: float) -> int:
  """Watches the cells `procs` (rank order; `subprocess.Popen`s, or anything with their pid, poll, returncode,
  send_signal, wait and kill) on `hosts` until every one has ended; returns the run's exit code (0, 3, or a
  signal's). A stop asked for is passed on to every cell once, and the cells are given STOP_GRACE_S to stop
  together; a cell that stopped on a signal of its own (its exit code 143 or 130) with the stop its ranks agreed
  on in its summary (`_agreed_stop`) is waited for alike. Rank k > 0 ends such a stop before rank 0 does (rank 0,
  the coordinator, leaves the ranks' end barrier last), and its summary may never show here (--launcher=ray, a
  run_dir not shared): it is held (`_held_decided`) until rank 0's summary (or its own) records the agreed stop,
  or rank 0 ends, a cell fails, or the time the others take to notice a dead rank has passed. A cell that fails
  otherwise, or ends on such a signal without that record (it stopped alone: the others are left in an
  all-reduce), stops the run (`_after_failure`)."""
  num = len(procs)
  exited: Dict[int, float] = {}
  held: Dict[int, float] = {}  # rank k > 0 that ended on a stop's exit code, the agreed stop not yet seen: deadline
  before = [_summary_stamp(run_dir, r) for r in range(num)]  # a summary already there is an earlier run's
  try:
    while len(exited) < num:
      stop = stop_requested()
      if stop:
        print(f'{stop}: passed on to the {num} cells; they stop after one step together (up to {STOP_GRACE_S:.0f} s).',
              file=sys.stderr,
              flush=True)
        _end(procs, signal.Signals[stop], STOP_GRACE_S, os.path.join(run_dir, 'checkpoints'))
        print(_stopped_line(f'{stop} passed on to {num} cells', procs, run_dir), file=sys.stderr, flush=True)
        return 128 + signal.Signals[stop]
      now = time.monotonic()
      new = [r for r, p in enumerate(procs) if r not in exited and p.poll() is not None]
      exited.update({r: now for r in new})
      held.update({r: now + 2 * heartbeat_timeout_s + NOTICE_S for r in new if r and procs[r].returncode in _STOPPED})
      stopped = [
          r for r in new if r not in held and procs[r].returncode in _STOPPED and _agreed_stop(run_dir, r, before[r])
      ]
      failed = [r for r in new if r not in held and r not in stopped and procs[r].returncode != 0]
      if held and not stopped:
        stopped, alone = _held_decided(held, exited, run_dir, before, now, bool(failed))
        failed += alone
      if stopped:  # the others stop after the same step (their exit codes are checked in the line)
        _end(procs, None, STOP_GRACE_S, os.path.join(run_dir, 'checkpoints'))
        what = f'the cells stopped together on {_STOPPED[procs[stopped[0]].returncode]} (sent to a cell, not here)'
        print(_stopped_line(what, procs, run_dir), file=sys.stderr, flush=True)
        return procs[stopped[0]].returncode
      # the cause first: a cell killed by a signal, then one that stopped alone, then an exit code's failure
      failed.sort(key=lambda r: (procs[r].returncode >= 0, r not in held, exited[r], r))
      if failed:
        alone = procs[failed[0]].returncode in _STOPPED  # a stop's exit code, no agreed stop in its summary
        why = (f': {_STOPPED[procs[failed[0]].returncode]}, but {_summary_path(run_dir, failed[0])} records no '
               'stop the ranks agreed on, so it stopped alone') if alone else ''
        return _after_failure(procs, failed[0], exited, hosts[failed[0]], run_dir, heartbeat_timeout_s, poll_s, why)
      time.sleep(poll_s)
  finally:
    _end(procs, signal.SIGTERM, GRACE_S)
  return 0


def _held_decided(held: Dict[int, float], exited: Dict[int, float], run_dir: str, before: Sequence, now: float,
                  failure: bool):
  """The held ranks (`watch`): (every one, if rank 0's summary or its own records the agreed stop; else []) and
  (those that stopped alone, once it is decided: rank 0 has ended, another cell failed or a deadline passed; else
  []). Looked at without waiting until then; at that last look a summary is given SUMMARY_WAIT_S to show."""
  last = failure or 0 in exited or now >= min(held.values())
  wait_s = SUMMARY_WAIT_S if last else 0.0
  if _agreed_stop(run_dir, 0, before[0], wait_s) or any(_agreed_stop(run_dir, r, before[r], 0.0) for r in held):
    return sorted(held, key=exited.get), []
  return [], (sorted(held) if last else [])


def _summary_path(run_dir: str, rank: int) -> str:
  """Where cell `rank` writes its summary.json."""
  return os.path.join(distributed.rank_run_dir(run_dir, rank), 'summary.json')


def _summary_stamp(run_dir: str, rank: int) -> Optional[tuple]:
  try:
    st = os.stat(_summary_path(run_dir, rank))
  except OSError:
    return None
  return st.st_ino, st.st_mtime_ns, st.st_size


def _agreed_stop(run_dir: str, rank: int, before: Optional[tuple], wait_s: Optional[float] = None) -> bool:
  """Whether cell `rank` wrote a summary (another than the one there at `before`, its stamp then) recording the
  stop its ranks agreed on (`extra.cells.stop`, trainer.ranks.stopped_together). Looked for up to `wait_s`
  (default SUMMARY_WAIT_S: a shared filesystem may show another host's new file late)."""
  deadline = time.monotonic() + (SUMMARY_WAIT_S if wait_s is None else wait_s)
  while True:
    stamp = _summary_stamp(run_dir, rank)
    try:
      if stamp is not None and stamp != before:
        with open(_summary_path(run_dir, rank)) as f:
          return bool(json.load(f)['extra']['cells']['stop'])
    except (OSError, ValueError, KeyError, TypeError):
      pass
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.1)


def _stopped_line(what: str, procs: Sequence, run_dir: str) -> str:
  """What a stop passed on to the cells left: how each ended, where rank 0's summary says the run stopped."""
  ends = '; '.join(f'rank {r}: {_describe(p.returncode)}' for r, p in enumerate(procs))
  try:
    with open(os.path.join(run_dir, 'summary.json')) as f:
      summary = json.load(f)
    where = f'stopped ({summary["stopped"]}) at iteration {summary["iterations"]}'
  except (OSError, ValueError, KeyError, TypeError):
    where = 'wrote no summary.json'
  return f'STOPPED: {what} ({ends}); rank 0 {where}. {_newest_checkpoint(run_dir)}.'


def _after_failure(procs,
                   dead: int,
                   exited: Dict[int, float],
                   host: str,
                   run_dir: str,
                   heartbeat_timeout_s: int,
                   poll_s: float,
                   why: str = '') -> int:
  """Cell `dead` failed (`why`: how, beyond its exit code): how fast the others stop on their own (bounded), then
  the rest ended; one FATAL line."""
  died = exited[dead]
  deadline = died + 2 * heartbeat_timeout_s + NOTICE_S
  while True:
    now = time.monotonic()
    exited.update({r: now for r, p in enumerate(procs) if r not in exited and p.poll() is not None})
    if now >= deadline or len(exited) == len(procs):
      break
    time.sleep(poll_s)
  noticed = [
      f'rank {r} after {exited[r] - died:.1f} s ({_describe(procs[r].returncode)})' for r in sorted(exited) if r != dead
  ]
  left = [r for r, p in enumerate(procs) if p.poll() is None]
  _end(procs, signal.SIGTERM, GRACE_S)
  print(
      f'FATAL: cell rank {dead} (pid {procs[dead].pid} on {host}) died ({_describe(procs[dead].returncode)}{why}); '
      f'the other cells stopped: {"; ".join(noticed) or "none on its own"}'
      f'{f"; ranks {left} were still running and were ended" if left else ""}. {_newest_checkpoint(run_dir)}.',
      file=sys.stderr,
      flush=True)
  return 3
