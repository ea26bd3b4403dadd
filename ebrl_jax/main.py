"""Command line: `python -m ebrl_jax.main --flagfile=experiments/quickstart.flags [--flag=value ...]`.

The only module that reads absl flags. Every flag is a field of a dataclass in `ebrl_jax.config`, and takes
its default from there (one source of truth). Invalid values stop the run before any work with one line that
names the flag and the allowed values (exit code 2); a run that fails is one `FATAL:` line (exit code 3); SIGTERM
and Ctrl-C stop the run with its summary written and one `STOPPED:` line (exit codes 143 and 130). The run's
clock starts when this process started (`process_start_unix`).
"""
from __future__ import annotations

import time

_IMPORTED_UNIX = time.time()  # the clock's origin where /proc cannot say when the process started

import signal  # pylint: disable=g-import-not-at-top,wrong-import-order

# A stop (SIGTERM, or Ctrl-C's SIGINT) that arrives while modules load is held until they have: an interrupt
# inside an import surfaces as some other ImportError with a traceback, and leaves half-initialised modules.
_PENDING_STOP = []


def _hold_stop(signum, frame) -> None:
  del frame
  _PENDING_STOP.append(signal.Signals(signum).name)


if __name__ == '__main__':  # the command line only: a process that imports this module keeps its own handlers
  for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _hold_stop)

# pylint: disable=wrong-import-position
import dataclasses
import logging as std_logging
import os
import sys
import typing
from typing import Dict, Tuple, Type

from absl import app
from absl import flags

from ebrl_jax import config as config_lib
from ebrl_jax import config_checks
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import launch
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import ray_launch
from ebrl_jax.runtime import storage
# pylint: enable=wrong-import-position

EXIT_USAGE, EXIT_FAILED = 2, 3
EXIT_SIGNAL = {'SIGTERM': 128 + signal.SIGTERM, 'SIGINT': 128 + signal.SIGINT}  # 143, 130: as a shell reports them

