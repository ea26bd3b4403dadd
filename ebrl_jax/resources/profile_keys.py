"""The profile store's key of a workload (`resources.profiles.workload_id`): what changes a stage's time at a given
batch size and quota, read from a `config.Config`."""
from ebrl_jax import config as config_lib
from ebrl_jax import config_checks
from ebrl_jax import config_generation
from ebrl_jax.resources import calibrate
from ebrl_jax.resources import profiles


def workload_key(cfg: config_lib.Config) -> str:
  """Everything that changes a stage's time at a given batch size and quota, and nothing else: task, backend,
  envs, the policy's shape, the training batch and epochs; then, each only where it is away from its default
  (so a key of a run that sets none of them is what it was before they were added), the trunk's dtype and critic,
  camera observations and their encoder, the solver caps, domain randomisation, the observation normaliser, PopArt,
  the KL guard, a trunk's MLP critic's sizes and the MLP policy's CNN width (`_SETTINGS`)."""
  p, a, s = cfg.policy, cfg.algo, cfg.sim
  if p.kind == 'mlp':
    policy = f'{p.kind}:{"x".join(map(str, p.policy_hidden_sizes))}/{"x".join(map(str, p.value_hidden_sizes))}'
  else:  # transformer, token: the trunk's shape (token: and its bins)
    policy = f'{p.kind}:d{p.d_model}x{p.num_layers}h{p.num_heads}m{p.mlp_ratio}t{p.obs_token_size}k{p.action_chunk}'
    policy += f'b{p.num_bins}' if p.kind == 'token' else ''
  if a.episodic:  # GRPO trains on one whole episode per env, in groups
    batch = f'episode={s.episode_length},group={s.group_size},unroll={calibrate.timed_unroll_steps(cfg)}'
  else:
    batch = f'seg={a.segments_per_iteration},unroll={a.unroll_length}'
  policy += (f';algo={a.name},{batch},mb={a.num_minibatches},epochs={a.num_updates_per_batch};'
             f'repeat={s.action_repeat};threads={s.num_threads}')
  pixels = s.obs == 'pixels'
  read = {
      False: True,
      True: pixels,
      'mlp_critic': p.kind != 'mlp' and config_generation.critic_of(p, pixels) == 'mlp',  # a trunk's own MLP critic
      'cnn_width': p.kind == 'mlp' and pixels,  # the MLP's CNN features are d_model wide (a trunk's: in its shape)
  }
  for section, field, where in _SETTINGS:
    config = getattr(cfg, section)
    value = getattr(config, field)
    if read[where] and value != config_checks.default_of(config, field):
      policy += f';{field}={",".join(map(str, value)) if isinstance(value, tuple) else value}'
  return profiles.workload_id(s.task, s.backend, s.num_envs, policy)


# (Config section, field, where it is read: always (False), with --obs=pixels (True), by a transformer's or token
# policy's MLP critic, by the MLP policy's CNN) of what else changes a stage's time (workload_key).
_SETTINGS = (
    ('policy', 'compute_dtype', False),
    ('policy', 'critic', False),
    ('sim', 'obs', False),
    ('sim', 'image_size', True),
    ('sim', 'frame_stack', True),
    ('sim', 'pixel_depth', True),
    ('sim', 'pixel_state', True),
    ('policy', 'vision_encoder', True),
    ('policy', 'cnn_channels', True),
    ('policy', 'cnn_blocks', True),
    ('policy', 'patch_size', True),
    ('sim', 'solver_iterations', False),
    ('sim', 'ls_iterations', False),
    ('sim', 'randomize', False),
    ('policy', 'normalize_observations', False),
    ('algo', 'value_norm_rate', False),
    ('algo', 'max_update_kl', False),
    ('policy', 'value_hidden_sizes', 'mlp_critic'),
    ('policy', 'd_model', 'cnn_width'),
)
