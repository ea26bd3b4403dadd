"""Entry point of the controller: `run(config)` checks everything a run can fail on before anything starts or is
written, configures JAX, runs the schedule by name with telemetry alongside, and writes `<run_dir>/summary.json`
— the one writer of the summary, also of a run stopped by SIGTERM, Ctrl-C or --max_wall_s, and of one whose trainer
worker died (from what it had logged)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Dict, Optional

from absl import logging
import jax

from ebrl_jax import config as config_lib
from ebrl_jax import config_resources
from ebrl_jax.controller import auto
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import fused
from ebrl_jax.controller import pipeline
from ebrl_jax.controller import resume_check
from ebrl_jax.resources import mps
from ebrl_jax.resources import telemetry as telemetry_lib
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import metrics
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import storage
from ebrl_jax.runtime import tracing
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import registry
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver

RunError = errors.RunError
# A run stopped on a failure (its summary's `stopped`): the error the runner raises once the summary is written,
# what happened, and what to change before --resume.
_FAILURES = {
    errors.DIVERGED: (errors.Diverged, 'training diverged', None),  # what --resume accepts: resume_check's advice
    errors.OUT_OF_MEMORY: (errors.OutOfMemory, 'out of memory', errors.OUT_OF_MEMORY_FIX),
    errors.WORKER_FAILED: (errors.WorkerFailure, 'a worker failed', 'mend what its error names'),
    errors.TRAINER_DIED: (errors.TrainerDied, None, ''),  # its words name the trainer
}
_PSEUDO_FILESYSTEMS = ('/proc', '/sys', '/dev')


def _run_fused(cfg: config_lib.Config, pids: Dict[str, int], start: run_clock.StartClock) -> driver.RunSummary:
  del pids  # one process: the controller itself
  return fused.run(cfg, start)


# Schedule registry: every name in config.SCHEDULES. A schedule gets the config, the role -> pid map that
# telemetry watches (it adds its workers as it starts them) and the run's clock.
SCHEDULES: Dict[str, Callable[[config_lib.Config, Dict[str, int], run_clock.StartClock], driver.RunSummary]] = {
    'fused': _run_fused,
    'sync': pipeline.run,
    'async': pipeline.run,
    'overlap': pipeline.run,
    'auto': auto.run
}


def _add_telemetry_and_trace(cfg: config_lib.Config, summary: driver.RunSummary,
                             telemetry_means: Optional[dict]) -> None:
  extra = summary.extra
  if telemetry_means is not None:
    extra['telemetry'] = telemetry_means
    shown = {k: round(v, 1) for k, v in telemetry_means.items() if isinstance(v, float)}
    logging.info('telemetry means: %s', shown)
  if cfg.schedule.trace_dir and tracing.merge(cfg.schedule.trace_dir):
    extra['stage_ms'] = tracing.summarize(cfg.schedule.trace_dir)
    for name, s in sorted(extra['stage_ms'].items()):
      logging.info('%s: %d spans, %.1f ms total, %.3f ms mean', name, s['count'], s['total_ms'], s['mean_ms'])


def write_summary(cfg: config_lib.Config, summary: driver.RunSummary) -> str:
  """Writes the summary atomically; a full disk is a `DiskFull` naming the file (the checkpoints stay whole) and how
  the run ended (a stop's summary is written too)."""
  path = os.path.join(cfg.schedule.run_dir, 'summary.json')
  try:
    storage.write_json(path, dataclasses.asdict(summary), indent=2)
  except OSError as e:
    reason = storage.disk_full(e)
    if reason is None:
      raise
    run_dir = os.path.abspath(cfg.schedule.run_dir)
    raise errors.DiskFull(f'{how_it_ended(summary.stopped)}, but the disk holding {run_dir} is full ({reason}): '
                          f'{path} was not written. ' + storage.resume_advice(run_dir)) from e
  return path


def how_it_ended(stopped: str) -> str:
  """'the run finished', or why it stopped, in words, from the summary's `stopped`."""
  if stopped in driver.FINISHED:
    return 'the run finished'
  if stopped in driver.BUDGETS:
    return f'the run stopped at its --{stopped} budget'
  if stopped in errors.STOP_SIGNALS:
    return f'the run stopped on {stopped}'
  what = (_FAILURES[stopped][1] or 'the trainer worker died') if stopped in _FAILURES else stopped
  return f'the run stopped ({what})'


def _write_config(cfg: config_lib.Config) -> int:
  """The run's first writes, before any worker starts: its directory (0700), its lock (`storage.lock_run_dir`: a
  run still going there refuses this one first) and config.json. A full disk is a `DiskFull` (exit code 3) naming
  the directory and what --resume can load; any other OS error refuses the --run_dir (a ValueError: exit code 2).
  Either leaves a previous run's config.json as it was (written atomically). Returns the lock's descriptor."""
  run_dir = cfg.schedule.run_dir
  path = os.path.join(run_dir, 'config.json')
  lock = None
  try:
    storage.ensure_private_dir(run_dir)
    lock = storage.lock_run_dir(run_dir)
    storage.write_json(path, dataclasses.asdict(cfg), indent=2)
  except (OSError, ValueError) as e:
    if lock is not None:  # the run does not start: the directory is free again
      os.close(lock)
    reason = storage.disk_full(e)  # ensure_private_dir's ValueError keeps the OS error's text
    if reason is not None:
      raise errors.DiskFull(f'the disk holding {os.path.abspath(run_dir)} is full ({reason}): {path} could not be '
                            'written, so the run did not start. ' + storage.resume_advice(run_dir)) from None
    if isinstance(e, ValueError):
      raise
    raise ValueError(f'--run_dir={run_dir}: {path} cannot be written ({e}); fix the directory or choose another '
                     '--run_dir.') from None
  return lock


def check_run_dir_path(run_dir: str) -> None:
  """Refuses a --run_dir that cannot hold a run: a file, a pseudo-filesystem, or no writable directory above."""
  path = os.path.realpath(os.path.abspath(os.path.expanduser(run_dir)))
  for root in _PSEUDO_FILESYSTEMS:
    if path == root or path.startswith(root + '/'):
      raise ValueError(f'--run_dir={run_dir} lies under {root}, a kernel pseudo-filesystem that holds no run '
                       'files; choose a directory on a disk.')
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    what = 'is a file' if existing == path else f'lies under {existing}, which is a file'
    raise ValueError(f'--run_dir={run_dir} {what}, not a directory; choose a directory.')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f'--run_dir={run_dir}: {existing} is not writable by this user; choose another --run_dir.')