# (section of Config, dataclass, {field name: flag name} where they differ)
_SECTIONS: Tuple[Tuple[str, Type, Dict[str, str]], ...] = (
    ('sim', config_lib.SimConfig, {}),
    ('policy', config_lib.PolicyConfig, {
        'kind': 'policy'
    }),
    ('algo', config_lib.AlgoConfig, {
        'name': 'algo'
    }),
    ('schedule', config_lib.ScheduleConfig, {
        'name': 'schedule'
    }),
    ('resources', config_lib.ResourceConfig, {}),
    ('cells', config_lib.CellConfig, {}),
)
_HELP = {
    'policy_ratio': ('PPO/GRPO ratio of a policy step: joint (pi/pi_old of the whole step, as Brax) or geometric '
                     '(its geometric mean per action value, the log-ratio divided by chunk x action size, as GSPO '
                     'does per token: the token policy\'s 12-token joint ratio clips most samples).'),
    'task': (f'Task to train on: {", ".join(config_lib.TASKS)}, or {config_lib.PLAYGROUND_PREFIX}NAME for a MuJoCo '
             'Playground env (the playground extra; --backend=mjx or mjx_warp).'),
    'randomize': ('Domain randomisation drawn per env at reset, name=lo:hi,...: '
                  f'{", ".join(config_lib.RANDOMIZE_PARAMS)} (e.g. friction=0.8:1.2,mass=0.9:1.1,color=0.5:1); every '
                  'backend, the project\'s own tasks; empty: off.'),
    'backend':
        f'Simulator: {", ".join(config_lib.BACKENDS)} (mjx runs on the accelerator).',
    'obs': (f'Observations: {", ".join(config_lib.OBS_MODES)}. pixels: stacked uint8 RGB frames of the task\'s '
            'fixed camera beside the state (--pixel_state), --task=push_cube, rendered by native MuJoCo '
            '(--backend=mujoco_cpu) or by MJX on the GPU (--backend=mjx_warp).'),
    'image_size':
        'With --obs=pixels: the side of the square camera frames, in pixels.',
    'frame_stack':
        'With --obs=pixels: camera frames per observation, stacked on the channel axis, newest last.',
    'pixel_depth': ('With --obs=pixels: a uint8 depth channel after each frame\'s RGB (0..2 m), 4 channels a frame; '
                    'on mujoco_cpu and mjx_warp.'),
    'pixel_state': ('With --obs=pixels: the state values beside the frames: full (the task\'s whole observation, '
                    'object and target positions too) or proprio (the robot\'s own: push_cube\'s arm joints and '
                    'fingertip, so the cube and the target are seen in the frames only).'),
    'solver_iterations': ('Cap on the constraint solver\'s iterations per physics step (MjOption.iterations), every '
                          'backend; 0: the task\'s own (Brax\'s 1 for ant/humanoid, MuJoCo\'s 100 otherwise). MJX '
                          'iterates until every env of the batch converges.'),
    'ls_iterations': ('Cap on the solver\'s linesearch iterations (MjOption.ls_iterations), every backend; 0: the '
                      'task\'s own (Brax\'s 4 for ant/humanoid, MuJoCo\'s 50 otherwise). MJX computes all of them '
                      'for every env.'),
    'vision_encoder': ('With --obs=pixels: cnn (IMPALA CNN: its d_model features beside the state for --policy=mlp, '
                       'its feature map as tokens for transformer/token) or patches (ViT patch tokens).'),
    'cnn_channels':
        'With --obs=pixels and --vision_encoder=cnn: the IMPALA CNN\'s stage widths.',
    'cnn_blocks':
        'With --obs=pixels and --vision_encoder=cnn: residual blocks per CNN stage.',
    'patch_size':
        'With --obs=pixels and --vision_encoder=patches: the side of a ViT patch, in pixels.',
    'policy':
        f'Policy network: {", ".join(config_lib.POLICIES)}.',
    'num_bins':
        'Token policy: discrete bins per action dimension (bin centres span [-1, 1]).',
    'compute_dtype': (f'Activation dtype of the transformer and token policies and of every pixel encoder (the MLP '
                      f'policy\'s CNN too): {", ".join(config_lib.COMPUTE_DTYPES)} (params, optimizer state, the MLP '
                      'heads and log-probs stay float32).'),
    'critic': (f'Value network of the transformer and token policies: {", ".join(config_lib.CRITICS)} (shared: a value '
               'head on the policy trunk; mlp: a separate MLP of --value_hidden_sizes on the state; auto: mlp, or '
               'shared with --obs=pixels).'),
    'algo':
        f'Algorithm: {", ".join(config_lib.ALGORITHMS)}.',
    'learning_rate_end': ('A linear decay of the learning rate from --learning_rate to this over '
                          '--learning_rate_decay_updates gradient steps, then held (unset: constant).'),
    'learning_rate_decay_updates': ('--learning_rate_end: gradient steps of the decay (0: the whole run\'s, iterations '
                                    'x --num_updates_per_batch x --num_minibatches).'),
    'learning_rate_warmup_updates': ('A linear warm-up of the learning rate from 0 over this many gradient steps (0: '
                                     'none; with --learning_rate_end the decay follows it). Adam\'s first steps move '
                                     'every parameter by the whole rate: W2\'s first one moved its policy by approx KL '
                                     '~1.7.'),
    'grad_clip_scope': (f'What --max_grad_norm clips: {", ".join(config_lib.GRAD_CLIP_SCOPES)} (global: all gradients '
                        'as one vector, as Brax; per_network: the policy\'s and the critic\'s apart, so a critic loss '
                        'spike does not shrink the policy\'s step; needs a critic of its own, --critic=mlp).'),
    'max_update_kl': ('PPO/GRPO: a minibatch step that raises the approx KL to the proximal policy by more than this '
                      '(above its value at the iteration\'s first step) is undone and the iteration\'s later steps '
                      'leave the network as it is; Adam\'s statistics take in every step\'s gradient (unset: off; '
                      'SB3\'s target_kl, which stops the epochs without undoing, is a related idea).'),
    'value_norm_rate': ('PPO: PopArt value normalisation: the critic regresses value targets normalised by running '
                        'statistics (each iteration\'s batch moves their mean and second moment by this rate; the '
                        'first sets them), its output layer rescaled so its values in return units are kept when they '
                        'move (unset: off; needs a critic with one output unit).'),
    'schedule':
        f'Schedule: {", ".join(config_lib.SCHEDULES)}.',
    'num_envs':
        'Environments simulated in parallel.',
    'num_timesteps':
        'Environment steps to train for.',
    'target_return':
        'Stop once the evaluation return reaches this.',
    'run_dir':
        'Directory for metrics.jsonl, TensorBoard events, checkpoints and summary.json.',
    'compilation_cache_dir':
        "JAX's persistent compilation cache; '' disables it.",
    'trace_cache': ('Keep the MJX programs\' traces (jax.export) inside --compilation_cache_dir, so a warm start '
                    'skips Python tracing; --notrace_cache traces at every start.'),
    'resume':
        'Continue the run in --run_dir from its newest intact checkpoint.',
    'calibration_budget_s': ('--plan/--schedule=auto: seconds from process start the stage calibration may take '
                             '(0: a third of --max_wall_s when set, else 900 s a process); quotas past it are '
                             'skipped, and with none calibrated auto runs fused and --plan stops.'),
    'auto_trial_s': ('--schedule=auto: seconds of training (after its start-up) a chosen sync/async layout runs '
                     'as a trial, and fused after it, before the run commits to one; the layout is kept only if it '
                     'measured more than 2 % faster, else the run goes on as fused; the verdict is kept beside the '
                     'profile store (0: no trial).'),
    'max_train_s': ('Seconds of training, start-up excluded (the span the end-to-end rate counts; 0: none); the '
                    'run stops cleanly after it, as at --max_wall_s.'),
    'max_wall_s':
        'Wall-clock budget in seconds from process start (0: none); the run stops cleanly after it.',
    'deterministic': ('sync/async: a repeatable run: each group acts with exactly the version its iteration is '
                      'due (--max_staleness behind) and the trainer takes every group\'s segment of each '
                      'iteration in group order.'),
    'group_schedule': ('sync/async: live changes of the number of env groups, iteration:groups=G,... (e.g. '
                       '10:groups=4): warm standbys in the new layout, swapped in at an iteration boundary.'),
    'replan_groups': ('sync/async: group counts the re-planner may switch the env groups to while the run goes on '
                      '(e.g. 1,2,4), from measured step times; changes as --group_schedule\'s, decisions in '
                      'summary.extra.relayout.'),
    'replan_window': ('--replan_groups: trainer iterations of one measured window (one decision after each; one '
                      'iteration skipped after the start and each change).'),
    'replan_horizon_s': ('--replan_groups: a change must pay back its pause (env steps lost) within this many seconds '
                         '(or the run\'s remaining time); --replan_hysteresis is its margin.'),
    'replan_group_change_cost_s':
        ('--replan_groups: the pause (s) a first group change is assumed to cost, until one is '
         'measured; 8 s is the largest measured so far (3.5-7.8 s, replan_groups_cpu.json), '
         'where --replan_change_cost_s (30 s, the quota re-planner\'s) made a first change need a '
         '>2x predicted gain over the 60 s horizon.'),
    'first_checkpoint_iteration':
        'A first checkpoint after this many iterations (0: only --checkpoint_every).',
    'evaluator':
        'sync/async/overlap: who evaluates the published versions: process (an evaluator process) or trainer.',
    'evaluator_wait_s':
        "--evaluator=process: seconds the run's end waits for the outstanding evaluations.",
    'launcher': ("'': this process is one cell (trainer rank with its own envs) of --num_processes; local: start "
                 '--num_processes cells of this command on this host (one per GPU) and watch them; ray: place them '
                 "over a Ray cluster's nodes (RAY_ADDRESS), one host agent per node (the ray extra)."),
    'num_processes':
        'Cells (trainer ranks) of the run; 0: JAX_NUM_PROCESSES or SLURM_NTASKS, else 1.',
    'coordinator_address':
        'host:port of rank 0\'s jax.distributed coordinator; \'\': JAX_COORDINATOR_ADDRESS.',
    'process_id':
        "This cell's rank in [0, --num_processes); -1: JAX_PROCESS_ID or SLURM_PROCID.",
    'heartbeat_timeout_s':
        'Seconds of silence after which the ranks declare a cell dead.',
    'init_timeout_s':
        "Seconds a cell waits for the others to join (rank k > 0 first waits that long for rank 0's coordinator).",
    'colocate_generation': ('sync/async: act inside each rollout worker (True) or in one generation worker that '
                            'batches every group\'s requests (False; native MuJoCo or MJX groups).'),
    'generation_transport':
        ('MJX groups with --nocolocate_generation: how observations and actions cross: host '
         '(shared-memory mailbox), cuda_ipc (device buffers through CUDA IPC; needs CuPy and a '
         'GPU; right on the H200 but slower in a run) or auto (host, while IPC runs measure slower).'),
    'plan_generation': ('With --plan or --schedule=auto on MJX: also choose co-located or separate generation from '
                        'the profiles (the reason goes to summary.extra).'),
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines one flag per config field on `flag_values` (a fresh FlagValues lets tests parse in isolation)."""
  for _, cls, renames in _SECTIONS:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
      name = renames.get(field.name, field.name)
      default, hint = field.default, hints[field.name]
      help_text = _HELP.get(name, f'{cls.__name__}.{field.name}')
      if hint is bool:
        flags.DEFINE_bool(name, default, help_text, flag_values=flag_values)
      elif hint is int:
        flags.DEFINE_integer(name, default, help_text, flag_values=flag_values)
      elif hint is float or hint == typing.Optional[float]:
        flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
      elif hint is str:
        flags.DEFINE_string(name, default, help_text, flag_values=flag_values)
      elif hint == Tuple[int, ...]:
        flags.DEFINE_list(name, [str(v) for v in default], help_text, flag_values=flag_values)
      else:
        raise TypeError(f'no flag type for {cls.__name__}.{field.name}: {hint}')


define_flags()
FLAGS = flags.FLAGS


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> config_lib.Config:
  """Builds the frozen Config from parsed flags. Raises ValueError naming the offending flag."""
  sections = {}
  for section, cls, renames in _SECTIONS:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
      name = renames.get(field.name, field.name)
      value = flag_values[name].value
      if hints[field.name] == Tuple[int, ...]:
        try:
          value = tuple(int(v) for v in value)
        except ValueError as e:
          raise ValueError(f'--{name}={",".join(value)} must be a comma-separated list of integers.') from e
      kwargs[field.name] = value
    sections[section] = cls(**kwargs)
  return config_lib.Config(**sections)


def process_start_unix(now_unix: float = None) -> float:
  """When this process started (`time.time()` seconds): its start tick in /proc/self/stat against
  CLOCK_BOOTTIME (10 ms resolution). Where /proc cannot say, or the process is older than this run (main()
  called inside a longer-lived process), the time this module was imported."""
  now_unix = time.time() if now_unix is None else now_unix
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, starttime
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, AttributeError):
    return _IMPORTED_UNIX
  since_import = now_unix - _IMPORTED_UNIX
  return now_unix - age if since_import <= age <= since_import + 5.0 else _IMPORTED_UNIX


def _usage_error(message: str) -> int:
  """A bad invocation: one line naming the flag, and where the full list is."""
  print(f'FATAL: {" ".join(str(message).split())} (--helpfull lists every flag)', file=sys.stderr)
  return EXIT_USAGE


def parse_flags(argv):
  """absl's parser, with a parse error as one line instead of a traceback or the flag list."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    sys.exit(_usage_error(str(e)))
  except SystemExit as e:  # absl's --help / --helpfull / --helpshort print the flags and exit 1: asked for, success
    sys.exit(0 if e.code == 1 else e.code)


def _stop_line(cfg: config_lib.Config, summary) -> str:
  """What a stopped run leaves: where it stopped, its summary, and the checkpoint --resume continues from (rank k
  > 0 of several cells: its summary under --run_dir/rank<k>/, the checkpoints are rank 0's)."""
  step = summary.extra.get('last_checkpoint')
  directory = os.path.join(cfg.schedule.run_dir, 'checkpoints')
  rank = (summary.extra.get('cells') or {}).get('rank', 0)
  run_dir = distributed.rank_run_dir(cfg.schedule.run_dir, rank)
  if rank:
    resume = f'rank 0 writes the checkpoints ({directory}; its line says which one --resume continues from)'
  elif step is not None:
    resume = f'checkpoint {step} in {directory} is loadable: continue with --resume'
  elif not cfg.schedule.checkpoint_every:
    resume = 'checkpoints are off (--checkpoint_every=0), so there is nothing to resume'
  else:
    resume = 'no checkpoint had been written yet (see --first_checkpoint_iteration), so there is nothing to resume'
  return (f'STOPPED: {summary.stopped} at env step {summary.env_steps:,} (iteration {summary.iterations}); '
          f'{os.path.join(run_dir, "summary.json")} holds the run so far; {resume}.')


def _os_error_line(cfg: config_lib.Config, error: OSError) -> str:
  """One line for an OS error that stopped the run: what failed, the run directory, and what --resume can load."""
  run_dir = os.path.abspath(cfg.schedule.run_dir)
  full = storage.disk_full(error)
  if full is not None:
    return f'the disk holding {run_dir} is full ({full}); the run stopped. ' + storage.resume_advice(run_dir)
  return (f'the run in {run_dir} stopped on an operating-system error ({type(error).__name__}: {error}). ' +
          storage.checkpoint_advice(run_dir, 'mend what it names'))


def main(argv):
  code = _main(argv)
  if distributed.joined():  # a cell: JAX's shutdown at exit would wait for every rank, and one may be gone
    distributed.exit_now(code)
  return code


def _pending_stop():
  return _PENDING_STOP[0] if _PENDING_STOP else None


def _main(argv):
  start_unix = process_start_unix()
  held = {s: signal.signal(s, _hold_stop) for s in (signal.SIGINT, signal.SIGTERM)}
  if len(argv) > 1:
    return _usage_error(f'Unexpected positional arguments: {" ".join(argv[1:])}')
  try:
    cfg = config_from_flags()
  except ValueError as e:
    return _usage_error(str(e))
  for warning in config_checks.no_effect(cfg):  # harmless flags the run does not read (errors: config's checks)
    std_logging.getLogger(__name__).warning(warning)
  # PyOpenGL (imported by mujoco when MUJOCO_GL is set, as headless rendering asks) logs at INFO that it runs
  # without its optional accelerator: a line before every message of the run, an error's included.
  std_logging.getLogger('OpenGL').setLevel(std_logging.WARNING)
  if cfg.cells.launcher == 'local':  # this process only starts and watches the cells: no JAX here
    return launch.run_local(sys.argv[1:],
                            cfg.cells.num_processes,
                            cfg.resources.platform,
                            cfg.schedule.run_dir,
                            cfg.cells.heartbeat_timeout_s,
                            _pending_stop,
                            pin_cpus=cfg.resources.pin_cpus)
  if cfg.cells.launcher == 'ray':  # this process places the cells over the Ray cluster and watches them
    try:
      ray_launch.require_ray()
    except ValueError as e:
      return _usage_error(str(e))
    return ray_launch.run_ray(sys.argv[1:], cfg.cells.num_processes, cfg.resources.platform, cfg.schedule.run_dir,
                              cfg.cells.heartbeat_timeout_s, _pending_stop)
  from ebrl_jax import controller  # lazy: a flag error is reported before JAX and the simulators load
  # lazy: loaded while stops are held: trimesh (under MJX's and Brax's loaders) wraps its optional imports in
  # `except BaseException`, which swallowed a Ctrl-C or SIGTERM that came while it loaded later, in start-up
  import brax.io.mjcf  # pylint: disable=unused-import,g-import-not-at-top
  interrupt = held[signal.SIGINT]  # Python's own KeyboardInterrupt, unless a caller installed another handler
  try:
    # From here on SIGTERM stops the run as Ctrl-C does, and neither is swallowed by a callback (lifecycle).
    with lifecycle.stop_signals_as_interrupt():
      signal.signal(signal.SIGINT, signal.default_int_handler if interrupt in (_hold_stop, None) else interrupt)
      if _PENDING_STOP:  # held while modules loaded; asked once the handlers are in, so none slips between
        print(f'STOPPED: {_PENDING_STOP[0]} before the run started; nothing was written.', file=sys.stderr)
        return EXIT_SIGNAL[_PENDING_STOP[0]]
      summary = controller.run(cfg, start_unix=start_unix)
  except KeyboardInterrupt as interrupt:  # before the run had a summary to write
    reason = errors.stop_reason(interrupt)
    print(f'STOPPED: {reason} before the run had written its summary.', file=sys.stderr)
    return EXIT_SIGNAL[reason]
  except ValueError as e:  # found before any worker started: --resume without a checkpoint, a bad --run_dir, ...
    print(f'FATAL: {e}', file=sys.stderr)
    return EXIT_USAGE
  except errors.RunError as e:  # e.g. the trainer worker died: children stopped, shared memory freed
    print(f'FATAL: {e}', file=sys.stderr)
    return EXIT_FAILED
  except OSError as e:  # one no writer of the run named (those are a DiskFull, or a ValueError before any worker)
    std_logging.getLogger(__name__).debug('the OS error that stopped the run', exc_info=True)
    print(f'FATAL: {_os_error_line(cfg, e)}', file=sys.stderr)
    return EXIT_FAILED
  if summary.stopped in EXIT_SIGNAL:
    print(_stop_line(cfg, summary), file=sys.stderr)
    return EXIT_SIGNAL[summary.stopped]
  return 0


def run_main():
  app.run(main, flags_parser=parse_flags)


if __name__ == '__main__':
  run_main()
