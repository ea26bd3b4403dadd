"""Test speed: the tests compile many small XLA programs on the CPU, where LLVM's optimisation passes dominate
compile time and buy nothing at these sizes. Takes effect only if no JAX backend is initialised yet; test
subprocesses inherit it through the environment."""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0').strip()

# ---------------------------------------------------------------------------------------------------------------
# Test tiers: `pytest -m unit` (under a minute on 2 cores), `-m contract`, `-m e2e`, `-m slow` (registered in
# pytest.ini). Each test gets exactly one of unit / contract / e2e, and `slow` on top where it was measured over
# ~5 s on the 2-core CPU machine (`python -m pytest -q -p no:xdist --durations=0 <files>`).
#
#   unit      numeric, in-process tests of stages and pure functions, hand-computed or reference cases, each
#             under ~3 s: no MJX compile (one costs 8-30 s on the CPU), no child process.
#   contract  the promises of an interface or of a whole model: transport (threads and processes), registry,
#             config and flag errors, checkpoint atomicity, backend agreement, the driver's accounting, the
#             layering rules; a numeric test of a unit file measured over ~3 s (a whole network or train step
#             compiled: HEAVY and SLOW below) counts here, so `-m unit` stays under a minute. May start a helper
#             child process, never a run.
#   e2e       starts a run, a schedule's workers, the bench harness, a calibration or a notebook.
#
# The rules key on the test file's basename, not its directory, so a file that moves (tests/controller/ ->
# tests/rollout/, say) keeps its marks; a file named nowhere below takes its directory's default tier.
import importlib.util  # pylint: disable=g-import-not-at-top,wrong-import-position
import re  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys  # pylint: disable=g-import-not-at-top,wrong-import-position

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

TIERS = ('unit', 'contract', 'e2e')

FILE_TIERS = {
    # generation, trainer, sim: the stages
    'test_distribution.py': 'unit',
    'test_generation_stages.py': 'unit',
    'test_normalization.py': 'unit',
    'test_policies.py': 'unit',
    'test_token_policy.py': 'unit',
    'test_vision.py': 'unit',
    'test_pixel_obs.py': 'unit',  # PixelObs in the records, the normaliser on the state, the pixel networks
    'test_losses.py': 'unit',
    'test_trainer_stages.py': 'unit',
    'test_grad_clip.py': 'unit',  # --grad_clip_scope: labels, Adam steps by hand, config errors
    'test_kl_guard.py': 'contract',  # --max_update_kl: by hand, then whole train steps compiled
    'test_value_norm.py': 'contract',  # --value_norm_rate (PopArt): by hand, then whole train steps compiled
    'test_registry.py': 'unit',
    'test_cpu_env.py': 'unit',
    'test_mjx_stages.py': 'contract',  # the MJX env stages' reset / time-limit / auto-reset promises; compiles MJX
    'test_agreement.py': 'contract',  # both backends agree to 5e-4; compiles MJX
    'test_agreement_push_cube.py': 'contract',  # the same for push_cube
    'test_push_cube.py': 'unit',
    'test_randomize.py': 'contract',  # --randomize: spec, draws, every backend reads them back; compiles MJX
    'test_playground.py': 'contract',  # a bundled Playground task through our MJX stages; compiles MJX
    'test_render.py': 'unit',
    'test_warp_pixels.py': 'unit',  # --obs=pixels on mjx_warp: frame stacks, checks; rendering needs Warp's device
    'test_checkpoint.py': 'contract',
    'test_driver_startup.py': 'contract',
    'test_checkpoint_fallback.py': 'contract',
    'test_data_parallel.py': 'contract',  # 2 trainer ranks on jax.distributed (gloo): helper child processes
    'test_cells_stop.py': 'e2e',  # a clean stop of 2 cells through --launcher=local (max_wall_s, SIGTERM)
    'test_driver_budget.py': 'contract',
    'test_token_training.py': 'contract',
    'test_mjx_warp.py': 'contract',
    'test_startup_accounting.py': 'contract',
    # resources: plans and profiles by hand
    'test_profiles.py': 'unit',
    'test_planner.py': 'unit',
    'test_slack.py': 'unit',
    'test_memory.py': 'unit',
    'test_autoplan.py': 'unit',
    'test_schedule_choice.py': 'unit',
    'test_group_replanner.py': 'unit',  # --replan_groups' decisions on synthetic windows
    'test_calibrate.py': 'contract',  # the calibration in-process on native MuJoCo: compiles a train step
    'test_generation_choice.py':
        'unit',  # --plan_generation: co-located or separate generation by hand  # --schedule=auto by hand (its CPU runs are e2e, below)
    'test_mps_and_cpus.py': 'contract',
    'test_telemetry.py': 'contract',
    # transport and the runtime's error paths
    'test_contract.py': 'contract',
    'test_shm_processes.py': 'contract',
    'test_generation_transport.py': 'contract',  # --generation_transport: host round trips; CUDA IPC on a GPU
    'test_metrics_disk_full.py': 'contract',
    'test_ray_launch.py': 'contract',  # --launcher=ray's placement, agent and watch without Ray (its run: opt-in)
    # the whole system
    'test_fused_e2e.py': 'e2e',
    'test_cells.py': 'e2e',  # --launcher=local: 2 cells (trainer ranks, gloo) through the entry point
    'test_cells_mjx.py': 'e2e',  # 2 MJX fused cells through --launcher=local = 1 rank on the global batch
    'test_pixels_e2e.py': 'e2e',  # --obs=pixels: push_cube's camera frames through fused and async (shm)
    'test_pipeline.py': 'e2e',
    'test_evaluator.py': 'e2e',  # the evaluator process: a sync run on threads, a killed evaluator (processes)
    'test_replan.py': 'e2e',
    'test_overlap.py': 'e2e',  # sync and overlap runs, native MuJoCo
    'test_overlap_mjx.py': 'e2e',  # the same on MJX (compiles MJX)
    'test_env_slices.py': 'e2e',
    'test_mjx_generation.py': 'e2e',  # MJX groups served by a generation worker: one short async run (compiles MJX)
    'test_deterministic.py': 'e2e',  # --deterministic: two async runs (processes, threads) give one curve
    'test_relayout.py': 'e2e',  # --group_schedule: runs whose env groups change twice
    'test_replan_groups.py': 'e2e',  # --replan_groups: a run whose re-planner changes the env groups
    'test_bench.py': 'e2e',
    'test_disk_full.py': 'e2e',
    'test_mps_kill_probe.py': 'e2e',
    'test_notebooks.py': 'e2e',
    # rules of the repository
    'test_config.py': 'contract',
    'test_pixels_config.py': 'contract',  # --obs=pixels and its flags: errors naming the flag
    'test_main_flags.py': 'contract',
    'test_layering.py': 'contract',
    'test_readme.py': 'contract',
    'test_gpu_session.py': 'contract',  # gpu_session.sh's one-file output per part (its `pack` part, no run)
    'test_structure_tool.py': 'unit',
    'test_timeline_tool.py': 'unit',
    'test_format.py': 'contract',
    'test_validation.py': 'contract',
    'test_signals.py': 'e2e',
    'test_run_failures.py':
        'e2e',  # runs that fail (diverged; a worker that fails for good; host memory): one FATAL line, nothing left
    'test_faults.py': 'e2e',  # the fault suite's short version: real runs
    'test_worker_verdict.py': 'contract',  # a dead worker: restart or stop; two real worker processes, no run
    'test_stop_grace.py': 'contract',  # a stopping trainer's grace: a stand-in trainer process, no run
}
DIR_TIERS = {
    'generation': 'unit',
    'trainer': 'unit',
    'sim': 'unit',
    'resources': 'unit',
    'transport': 'contract',
    'runtime': 'contract',
    'controller': 'e2e',
    'rollout': 'e2e'
}
DEFAULT_TIER = 'e2e'  # an unknown file is assumed expensive, so it stays out of the fast tier

