"""Tests that run only in the full run (`-m "slow or not slow"`, what CI runs), beside those marked
`@pytest.mark.slow` in their own files.

The default run (`python -m pytest -q -n 2`) is what a contributor runs after each change, so it
must stay under 3 minutes on a 2-core machine. Each test below costs more than ~1.5 s of CPU there
(a transformers architecture exported or compiled, a subprocess, a training run); every group
names the faster test that keeps the same code under the default run. Nothing here is skipped:
CI runs all of it.
"""
from __future__ import annotations

FULL_RUN_ONLY: dict[str, str] = {
    # more architectures through the same entry point (the fast run keeps gpt2)
    "tests/test_hf_defaults.py::test_fold_module_with_default_config[bert]": "fold_module, [gpt2]",
    "tests/test_hf_defaults.py::test_fold_module_with_default_config[opt]": "fold_module, [gpt2]",
    "tests/test_hf_defaults.py::test_fold_module_with_default_config[vit]": "fold_module, [gpt2]",
    "tests/test_hf_defaults.py::test_fold_module_with_default_config[whisper]": "fold_module, [gpt2]",
    "tests/test_hf_defaults.py::test_backend_with_default_config[bert]": "backend, [vit]",
    "tests/test_hf_defaults.py::test_backend_with_default_config[gpt2]": "backend, [vit]",
    "tests/test_hf_defaults.py::test_backend_with_default_config[opt]": "backend, [vit]",
    "tests/test_hf_defaults.py::test_backend_with_default_config[whisper]": "backend, [vit]",
    "tests/test_hf_defaults.py::test_a_cache_from_a_previous_step": "test_train.py's use_cache test",
    "tests/test_hf_defaults.py::test_backend_keeps_the_reports_of_the_last_graphs_only": "backend, [vit]",
    "tests/test_hf_defaults.py::test_backend_verifies_and_folds_under_dynamic_shapes":
        "test_backend_verifies_with_an_unbacked_batch_size",
    "tests/test_fx.py::test_fold_module_counts_outputs_and_leaves_module_alone[bert]": "[vit]",
    "tests/test_fx.py::test_fold_module_counts_outputs_and_leaves_module_alone[gpt2]": "[vit]",
    "tests/test_fx.py::test_planted_bug_skipped_centering_fails_verification[rms_norm]": "[auto]",
    "tests/test_fx.py::test_norm_choice_rms_norm_or_layer_norm": "test_fold_module_counts_outputs...",
    "tests/test_fx.py::test_swap_without_centering_is_not_equivalent": "test_planted_bug_skipped_centering...[auto]",
    "tests/test_fx.py::test_report_names_weights_by_their_state_dict_names": "test_train.py's names test",
    "tests/test_fx.py::test_folded_module_takes_other_sequence_lengths": "test_backend_verifies_with_an_unbacked...",
    "tests/test_fx.py::test_half_precision_fold_is_as_accurate_as_the_original": "test_lowprecision.py",
    "tests/test_crms.py::test_onnx_pre_ln_models_compress[gpt_neox]": "[vit]",
    "tests/test_crms.py::test_fx_pre_ln_models_compress[gpt_neox]": "[gpt2]",
    "tests/test_crms.py::test_fx_pre_ln_models_compress[vit]": "[gpt2]",
    "tests/test_crms.py::test_onnx_bert_only_the_embedding_component_compresses": "test_fx_bert_falls_back...",
    "tests/test_crms.py::test_cli_fold_crms": "test_onnx_pre_ln_models_compress[vit]; the fuzzer's crms seeds",
    "tests/test_checkpoint_depth.py::test_the_shallow_plan_extended_is_the_whole_models_plan[bloom]": "[gpt2]",
    "tests/test_checkpoint_depth.py::test_the_shallow_plan_extended_is_the_whole_models_plan[gpt_neox]": "[gpt2]",
    "tests/test_checkpoint_depth.py::test_the_shallow_plan_extended_is_the_whole_models_plan[opt]": "[gpt2]",
    "tests/test_checkpoint_depth.py::test_a_per_block_setting_in_the_config_plans_every_block": "[gpt2] above",
    "tests/test_checkpoint.py::test_the_loaded_output_hands_off_to_the_rmsnorm_model_quantizers_take":
        "test_handoff.py",
    "tests/test_checkpoint.py::test_bf16_rows_go_through_float64_and_are_rounded_once": "test_a_skipped_centering...",
    "tests/test_checkpoint.py::test_gpt_neox_whose_file_names_differ_from_the_model": "test_a_skipped_centering...",
    "tests/test_checkpoint.py::test_a_wrong_edit_is_refused_at_the_first_norm_it_breaks":
        "test_a_skipped_centering_is_refused",
    "tests/test_checkpoint.py::test_fp32_through_the_command_line": "test_a_skipped_centering_is_refused",
    "tests/test_slice.py::test_both_frontends_slice_the_same_streams_with_the_same_widths":
        "test_planted_bug_reader_left_unprojected; the full-width tests",
    "tests/test_slice.py::test_slice_then_quantize": "test_quantize.py; test_planted_bug_reader_left_unprojected",
    "tests/test_slice.py::test_torch_full_width_slice_is_the_exact_fold": "the ONNX full-width test",
    "tests/test_slice.py::test_torch_per_block_full_width_is_the_exact_fold": "the ONNX per-block tests (one plan)",
    "tests/test_slice.py::test_torch_budget": "the ONNX budget tests (the search is passes/slicer.py's, shared)",
    "tests/test_train.py::test_use_cache_outputs_verify_in_a_fresh_process": "test_vit_trains_exactly",
    "tests/test_train.py::test_names_state_dict_tie_and_report_are_kept_and_unfold_restores": "test_vit_trains_exactly",
    "tests/test_train.py::test_default_gpt2_says_which_dropout_to_set_and_folds_once_set":
        "test_train_mode_dropout_on_the_stream_keeps_the_norms",
    "tests/test_train.py::test_planted_bug_rmsnorm_without_centering_trains_differently[every centering]":
        "[one ...] (the same planted bug, one norm)",
    "tests/test_train.py::test_activation_checkpointing_recomputes_centered_weights": "test_vit_trains_exactly",
    "tests/test_train.py::test_backend_says_once_why_a_fragment_folds_nothing": "test_hf_defaults.py's backend [vit]",
    "tests/test_trained.py::test_fold_for_training_trains_like_the_original": "test_train.py",
    "tests/test_trained.py::test_planted_missed_centering_changes_perplexity_and_is_refused_by_fold_module":
        "test_fold_module_keeps_the_metric[gpt2_stdlib]; test_fx.py's planted bug",
    # (the trained GPT-2's dynamo ONNX export alone costs ~10 s: the fast run folds the trained model
    # through fold_module, ~5 s, and the ONNX fold of it runs in CI)
    "tests/test_trained.py::test_onnx_fold_keeps_the_metric[gpt2_stdlib]": "test_fold_module_keeps_the_metric[...]",
    "tests/test_trained.py::test_planted_missed_centering_changes_perplexity_and_is_refused_by_onnx":
        "test_onnx_fold.py's and test_fx.py's planted bugs; test_fold_module_keeps_the_metric[gpt2_stdlib]",
    "tests/test_verify_cost.py::test_a_planted_bug_is_still_refused": "test_a_planted_bug_is_refused_through_segments",
    "tests/test_package.py::test_report_says_what_was_edited": "test_fold_json_and_help",
    "tests/test_bench.py::test_bench_prints_kernels_and_end_to_end_ratios": "the other test_bench tests",
    "tests/test_zoo_quiet.py::test_zoo_models_build_without_warnings": "the zoo models the other tests build",
    "tests/test_folders.py::test_folders_it_cannot_fold_are_one_line_errors[checkpoint-config.json: cannot read it as a transformers config]": "test_hostile.py",
    "tests/test_folders.py::test_a_failing_file_leaves_no_output_folder": "test_hostile.py",
    "tests/test_folders.py::test_default_outputs_and_a_single_file_keeps_its_data_file_name":
        "test_optimum_folder_folds_every_file_in_one_report",
    "tests/test_folders.py::test_external_data_comes_back_in_its_layout": "test_hostile.py's external-data tests",
    "tests/test_differential.py::test_fold_module_judges_xglm_against_float64": "the fuzzer's FX seeds",
    "tests/test_differential.py::test_frontends_find_the_same_linear_readers_for_deferral_and_crms":
        "test_frontends_agree_on_generated_models",
    "tests/test_differential.py::test_fold_module_finds_hand_written_layernorms_and_x_at_w_t": "the fuzzer's FX seeds",
    "tests/test_defer.py::test_cli_defer_on": "test_fold_module_deferred_is_exact_against_float64[gpt2]",
    "tests/test_defer.py::test_fold_module_deferred_is_exact_against_float64[vit]": "[gpt2]",
    "tests/test_defer.py::test_backend_deferred_is_exact_against_float64[gpt2]":
        "test_backend_bias_follows_a_changed_parameter (ViT, deferred); test_backend_planted_bug...",
    "tests/test_reasons.py::test_report_on_a_folded_model_lists_its_rmsnorms": "test_near_miss_is_reported...",
    "tests/test_reasons.py::test_json_lists_every_blocker_by_its_full_name": "test_near_miss_is_reported...",
    "tests/test_last_mile.py::test_torch_einsum_projection_is_a_source": "the fuzzer's torch.matmul sources",
    "tests/test_cli_usage.py::test_target_help_names_the_ops_each_target_emits": "the other usage tests",
    "tests/test_axes_select.py::test_heads_three_head_dim_q_and_k_norms_fold_v_rows_untouched": "test_qk_norm.py",
    "tests/test_qk_norm.py::test_fused_qkv_q_and_k_norms_fold_v_rows_untouched[slices]": "[split]",
    "tests/test_handoff.py::test_handoff_is_the_users_module_with_plain_rmsnorms_and_exact[gpt2-hadamard]":
        "test_a_planted_bug_is_refused_and_the_module_restored",
    "tests/test_handoff.py::test_a_constant_left_unrotated_is_refused":
        "test_a_planted_bug_is_refused_and_the_module_restored",
    "tests/test_computed_shapes.py::test_transformers_dinov2_exported_by_torchscript_slices":
        "the hand-built ViT graphs with the same three computed shapes",
    "tests/test_slice.py::test_torch_sequential_per_block_matches_onnx":
        "test_sequential_bases_differ_from_one_shot_and_slice_as_well; test_torch_per_block_full_width_is_the_exact_fold",
    "tests/test_slice.py::test_torch_full_width_head_matches_onnx":
        "test_full_width_head_keeps_the_last_segment_d_wide; test_torch_per_block_full_width_is_the_exact_fold",
    "tests/test_rms_torch.py::test_center_embeddings_slices_as_the_module_whose_embedding_was_centered_by_hand":
        "tests/test_rms_streams.py's center_embeddings tests (the plan and the slicer are the ONNX ones)",
    # issue 43/44/47 tests (2026-12-02): one representative of each stays in the fast run
    "tests/test_hostile_paths.py::test_tensors_of_every_safetensors_dtype_are_copied_as_they_are[dtype1]":
        "[dtype0] (uint16: the same size table)",
    "tests/test_hostile_paths.py::test_tensors_of_every_safetensors_dtype_are_copied_as_they_are[dtype2]":
        "[dtype0] (uint16: the same size table)",
    "tests/test_hostile_paths.py::test_tensors_of_every_safetensors_dtype_are_copied_as_they_are[dtype3]":
        "[dtype0] (uint16: the same size table)",
    "tests/test_hostile_paths.py::test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_folds":
        "test_a_symlink_to_a_file_inside_is_copied_as_that_file (outputs.inside, the same check)",
    "tests/test_publish.py::test_kill_between_the_renames_never_leaves_a_mixed_pair[1]": "[2] (the reported mixed pair)",
    "tests/test_publish.py::test_kill_between_the_renames_never_leaves_a_mixed_pair[3]": "[2] (the reported mixed pair)",
    "tests/test_publish.py::test_kill_between_the_renames_never_leaves_a_mixed_pair[4]": "[2] (the reported mixed pair)",
    "tests/test_hostile_depth.py::test_a_deep_stream_without_value_info_folds":
        "test_hostile_sizes.py's walk-order tests (the same stack walk, float_dtype)",
    "tests/test_backend_weights.py::test_writes_through_data[data_copy_]": "[data_mul_]",
    "tests/test_backend_weights.py::test_writes_through_data[data_add_]": "[data_mul_]",
    "tests/test_backend_weights.py::test_writes_through_data[data_assign]": "[data_mul_]",
    "tests/test_defer.py::test_onnx_deferred_is_exact_against_float64[vit]": "[gpt2]",
    "tests/test_defer.py::test_onnx_auto_follows_the_cost_model":
        "test_plan_refusals.py's auto-deferral refusal; test_fold_module_auto_defers_nothing_in_eager_mode",
    # three CLI subprocesses each: the same report / report --json / fold paths as the one id the fast run keeps
    "tests/test_reasons.py::test_near_miss_is_reported_with_its_reason[variance-over-other-axes]":
        "[variance-of-uncentered-input]",
    "tests/test_reasons.py::test_near_miss_is_reported_with_its_reason[eps-not-a-constant]":
        "[variance-of-uncentered-input]",
    "tests/test_reasons.py::test_near_miss_is_reported_with_its_reason[keras-gamma-two-axes]":
        "[variance-of-uncentered-input]; test_a_recognized_norm_and_a_plain_centering_are_no_near_misses",
    "tests/test_onnx_fold.py::test_cli_fold_and_report":
        "test_package.py's fold --json; test_bert_only_embeddings_layernorm_folds; test_reasons' CLI report",
    "tests/test_quantize_logging.py::test_int4_quantization_leaves_the_root_logger_as_it_was":
        "test_quantize.py (a fresh process for the root logger)",
    # 2026-12-03, on the slower CI machine (the fast run took 3:35): parameters of one test whose
    # other parameters stay in the fast run, the same code on another input
    # (the same check, properties.check(case, ("onnx", "fx")), as the fuzzer's FX seeds 0-5)
    "tests/test_differential.py::test_frontends_agree_on_generated_models":
        "test_fuzz.py::test_fx_random_model_and_agreement",
    "tests/test_differential.py::test_zeroed_rows_and_resized_tables[no-grad positions]": "[zeroed rows]",
    "tests/test_differential.py::test_zeroed_rows_and_resized_tables[rows of ones]": "[zeroed rows]",
    "tests/test_differential.py::test_zeroed_rows_and_resized_tables[resized along the grid]":
        "[resized along the features]",
    "tests/test_toolchain.py::test_lnfold_again[onnx]": "[portable]",
    "tests/test_toolchain.py::test_lnfold_again[ort]": "[portable]",
    "tests/test_handoff.py::test_handoff_is_the_users_module_with_plain_rmsnorms_and_exact[opt-hadamard]":
        "[vit-hadamard]",
    "tests/test_qk_norm.py::test_unaligned_heads_are_kept_with_a_reason[interleaved-heads]": "[misaligned-slice]",
    "tests/test_qk_norm.py::test_unaligned_heads_are_kept_with_a_reason[scalar-shift-on-fused]": "[misaligned-slice]",
    "tests/test_qk_norm.py::test_planted_fused_bug_fails_verification[skip-head]": "[whole-range]",
    "tests/test_checkpoint.py::test_verification_names_the_folded_norm_at_fault[a stream's mean]": "[a norm's gamma]",
    "tests/test_rotate_recentered.py::test_a_recentered_stream_rotates_exactly[onnx-conv-hadamard]":
        "[onnx-tanh-hadamard], [onnx-conv-orthogonal]",
    "tests/test_rotate_recentered.py::test_a_recentered_stream_rotates_exactly[fx-conv-orthogonal-keep-ln]":
        "[fx-conv-hadamard]",
    "tests/test_quantize.py::test_each_weight_mode_runs_and_stays_close[int8-ortopt]": "[int8-optimum]",
    "tests/test_quantize.py::test_each_weight_mode_runs_and_stays_close[int4-ortopt]": "[int4-optimum]",
    "tests/test_fx_edges.py::test_a_stream_that_needs_a_recenter_is_refused_by_the_module_level_folds_and_"
    "recentered_by_fold_module[fold_for_training-the module-level training fold]": "[fold_to_rmsnorm-...]",
    "tests/test_trained.py::test_checkpoints_load_and_match_their_manifest[bert_stdlib]": "[gpt2_stdlib]",
    "tests/test_trained.py::test_checkpoints_load_and_match_their_manifest[vit_digits]": "[gpt2_stdlib]",
    "tests/test_train.py::test_folded_streams_are_zero_mean_inside_forward":
        "test_planted_bug_rmsnorm_without_centering_trains_differently[one centering] (a centering dropped shows)",
    "tests/test_handoff.py::test_torch_dynamic_quantization_takes_the_handoff": "test_quantize_module.py",
    "tests/test_crms.py::test_onnx_pre_ln_models_compress[vit]": "[gpt2]; the fuzzer's CRMS seeds",
    "tests/test_defer.py::test_backend_deferred_is_exact_against_float64[vit]":
        "test_hf_defaults.py::test_backend_with_default_config[vit]; test_backend_planted_bug_gamma_not_folded_fails",
    "tests/test_toolchain.py::test_quantize_static": "test_quantize.py::test_w8a8_static_calibrated_on_an_npz",
}


def full_run_only(nodeid: str) -> bool:
    """Is the test `nodeid` listed above, by its id or (every parameter) by its function's?"""
    return nodeid in FULL_RUN_ONLY or nodeid.split("[")[0] in FULL_RUN_ONLY