def _check_files(cfg: config_lib.Config) -> None:
  """Files named by flags exist and parse."""
  profile = cfg.resources.memory_profile
  if profile:
    try:
      with open(os.path.expanduser(profile)) as f:
        json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f'--memory_profile={profile} cannot be read ({e}); give the JSON that '
                       'experiments/bench/stage_profile.py --profile_out writes, or drop the flag.') from None


def check_host_memory(cfg: config_lib.Config) -> None:
  """Native MuJoCo: every env the run keeps on this host (the groups' --num_envs and the evaluation's
  --num_eval_envs) against the host's available memory, before any worker starts (ValueError naming the flags).
  Each pool checks itself as it is made, so pools that each fit could together not: the kernel's OOM killer would
  then end one worker (a restart meets the same) or another process."""
  sim = cfg.sim
  if sim.backend != 'mujoco_cpu':
    return
  model = cpu_env.load_model(registry.load(sim.task), (sim.solver_iterations, sim.ls_iterations))
  total = sim.num_envs + sim.num_eval_envs
  cpu_env.check_host_memory(sim.task, model, total, sim.randomization.enabled,
                            f' (the run\'s: --num_envs={sim.num_envs:,} plus --num_eval_envs={sim.num_eval_envs:,})')


def _check_platform(flag: str, environ_value: str) -> None:
  """A GPU asked of JAX (--platform, else JAX_PLATFORMS: every platform listed must start) where NVML sees none:
  refused here, before the run writes a file, instead of JAX's traceback at the run's first array."""
  where = f'--platform={flag}' if flag else f'JAX_PLATFORMS={environ_value}'
  asked = {name.strip() for name in (flag or environ_value).split(',')}
  if not asked & {'gpu', 'cuda'}:
    return
  reason = telemetry_lib.gpu_absent_reason()
  if reason is not None:
    raise ValueError(f'{where} asks JAX for an NVIDIA GPU, but this machine has none ({reason}); run with '
                     '--platform=cpu, or leave --platform and JAX_PLATFORMS unset to let JAX choose.')