# Tests whose tier differs from their file's: (file basename, test function name) -> tier.
TEST_TIERS = {
    ('test_cells.py', 'test_cell_keys_and_flag_errors'):
        'contract',
    ('test_cells.py', 'test_the_topology_describes_the_cell_and_one_gpu_is_the_cell_of_one'):
        'contract',
    ('test_cells_stop.py', 'test_the_vote_is_a_signal_else_the_budget_and_a_second_signal_interrupts'):
        'contract',
    ('test_cells_stop.py', 'test_the_launcher_waits_for_cells_that_stopped_together_and_signals_none'):
        'contract',
    ('test_registry.py', 'test_task_matches_brax_mjx_env'):
        'contract',  # builds Brax's MJX env of every task
    ('test_warp_pixels.py', 'test_warp_frames_stack_through_reset_chunks_and_episode_ends'):
        'contract',  # renders through MJX-Warp (a GPU, or Warp's CPU kernels)
    ('test_memory.py', 'test_mjx_footprint_traces_envs_in_a_child_and_starts_no_accelerator_client'):
        'contract',
    ('test_autoplan.py', 'test_cpu_run_calibrates_once_then_starts_from_the_saved_profiles'):
        'e2e',
    ('test_mps_and_cpus.py', 'test_core_plan_by_hand'):
        'unit',
    ('test_slack.py', 'test_slack_trigger_rebuilds_a_timeline_and_swaps_only_on_try_and_revert'):
        'contract',  # imports the controller (jax, orbax, brax): seconds of imports
    ('test_slack.py', 'test_slack_trigger_without_a_rollout_quota_starts_from_100'):
        'contract',  # the same imports
    ('test_replan.py', 'test_replanner_changes_the_rollout_quota_when_it_pays'):
        'unit',
    ('test_replan.py', 'test_replanner_keeps_the_quota_within_hysteresis'):
        'unit',
    ('test_replan.py', 'test_flag_errors_name_the_flag'):
        'contract',
    ('test_replan.py', 'test_a_swap_cut_short_by_the_runs_end_is_recorded_as_pending'):
        'contract',
    ('test_replan.py', 'test_a_standby_that_dies_before_it_is_ready_keeps_the_old_worker'):
        'contract',
    ('test_replan.py', 'test_feedback_slots_give_stage_seconds_and_the_recent_period'):
        'contract',
    ('test_env_slices.py', 'test_buckets_are_the_slice_size_times_powers_of_two_up_to_all_envs'):
        'unit',
    ('test_env_slices.py', 'test_sliced_collector_writes_the_unsliced_layout_with_per_slice_versions'):
        'unit',
    ('test_env_slices.py', 'test_server_batches_ready_slices_of_any_group_pads_to_a_bucket_and_replies_to_each_slice'):
        'contract',
    ('test_env_slices.py', 'test_reply_to_a_dead_slice_is_dropped_and_its_restarted_worker_gets_its_own'):
        'contract',
    ('test_pipeline.py', 'test_phase_reports_write_on_change_stop_after_done_and_never_raise'):
        'contract',
    ('test_evaluator.py', 'test_reports_are_recorded_in_version_order_one_in_flight_repeats_dropped_and_a_missing_one_said'):
        'contract',  # the trainer's link on in-thread transport, a fake evaluator: no run
    ('test_evaluator.py', 'test_evaluator_flag_errors_name_the_flag'):
        'contract',
    ('test_deterministic.py', 'test_deterministic_refuses_what_timing_would_decide'):
        'contract',
    ('test_schedule_choice.py', 'test_auto_runs_the_schedule_its_profiles_choose'):
        'e2e',
    ('test_schedule_choice.py', 'test_auto_tries_the_predicted_process_schedule_and_keeps_the_verdict'):
        'e2e',
    ('test_auto_trial.py', 'test_a_spawned_trial_or_calibration_process_ends_with_its_killed_caller'):
        'e2e',
    ('test_auto_trial.py', 'test_run_process_gives_the_exit_code_or_none_at_its_timeout'):
        'e2e',
    ('test_relayout.py', 'test_blocks_and_segment_spec_follow_the_lcm_of_the_layouts'):
        'contract',
    ('test_replan_groups.py', 'test_replan_groups_errors_name_the_flag'):
        'contract',
    ('test_replan_groups.py', 'test_the_trigger_reads_the_plan_store_where_the_run_was_planned_else_measures_in_the_run'):
        'contract',
    ('test_bench.py', 'test_overlap_bounds_by_hand'):
        'unit',
    ('test_bench.py', 'test_each_label_gets_its_own_cold_cache_unless_a_flag_says_otherwise'):
        'unit',
    ('test_bench.py', 'test_source_tree_is_the_commits_tree_and_sees_uncommitted_files'):
        'contract',  # git in a temporary repository
    ('test_bench.py', 'test_steady_pace_is_taken_between_the_second_and_the_last_evaluation'):
        'unit',
    ('test_bench.py', 'test_end_to_end_is_not_averaged_across_its_two_definitions'):
        'unit',
    ('test_bench.py', 'test_steady_sm_activity_over_the_steady_window'):
        'unit',
    ('test_bench.py', 'test_report_table_marks_seed_counts_and_the_older_definition'):
        'unit',
    ('test_bench.py', 'test_schedule_labels_and_only_flags_are_checked'):
        'contract',
    ('test_bench.py', 'test_brax_refuses_what_its_trainer_cannot_run'):
        'contract',
    ('test_bench.py', 'test_label_time_limits_and_environments_are_checked_and_default_to_timeout_s'):
        'contract',
    ('test_bench.py', 'test_a_stopped_runs_summary_is_taken_and_a_stale_one_is_not'):
        'unit',
    ('test_bench.py', 'test_brax_start_up_is_on_our_clock_by_hand'):
        'unit',
    ('test_bench.py', 'test_report_names_the_file_and_field_of_a_bad_result'):
        'contract',
    ('test_bench.py', 'test_report_plots_sm_activity_and_a_stage_timeline'):
        'contract',
    ('test_bench.py', 'test_planner_prediction_from_the_kept_w2_results'):
        'contract',
    ('test_disk_full.py', 'test_disk_full_is_recognised_from_the_os_error_and_through_wrappers'):
        'contract',
    ('test_disk_full.py', 'test_resume_advice_names_the_newest_committed_checkpoint'):
        'contract',
    ('test_notebooks.py', 'test_notebooks_are_found_and_probed'):
        'contract',
    ('test_notebooks.py', 'test_notebook_is_stored_clean'):
        'contract',
}
# In a unit file, a test of an error message (a refusal that names what is wrong) is a contract test.
CONTRACT_NAME = re.compile(r'error|refuse|reject|invalid|unknown|_names?_|naming')
# A test that uses one of these fixtures runs the bench harness (tests/test_bench.py's quick invocation, ~2.5
# minutes once per process): e2e and slow.
E2E_FIXTURES = frozenset({'quick_result'})

