"""Command line: `python -m ebrl_jax.main --flagfile=experiments/quickstart.flags [--flag=value ...]`.

The only module that reads absl flags. Every flag is a field of a dataclass in `ebrl_jax.config`, and takes
its default from there (one source of truth). Invalid values stop the run before any work with one message that
names the flag and the allowed values.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Dict, Tuple, Type

from absl import app
from absl import flags
from absl import logging

from ebrl_jax import config as config_lib

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
)
_HELP = {
    'task': f'Task to train on: {", ".join(config_lib.TASKS)}.',
    'backend': f'Simulator: {", ".join(config_lib.BACKENDS)} (mjx runs on the accelerator).',
    'policy': f'Policy network: {", ".join(config_lib.POLICIES)}.',
    'num_bins': 'Token policy: discrete bins per action dimension (bin centres span [-1, 1]).',
    'compute_dtype': (f'Activation dtype of the transformer and token policies: {", ".join(config_lib.COMPUTE_DTYPES)} '
                      '(params, optimizer state and log-probs stay float32).'),
    'algo': f'Algorithm: {", ".join(config_lib.ALGORITHMS)}.',
    'schedule': f'Schedule: {", ".join(config_lib.SCHEDULES)}.',
    'num_envs': 'Environments simulated in parallel.',
    'num_timesteps': 'Environment steps to train for.',
    'target_return': 'Stop once the evaluation return reaches this.',
    'run_dir': 'Directory for metrics.jsonl, TensorBoard events, checkpoints and summary.json.',
    'compilation_cache_dir': "JAX's persistent compilation cache; '' disables it.",
    'resume': 'Continue the run in --run_dir from its last checkpoint.',
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected positional arguments: {" ".join(argv[1:])}')
  try:
    cfg = config_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  from ebrl_jax import controller  # lazy: a flag error is reported before JAX and the simulators load
  try:
    controller.run(cfg)
  except ValueError as e:  # e.g. --resume without a checkpoint: a usage problem found before training
    logging.error('%s', e)
    print(f'FATAL: {e}', file=sys.stderr)
    return 2
  except controller.RunError as e:  # e.g. the trainer worker died: children stopped, shared memory freed
    logging.error('%s', e)
    print(f'FATAL: {e}', file=sys.stderr)
    return 3
  return 0


def run_main():
  app.run(main)


if __name__ == '__main__':
  run_main()