def _check_gpu_sharing(cfg: config_lib.Config) -> None:
  """--sm_quotas within 100 % for the processes that run at once; --use_mps only where MPS can run."""
  processes = cfg.schedule.name != 'fused' and cfg.schedule.transport == 'shm'
  if not (processes and cfg.resources.use_mps):
    return
  if not (cfg.resources.plan or cfg.schedule.name == 'auto'):  # these choose groups and unpinned quotas
    rollouts = 0 if cfg.rollout_on_host else cfg.schedule.num_groups
    # The evaluator is counted where --sm_quotas gives it a quota (else it runs at EVALUATOR_QUOTA, outside the sum).
    config_resources.check_quota_sum(
        cfg.resources, {
            'trainer': 1,
            'rollout': rollouts,
            'generation': int(not cfg.schedule.colocate_generation),
            'evaluator': int(cfg.evaluator_process)
        })
  if cfg.resources.platform == 'cpu':
    raise ValueError('--use_mps shares a GPU under NVIDIA MPS, but --platform=cpu runs on no GPU; drop --use_mps '
                     '(and --sm_quotas) or --platform=cpu.')
  if shutil.which(mps.CONTROL) is None:
    raise ValueError(f'--use_mps needs NVIDIA MPS, but {mps.CONTROL} is not on PATH (no NVIDIA driver here?); run '
                     'without --use_mps and --sm_quotas (the workers then share the GPU time-sliced), or install '
                     'the driver.')


def check_before_start(cfg: config_lib.Config) -> Optional[dict]:
  """Every check a run can fail on that needs no worker, before any file of the run directory changes: the
  run directory, files named by flags, GPU sharing, the checkpoints against --resume. Raises ValueError (one
  line: the cause and the fix); returns what --resume continues from."""
  if cfg.schedule.name not in SCHEDULES:
    raise ValueError(f'--schedule={cfg.schedule.name!r} is not valid; allowed values: {", ".join(SCHEDULES)}.')
  check_run_dir_path(cfg.schedule.run_dir)
  _check_files(cfg)
  _check_platform(cfg.resources.platform, os.environ.get('JAX_PLATFORMS', ''))
  _check_gpu_sharing(cfg)
  return resume_check.check_checkpoints(cfg)