# Numeric tests of unit files measured at 3-5 s on the 2-core CPU machine: contract (see above), not slow.
HEAVY = frozenset({
    ('test_policies.py', 'test_transformer_mlp_critic_value_loss_moves_no_policy_parameter'),  # 4 s: two grads jitted
    ('test_trainer_stages.py', 'test_ppo_train_step_learns_and_keeps_bookkeeping'),
    ('test_trainer_stages.py', 'test_grpo_train_step_leaves_the_critic_alone'),
    ('test_trainer_stages.py', 'test_first_step_is_on_policy'),
    ('test_losses.py', 'test_ppo_loss_equals_brax_on_policy'),
    ('test_generation_stages.py', 'test_normalizer_is_applied_only_when_enabled'),
    ('test_vision.py', 'test_bfloat16_compute_is_finite_and_close_to_float32'),
    ('test_vision.py', 'test_gradients_finite_and_nonzero'),
    ('test_vision.py', 'test_vit_actor_critic_contract_matches_gaussian_heads'),
    ('test_pixel_obs.py', 'test_normaliser_applies_to_the_state_only'),
    ('test_pixel_obs.py', 'test_pixel_networks_act_and_evaluate_through_the_stages'),
})

# Measured over ~5 s on the 2-core CPU machine: (file basename, test function name) marks every parametrisation,
# (file basename, test id with its parameters) one of them.
SLOW = frozenset({
    # 2-20 s a trial on the 2-core machine: an async run Ctrl-Ced from inside a gc callback during its start-up
    ('test_ctrl_c_startup.py', 'test_a_ctrl_c_at_any_moment_of_start_up_stops_the_run_cleanly'),
    # over 12 s in the suite's last --durations run on the 2-core machine (CI's load; alone they are shorter)
    ('test_trace_cache.py', 'test_warm_mjx_fused_run_reuses_its_traces_and_learns_the_same'),
    ('test_liveness.py', 'test_a_sigkilled_controller_leaves_no_process_and_once_swept_no_shared_memory'),
    ('test_format.py', 'test_every_python_file_is_formatted'),
    ('test_run_failures.py', 'test_a_diverged_process_schedule_stops_the_same_way_and_leaves_nothing'),  # 15 s alone
    ('test_validation.py', 'test_bad_run_state_and_files_are_refused_up_front_and_say_whether_a_checkpoint_exists'),
    ('test_validation.py', 'test_a_truncated_newest_step_is_named_and_resume_continues_from_the_one_before'),
    ('test_policies.py', 'test_transformer_mlp_critic_value_loss_moves_no_policy_parameter'),
    ('test_playground.py', 'test_cartpole_steps_through_our_stages'),
    ('test_stop_check_tool.py', 'test_stop_check_signals_a_training_run_and_reads_its_summary'),
    # 29 s on the loaded 2-core machine: a native fused run SIGTERMed, then resumed from the stop's checkpoint
    ('test_stop_resume.py', 'test_sigterm_saves_the_last_iteration_of_a_native_fused_run_and_resume_continues_there'),
    ('test_token_training.py', 'test_fused_ppo_run_with_the_token_policy_finishes_with_finite_losses'),
    ('test_token_training.py', 'test_bfloat16_compute_dtype_act_and_evaluate_are_finite_and_close_to_float32'),
    ('test_token_training.py', 'test_act_returns_bin_centres_and_float_ids_that_evaluate_scores_to_the_same_log_probs'),
    ('test_vision.py', 'test_bfloat16_compute_is_finite_and_close_to_float32'),
    ('test_layering.py', 'test_importing_stages_defines_no_flags_and_no_runtime'),
    ('test_kl_guard.py', 'test_far_bound_is_the_unguarded_step_bit_for_bit'),
    ('test_kl_guard.py', 'test_a_tiny_bound_undoes_the_first_step_and_keeps_the_rest_from_moving'),
    # 6.4 s on the 2-core machine alone: a whole calibration with push_cube's camera rendering (a CNN compiled)
    ('test_calibrate.py', 'test_profile_stages_with_pixels_renders_and_trains_on_camera_observations'),
    # ~40-50 s each on Warp's CPU kernels (EBRL_WARP_ALLOW_CPU=1); skipped without a CUDA GPU or that variable
    ('test_warp_pixels.py', 'test_warp_frames_stack_through_reset_chunks_and_episode_ends'),
    ('test_randomize.py', 'test_warp_draws_reach_the_physics_the_camera_and_the_renderer'),
    ('test_cells.py', 'test_two_cells_hold_one_state_count_the_global_batch_and_resume_on_one_cell'),
    ('test_cells.py', 'test_a_killed_cell_stops_the_run_naming_it_and_leaves_nothing_behind'),
    ('test_cells_mjx.py', 'test_two_mjx_fused_cells_train_as_one_rank_on_the_global_batch'),
    ('test_cells.py', 'test_two_async_cells_train_one_state_with_their_own_rollout_workers_and_resume_on_one'),
    ('test_cells.py', 'test_a_killed_async_cell_stops_the_run_naming_it_and_leaves_nothing_behind'),
    ('test_cells_stop.py', 'test_two_cells_stop_together_on_max_wall_s_with_a_checkpoint_and_the_allreduce_timed'),
    ('test_cells_stop.py', 'test_a_sigterm_to_the_launcher_stops_async_cells_together_and_resume_continues'),
    ('test_cells_stop.py', 'test_a_sigterm_to_one_fused_cell_stops_both_after_the_same_step'),
    ('test_faults.py', 'test_the_short_suite_survives_every_trial'),
    ('test_data_parallel.py', 'test_two_ranks_match_one_rank_and_resume_on_one'),
    ('test_data_parallel.py', 'test_a_killed_rank_stops_the_other_naming_it'),
    # ~40 s: a killed cell through --launcher=local; the 2-cell run and its resume on one cell stay in CI
    ('test_cells.py', 'test_a_killed_cell_stops_the_run_naming_it_and_leaves_nothing_behind'),
    ('test_generation_stages.py', 'test_act_shapes_and_log_probs_match_evaluate'),
    ('test_trainer_stages.py', 'test_one_sgd_step_matches_brax'),
    ('test_token_policy.py', 'test_kv_cache_decode_equals_full_causal_forward'),
    ('test_token_policy.py', 'test_jit_matches_eager_and_sampling_follows_the_softmax'),
    ('test_token_policy.py', 'test_ppo_step_moves_the_chosen_tokens_log_prob_the_right_way'),
    ('test_token_policy.py', 'test_pixel_tokenizer_prefix_decodes_and_matches'),
    ('test_token_policy.py', 'test_bfloat16_compute_is_finite_and_close_to_float32'),
    ('test_agreement.py', 'test_backends_agree'),
    ('test_agreement_push_cube.py', 'test_push_cube_backends_agree'),
    ('test_mjx_stages.py', 'test_groups_share_the_initial_state_and_groups_differ'),
    ('test_mjx_stages.py', 'test_time_limit_truncates_reports_totals_and_auto_resets'),
    ('test_mjx_stages.py', 'test_chunk_of_one_equals_step'),
    ('test_mjx_stages.py', 'test_chunk_stops_each_env_at_its_first_done'),
    ('test_memory.py', 'test_mjx_footprint_traces_envs_in_a_child_and_starts_no_accelerator_client'),
    ('test_autoplan.py', 'test_cpu_run_calibrates_once_then_starts_from_the_saved_profiles'),
    ('test_shm_processes.py', 'test_segments_outlive_attachers_and_are_unlinked_at_exit_without_tracker_noise'),
    ('test_shm_processes.py', 'test_many_child_producers_one_owner_consumer'),
    ('test_shm_processes.py', 'test_param_store_never_torn_across_processes'),
    ('test_shm_processes.py', 'test_child_producer_to_child_consumer'),
    ('test_env_slices.py', 'test_async_with_env_slices_learns_without_losing_or_duplicating_segments'),
    ('test_replan.py', 'test_quota_schedule_swaps_each_group_through_a_warm_standby'),
    ('test_pipeline.py', 'test_sync_with_one_group_replays_fused_exactly'),
    ('test_overlap.py', 'test_overlap_replays_sync_bit_for_bit_on_native_mujoco'),
    ('test_overlap_mjx.py', 'test_overlap_replays_sync_bit_for_bit_on_mjx'),
    ('test_pipeline.py', 'test_async_processes_learn_with_bounded_staleness_and_trace_every_process'),
    ('test_evaluator.py', 'test_the_evaluator_scores_a_version_as_the_in_trainer_evaluation_does'),
    ('test_evaluator.py', 'test_a_killed_evaluator_is_restarted_and_the_curve_has_every_version'),
    ('test_deterministic.py', 'test_deterministic_async_repeats_its_curve_and_parameters_under_different_timing'),
    ('test_schedule_choice.py', 'test_auto_runs_the_schedule_its_profiles_choose'),
    ('test_schedule_choice.py', 'test_auto_tries_the_predicted_process_schedule_and_keeps_the_verdict'),
    ('test_relayout.py', 'test_groups_change_twice_without_losing_or_duplicating_a_segment'),
    ('test_replan_groups.py', 'test_replanner_changes_the_groups_without_losing_or_duplicating_a_segment'),
    ('test_pipeline.py', 'test_killed_worker_is_restarted_without_losing_or_duplicating_segments'),
    ('test_pipeline.py', 'test_ctrl_c_leaves_no_process_and_no_shared_memory'),
    ('test_pipeline.py', 'test_killed_trainer_stops_the_run_with_its_checkpoint_intact'),
    ('test_pipeline.py', 'test_mps_daemon_death_stops_the_run_and_resume_continues'),
    ('test_fused_e2e.py', 'test_ppo_learns_the_pendulum_on_native_mujoco'),
    ('test_pixels_e2e.py', 'test_fused_pixels_reach_the_train_step_as_uint8_stacks'),
    ('test_pixels_e2e.py', 'test_async_workers_send_pixel_segments_over_shared_memory'),
    ('test_fused_e2e.py', 'test_grpo_learns_with_group_resets'),
    ('test_fused_e2e.py', 'test_resume_continues_the_step_count'),
    ('test_fused_e2e.py', 'test_mjx_backend_runs_the_fused_program'),
    ('test_disk_full.py', 'test_a_full_disk_stops_the_run_clearly_and_resume_continues'),
    ('test_mps_kill_probe.py', 'test_probe_kills_the_runs_daemon_and_the_run_stops_cleanly_then_resumes'),
    ('test_bench.py', 'test_labels_brax_and_stage_profile_in_one_quick_invocation'),
    ('test_notebooks.py', 'test_notebook_runs[01_quickstart.ipynb]'),
    ('test_notebooks.py', 'test_notebook_runs[02_stages_in_your_code.ipynb]'),
})


