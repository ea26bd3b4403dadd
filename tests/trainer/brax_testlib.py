"""Shared by the tests that compare our PPO with Brax's: our [T, B] Transition as Brax's [B, T] one."""
import jax.numpy as jnp


def to_brax_transition(brax_types, batch, distribution_params_bt):
  """`batch`: our Transition [T, B, ...] with K = 1; `distribution_params_bt`: [B, T, 2A] (only logged by Brax)."""
  to_bt = lambda x: jnp.swapaxes(x, 0, 1)
  return brax_types.Transition(observation=to_bt(batch.obs),
                               action=to_bt(jnp.tanh(batch.raw_action[:, :, 0])),
                               reward=to_bt(batch.reward),
                               discount=to_bt(1.0 - batch.termination - batch.truncation),
                               next_observation=to_bt(batch.next_obs),
                               extras={
                                   'state_extras': {
                                       'truncation': to_bt(batch.truncation)
                                   },
                                   'policy_extras': {
                                       'raw_action': to_bt(batch.raw_action[:, :, 0]),
                                       'log_prob': to_bt(batch.behaviour_log_prob),
                                       'distribution_params': distribution_params_bt
                                   }
                               })