def run(cfg: config_lib.Config, start_unix: Optional[float] = None) -> driver.RunSummary:
  """Runs `cfg` with its schedule, with telemetry alongside; writes the run's config.json (the whole config, the
  one place that sees it) and its summary.json, and returns the summary; a run whose loss or return became
  NaN/inf, that ran out of memory, whose worker beside the trainer failed for good or whose trainer worker died
  writes its summary too, then raises `errors.Diverged` / `OutOfMemory` / `WorkerFailure` / `TrainerDied`.
  Every time of the run counts from `start_unix` (`time.time()` at process start: main.py passes it; None: from
  this call)."""
  start = run_clock.StartClock(start_unix or time.time()).mark('imports')  # interpreter, flags, controller imports
  lock = None  # this run's hold on its --run_dir (storage.lock_run_dir), from before it writes there
  try:
    with lifecycle.stop_signals_as_interrupt():
      spec = cells_lib.resolve(cfg)  # the cells of the run: flags, else JAX_* / SLURM's environment
      resumed = check_before_start(cfg)  # nothing is started or written before this
      if resumed is not None:  # its files look whole; its data is read by the trainer, which names the step it restores
        logging.info(
            'Resuming the run in %s: newest checkpoint %d (env step %s, iteration %s)%s; the trainer restores it, or '
            'an older one where its data does not read back, and names the step it restored.', cfg.schedule.run_dir,
            resumed['step'], resumed['env_steps'], resumed['iterations'],
            f', past damaged step(s) {resumed["skipped"]}' if resumed['skipped'] else '')
      startup.configure_jax(cfg.resources.platform, cfg.schedule.compilation_cache_dir)
      cell = cells_lib.join(cfg, spec)  # before JAX starts its backend; rank k > 0 writes under run_dir/rank<k>/
      cfg = cells_lib.rank_config(cfg, cell)
      check_host_memory(cfg)  # this rank's envs, on its host
      lock = _write_config(cfg)
      metrics.quiet_library_logs()
      logged_from = metrics.log_size(cfg.schedule.run_dir)  # this run's records in metrics.jsonl start here
      summary, means = _run_schedule(cfg, start.mark('controller'), cell, logged_from)
    _add_telemetry_and_trace(cfg, summary, means)
    path = write_summary(cfg, summary)
    cells_lib.finish(cell, summary)  # the end barrier of ranks that finished, or stopped together
    if summary.stopped in _FAILURES:
      kind, what, fix = _FAILURES[summary.stopped]
      advice = (storage.checkpoint_advice(cfg.schedule.run_dir, fix)
                if fix is not None else resume_check.divergence_advice(cfg))
      said = summary.extra.get('failure')
      raise kind(f'{f"{what}: " if what else ""}{said}; the run stopped. {path} holds the run so far. ' + advice)
    if summary.stopped not in errors.STOP_SIGNALS:  # a signal's stop is main.py's one line
      final = 'none' if summary.final_eval_return is None else f'{summary.final_eval_return:.1f}'
      logging.info('%s: %d env steps, final eval return %s, %.0f env steps/s, start-up %.1f s, wall %.1f s.',
                   'Finished' if summary.stopped in driver.FINISHED else f'Stopped ({summary.stopped})',
                   summary.env_steps, final, summary.env_steps_per_s, summary.compile_s, summary.wall_s)
    return summary
  finally:
    if lock is not None:
      os.close(lock)


def _run_schedule(cfg: config_lib.Config, start: run_clock.StartClock, cell: cells_lib.Cell, logged_from: int = 0):
  """(summary, telemetry means) of the schedule; a run stopped before its schedule had a summary (SIGTERM or
  Ctrl-C during start-up, a trainer worker that died or sent none: with what it had logged in metrics.jsonl from
  byte `logged_from` on) gets the controller's own. A cell of several runs `fused` as one rank, or `sync` /
  `async` with its trainer worker as the rank; a failed all-reduce in this process is a `distributed.RankFailed`
  naming the rank that died (a trainer worker's comes as its error report)."""
  pids: Dict[str, int] = {}
  telemetry = None
  if cfg.resources.telemetry_period_s > 0:
    telemetry = telemetry_lib.Telemetry(cfg.schedule.run_dir, lambda: {
        'controller': os.getpid(),
        **pids
    }, cfg.resources.telemetry_period_s, cfg.schedule.trace_dir).start()
  try:
    if not cell.multi:
      summary = SCHEDULES[cfg.schedule.name](cfg, pids, start)
    elif cfg.schedule.name == 'fused':
      summary = fused.run(cfg, start, cell)
    else:  # sync / async: the cell's trainer worker is the rank (with --transport=thread, in this process)
      summary = pipeline.run(cfg, pids, start, cell)
  except jax.errors.JaxRuntimeError as e:
    refused = errors.out_of_memory(e)
    if refused is not None:  # before the driver's loop (building envs, say): no summary of its own
      summary = stopped_summary(cfg, errors.OUT_OF_MEMORY, start.unix)
      summary.extra['failure'] = refused
    elif not distributed.joined():  # only a rank's own all-reduce fails here
      raise
    else:
      raise distributed.failed_rank(cell.spec, e) from e
  except errors.WorkerFailure as failure:  # the trainer died, or sent nothing after a worker beside it failed
    stopped = failure.stopped or (errors.TRAINER_DIED
                                  if isinstance(failure, errors.TrainerDied) else errors.WORKER_FAILED)
    summary = stopped_summary(cfg, stopped, start.unix, metrics.read_log(cfg.schedule.run_dir, logged_from))
    summary.extra['failure'] = failure.cause
  except KeyboardInterrupt as interrupt:
    summary = stopped_summary(cfg, errors.stop_reason(interrupt), start.unix,
                              metrics.read_log(cfg.schedule.run_dir, logged_from))
  finally:
    means = telemetry.stop() if telemetry is not None else None
  return summary, means