def tier_of(path: str, name: str, fixturenames=()) -> str:
  """The tier of test `name` (its function name, without parameters) in the file at `path`."""
  base = os.path.basename(path)
  if (base, name) in TEST_TIERS:
    return TEST_TIERS[(base, name)]
  if E2E_FIXTURES.intersection(fixturenames):
    return 'e2e'
  tier = FILE_TIERS.get(base) or DIR_TIERS.get(os.path.basename(os.path.dirname(path)), DEFAULT_TIER)
  if tier == 'unit' and (CONTRACT_NAME.search(name) or (base, name) in HEAVY or (base, name) in SLOW):
    return 'contract'
  return tier


# Opt-in (EBRL_FULL_TESTS=1): each compiles MJX programs for minutes on 2 cores or starts several JAX processes, and
# together they put the suite past CI's 20-minute budget. Each has a cheaper CI sibling: sync == fused bit for bit
# on native MuJoCo (test_pipeline), the randomised draws reaching native MuJoCo's step (test_randomize), the
# backends' agreement on the locomotion tasks (test_agreement), 2 ranks matching 1 (test_data_parallel). Run them
# before a release: EBRL_FULL_TESTS=1 python -m pytest -q -n 3 --dist loadfile tests
OPT_IN = frozenset({
    # ~70 s in CI: a tiny fused MJX run; fused MJX runs stay in CI through test_signals (SIGTERM at a chunk
    # boundary, plain jit) and test_trace_cache (cold and warm, the same curve)
    ('test_fused_e2e.py', 'test_mjx_backend_runs_the_fused_program'),
    # ~35 s alone, ~70 s in CI: a third MJX compile; the warm run's reuse and its curve == the cold run's stay in
    # CI, and so does a small program's (test_stored_program_gives_what_tracing_gives)
    ('test_trace_cache.py', 'test_exported_mjx_programs_learn_as_the_traced_ones'),
    # MJX groups served by a generation worker: the short async run (176 s on the loaded 2-core machine, MJX
    # compiles of both groups) and the served segment == the co-located one (~70 s); the hand-off round trips, the
    # per-request keys and the server's key routing (test_generation_transport) stay in CI
    ('test_mjx_generation.py', 'test_async_mjx_groups_served_by_a_generation_worker_deliver_every_segment_once'),
    ('test_mjx_generation.py', 'test_served_mjx_group_collects_the_colocated_segment_given_the_same_keys'),
    ('test_pipeline.py', 'test_sync_with_one_group_replays_fused_exactly_on_mjx'),
    ('test_randomize.py', 'test_mjx_draws_reach_the_step'),
    # 5 s: the token policy over a pixel prefix through the stages; its state twin and the vision tests stay in CI
    ('test_pixel_obs.py', 'test_pixel_networks_act_and_evaluate_through_the_stages[token-patches-None]'),
    ('test_agreement_push_cube.py', 'test_push_cube_backends_agree'),
    ('test_data_parallel.py', 'test_a_killed_rank_stops_the_other_naming_it'),
    # the fault suite's kill_generation kind (80 kills, experiments/results/faults_cpu.json) covers it at length
    ('test_pipeline.py', 'test_killed_worker_is_restarted_without_losing_or_duplicating_segments[generation_worker]'),
    # 236 s: Brax's trainer and the stage profile beside the schedules; test_quick_bench_reports_every_figure stays
    ('test_bench.py', 'test_labels_brax_and_stage_profile_in_one_quick_invocation'),
    # 120 s: a calibration process on the CPU; --plan / --schedule=auto from a saved profile store stay
    # (test_autoplan, test_schedule_choice), the calibration's own stages are timed by the bench's stage profile
    ('test_autoplan.py', 'test_cpu_run_calibrates_once_then_starts_from_the_saved_profiles'),
    # the fault suite's kill_rollout kind (80 kills) and kill_evaluator kind (8 kills) cover these at length
    ('test_pipeline.py', 'test_killed_worker_is_restarted_without_losing_or_duplicating_segments[rollout_worker]'),
    ('test_evaluator.py', 'test_a_killed_evaluator_is_restarted_and_the_curve_has_every_version'),
    # 124 s and 82 s: the fault suite's disk_full kind runs both (6 trials, faults_cpu.json); the metrics writer's
    # full-disk test and the recognition / resume-advice tests stay
    ('test_disk_full.py', 'test_a_full_disk_stops_the_run_clearly_and_resume_continues[async_processes]'),
    ('test_disk_full.py', 'test_a_full_disk_stops_the_run_clearly_and_resume_continues[fused]'),
    # 90 s: a real run's daemon killed by the probe; test_pipeline's MPS-death run (stand-in daemon) stays
    ('test_mps_kill_probe.py', 'test_probe_kills_the_runs_daemon_and_the_run_stops_cleanly_then_resumes'),
    # failed once in ~13 runs with its output lost (cause unknown): a flake must not decide CI; the fused pixel run
    # (the same camera frames through the train step) stays in CI
    ('test_pixels_e2e.py', 'test_async_workers_send_pixel_segments_over_shared_memory'),
    # CI budget (the suite reached 17:54 on 2 cores with this stop's additions): 56 s, hopper's agreement; ant's
    # (contacts, the same solver settings), reacher's and the pendulum's stay in CI
    ('test_agreement.py', 'test_backends_agree[hopper]'),
    # 48 s: two fused cells; the two async cells through the same launcher (with the resume on one cell) and
    # test_data_parallel's 2 ranks = 1 rank stay in CI
    ('test_cells.py', 'test_two_cells_hold_one_state_count_the_global_batch_and_resume_on_one_cell'),
    # 41 s: Ctrl-C of an async run; test_signals' SIGTERM of an async run (the same stop path: summary, no process,
    # no shared memory left) stays in CI
    ('test_pipeline.py', 'test_ctrl_c_leaves_no_process_and_no_shared_memory'),
    # CI budget again (20:18 of CI with set-up after this stop's merges): 117 s, the quota swap through warm standbys
    # with a stand-in MPS daemon (its H200 run is experiments/results/w2_quota_change_1gpu.json; test_replan's
    # decision tests and the group changer's warm-standby e2e tests stay)
    ('test_replan.py', 'test_quota_schedule_swaps_each_group_through_a_warm_standby'),
    # 20 s: the sync twin of the async live group change that stays
    ('test_relayout.py', 'test_groups_change_twice_without_losing_or_duplicating_a_segment[sync-thread]'),
    # 35 s: reacher's agreement; ant's and the pendulum's stay
    ('test_agreement.py', 'test_backends_agree[reacher]'),
    # 35 s: a killed trainer; the fault suite's kill_trainer kind (experiments/results/faults_cpu.json) covers it at
    # length, and test_cells' killed cell (a trainer rank's death) stays
    ('test_pipeline.py', 'test_killed_trainer_stops_the_run_with_its_checkpoint_intact'),
    # 60 s: env slices over a generation worker; the slicing, batching and dead-slice tests stay, and the fault
    # suite's kill_generation kind (80 kills) runs such groups
    ('test_env_slices.py', 'test_async_with_env_slices_learns_without_losing_or_duplicating_segments'),
    # 55 s: six JAX processes (two cells of controller, trainer rank, rollout worker); the fused killed cell (the
    # launcher's side) and the two async cells run to the end (the trainer ranks' side) stay in CI
    ('test_cells.py', 'test_a_killed_async_cell_stops_the_run_naming_it_and_leaves_nothing_behind'),
    # ~90 s: a 2-node Ray cluster (~10 s to start) and two async cells over it (the ray extra, not in CI's install);
    # the placement, the host agent and the driver's watch through it stay in CI (test_ray_launch), and the two
    # async cells run to the end through --launcher=local (test_cells)
    ('test_ray_launch.py', 'test_a_two_node_ray_cluster_runs_async_cells_one_per_node'),
    # 46-49 s and 15-37 s on the 2-core machine (the stop itself: 0.5-1 s): a SIGTERM to the launcher of two async
    # cells (then --resume on one), and to one fused cell alone; the fused cells' --max_wall_s stop (23 s, the same
    # agreed stop, checkpoint and summaries), one rank's vote learned by both (test_data_parallel) and the
    # launcher's wait (stand-in cells) stay in CI
    ('test_cells_stop.py', 'test_a_sigterm_to_the_launcher_stops_async_cells_together_and_resume_continues'),
    ('test_cells_stop.py', 'test_a_sigterm_to_one_fused_cell_stops_both_after_the_same_step'),
    # 216 s (PPO; 111 s at load 2) and 337 s (GRPO) on the loaded 2-core machine: two MJX fused cells, MJX compiled
    # in both cell processes and in the one-rank reference; the fused iterations over 2 ranks on stand-in rollouts
    # and rank 1's MJX env on its own device (test_data_parallel) and the native-MuJoCo fused cells' stop
    # (test_cells_stop) stay in CI
    ('test_cells_mjx.py', 'test_two_mjx_fused_cells_train_as_one_rank_on_the_global_batch'),
    # 8 s on the 2-core machine at load 2, 34 s at load 11 (a train step and the policy compiled, the pool stepped): a
    # whole in-process calibration; its training batch (test_calibrate) and auto's quota order and skip on fake
    # calibration processes (test_autoplan) stay in CI
    ('test_calibrate.py', 'test_profile_stages_on_native_mujoco_times_every_stage_and_says_where_its_time_went'),
    # CI budget (stop 29: 18:25 of tests, 19:59 with set-up): 60-82 s, an MJX fused run SIGTERMed (an MJX compile on
    # the CPU); the held signal stopping at the next chunk boundary with a checkpoint (test_driver_budget, the
    # driver's side), the fused and async SIGTERM runs (test_signals) and the MJX run on the GPU
    # (experiments/results/stop_check_h200.json) stay
    ('test_signals.py', 'test_sigterm_stops_an_mjx_fused_run_at_a_chunk_boundary_with_its_summary'),
    # 25-31 s: --max_wall_s through the entry point; the budget at the iteration boundary (test_driver_budget) and
    # two fused cells stopping together on it with a checkpoint and summaries (test_cells_stop) stay
    ('test_signals.py', 'test_max_wall_s_stops_cleanly_and_writes_the_summary'),
    # CI budget (stop 30: 20:38 of tests in a fresh clone, 17:10 in a quieter hour): 22-29 s, the SIGTERM latency
    # tool on a native run (its GPU run is experiments/results/stop_check_h200.json; a fused run's SIGTERM summary
    # stays through test_signals)
    ('test_stop_check_tool.py', 'test_stop_check_signals_a_training_run_and_reads_its_summary'),
    # 31-36 s: auto choosing async from profiles and running it; the choice by hand on synthetic profiles
    # (test_schedule_choice's decision tests) and auto running its fused choice end to end stay
    ('test_schedule_choice.py', 'test_auto_runs_the_schedule_its_profiles_choose[stages0-async]'),
    # 17-22 s: the pendulum's agreement (no contacts); ant's (contacts, the same solver settings) stays
    ('test_agreement.py', 'test_backends_agree[inverted_pendulum]'),
    # CI budget (stop 46: 18:43 and 19:05 of CI with set-up in a fresh clone): 59 s alone (~100 s in CI), auto's
    # trial of async then fused in processes of their own, twice; the trial's process, timeout and verdict rules
    # (test_auto_trial), the decision tests and auto running its fused choice end to end stay in CI
    ('test_schedule_choice.py', 'test_auto_tries_the_predicted_process_schedule_and_keeps_the_verdict'),
    # 30-59 s: a resume across --nonormalize_observations through the entry point; the same refusal in every
    # schedule (test_resume_flags' fused and async cases) stays
    ('test_no_effect_flags.py', 'test_a_resume_across_nonormalize_observations_is_refused_naming_the_flag'),
    # 13-18 s each: the sync twins of the async resume refusals that stay
    ('test_resume_flags.py', 'test_a_changed_normalize_observations_is_one_line_in_every_schedule[sync]'),
    ('test_resume_flags.py',
     'test_an_old_checkpoint_across_normalize_observations_is_one_line_in_the_process_schedules[sync]'),
})
FULL = os.environ.get('EBRL_FULL_TESTS') == '1'


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  for item in items:
    key = os.path.basename(str(item.path))
    if not FULL and ((key, getattr(item, 'originalname', None) or item.name) in OPT_IN or (key, item.name) in OPT_IN):
      item.add_marker(pytest.mark.skip(reason='opt-in (EBRL_FULL_TESTS=1): past the CI time budget; see OPT_IN'))
    path, name = str(item.path), getattr(item, 'originalname', None) or item.name
    fixtures = getattr(item, 'fixturenames', ())
    if not any(item.get_closest_marker(t) for t in TIERS):  # a tier the test file sets itself wins
      item.add_marker(getattr(pytest.mark, tier_of(path, name, fixtures)))
    base = os.path.basename(path)
    if (base, name) in SLOW or (base, item.name) in SLOW or E2E_FIXTURES.intersection(fixtures):
      item.add_marker(pytest.mark.slow)
  # Longest first (a stable sort: the slow tests, then the other runs, then the rest, each in collection order).
  # CI runs `--dist loadfile`: each test file on one worker, files handed out in the order of their first test
  # here, so the files with the slowest tests start first. Measured on the 2-core machine the same morning: the
  # whole suite in 1041.9 s (31 min of CPU) against 1373.3 s (35.5 min; with a session compilation cache since
  # taken out) and 1360.3 s (with other work beside it) under the default `--dist load`, which splits a file's
  # tests across both workers so both compile its programs and build its module fixtures (`--dist worksteal`
  # splits them further: 1152.8 s against 1090.6 s for `load` at an earlier tree).
  # Three workers on the 2-core machine (stop 30): a worker waits on its runs' child processes, polls and sleeps
  # part of the time, so with two the cores were ~84 % busy (20:39 of tests, 34.5 min of CPU) and with three ~95 %
  # (17:44, 33.9 min) in the same afternoon.
  items.sort(key=lambda it: 0 if it.get_closest_marker('slow') else 1 if it.get_closest_marker('e2e') else 2)


FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fakes')


@pytest.fixture
def fake_pynvml(monkeypatch):
  """`install(gpu_mib)`: tests/fakes/pynvml.py as `pynvml` for this test only, an NVML of one GPU of `gpu_mib`
  MiB; returns the module (its `calls`). Put in sys.modules through monkeypatch, so it goes when the test ends: a
  fake imported by the code under test would stay in sys.modules and give every later test of the same worker
  process a 16 GiB GPU (found when `--dist loadfile` ran test_memory before test_deterministic in one worker)."""

  def install(gpu_mib: int):
    spec = importlib.util.spec_from_file_location('pynvml', os.path.join(FAKES, 'pynvml.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, 'pynvml', module)
    for name, loaded in list(sys.modules.items()):  # the project's modules import pynvml at their top
      if name.startswith('ebrl_jax.') and getattr(loaded, 'pynvml', None) is not None:
        monkeypatch.setattr(loaded, 'pynvml', module)
    monkeypatch.setenv('EBRL_FAKE_GPU_MIB', str(gpu_mib))
    return module

  return install