def _logged_curve(cfg: config_lib.Config, logged: list) -> dict:
  """What a trainer that sent no summary had logged (`metrics.read_log` records of this run): its evaluation curve
  (env steps, run-clock wall_s, return: the versions and training seconds are not logged), where it hit the target,
  its last train metrics and the env steps it reached."""
  curve = [{
      'env_steps': r['env_steps'],
      'wall_s': r.get('wall_s'),
      'return': r['eval/episode_return']
  } for r in logged if isinstance(r.get('eval/episode_return'), (int, float))]
  target = cfg.schedule.target_return
  hit = next((e for e in curve if target is not None and e['return'] >= target), None)
  return {
      'eval_curve': curve,
      'final_eval_return': curve[-1]['return'] if curve else None,
      'best_eval_return': max(e['return'] for e in curve) if curve else None,
      'env_steps_to_target': hit['env_steps'] if hit else None,
      'wall_s_to_target': hit['wall_s'] if hit else None,
      'last_metrics': next((r for r in reversed(logged) if any(k.startswith('train/') for k in r)), None),
      'env_steps': max((r['env_steps'] for r in logged), default=0)
  }


def stopped_summary(cfg: config_lib.Config,
                    stopped: str,
                    start_unix: float,
                    logged: Optional[list] = None) -> driver.RunSummary:
  """The controller's summary of a run stopped before it had one (during start-up, or a trainer that sent none):
  the counts of the newest intact checkpoint (what the run keeps), else zeros; with `logged` (the trainer's records
  of this run in metrics.jsonl) also its curve, its last train metrics and the env steps it reached."""
  directory = os.path.join(cfg.schedule.run_dir, 'checkpoints')
  steps = [s for s in checkpoint.committed_steps(directory) if checkpoint.damage(directory, s) is None]
  saved = checkpoint.read_extra(directory, steps[0]) if steps else {}
  env_steps, iterations = int(saved.get('env_steps', 0)), int(saved.get('iterations', 0))
  wall = time.time() - start_unix
  extra = {
      'summary_from': 'the controller: stopped before the trainer sent a summary; the counts are those of the '
                      'newest intact checkpoint',
      'last_checkpoint': steps[0] if steps else None
  }
  found = _logged_curve(cfg, logged or [])
  if logged:
    extra['summary_from'] = ('the controller, from what the trainer had logged in metrics.jsonl (it sent no '
                             'summary): the curve, the last train metrics and the env steps they reached; the '
                             'iterations counted from the newest intact checkpoint\'s at the run\'s env steps per '
                             'iteration')
    extra['last_metrics'] = found['last_metrics']
    if found['env_steps'] > env_steps:
      iterations += (found['env_steps'] - env_steps) // cfg.env_steps_per_iteration
      env_steps = found['env_steps']
  return driver.RunSummary(env_steps=env_steps,
                           iterations=iterations,
                           wall_s=wall,
                           compile_s=wall,
                           train_wall_s=0.0,
                           env_steps_per_s=0.0,
                           final_eval_return=found['final_eval_return'],
                           best_eval_return=found['best_eval_return'],
                           target_return=cfg.schedule.target_return,
                           env_steps_to_target=found['env_steps_to_target'],
                           wall_s_to_target=found['wall_s_to_target'],
                           train_s_to_target=None,
                           eval_curve=found['eval_curve'],
                           num_params=0,
                           schedule=cfg.schedule.name,
                           backend=cfg.sim.backend,
                           task=cfg.sim.task,
                           device='',
                           extra=extra,
                           stopped=stopped,
                           start_unix=start_unix)
