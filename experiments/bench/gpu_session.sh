#!/bin/bash
# The GPU benchmark invocations behind experiments/results/ (issue 4's resource comparison, issue 5's seeds),
# in parts that each fit one 10-minute call of a 2-GPU machine: every part runs one bench invocation per GPU
# at once, each pinned to its own CPU cores (`taskset`; the runs' core pools split what they are given).
#
#   bash experiments/bench/gpu_session.sh PART OUT_DIR      PART: w3 | w3w2 | w2b | w2seeds1 | w2seeds2
#
# w3      GPU 0, cores 0-13 (12 sim cores + trainer + generation, as W3 specifies): W3 sync / async planned /
#         async no quotas / async equal quotas (generation 50 %, trainer 50 %), stage profile first; and at
#         the same time GPU 1, cores 16-31: W2 stage profile, async planned, sync (2 groups), 3 M env steps each.
#         (That first call ran out of device memory under the memory plan's pinned MPS limits, see
#         results/README.md; its stage profiles are kept as results/w{2,3}_resources_oom.json.)
# w3w2    the same comparison after the fix, in one call: W3 on GPU 0 (2 M env steps), W2 on GPU 1 (3 M),
#         each sync / async / async planned (--plan, calibrated at 100 % only) / async equal quotas.
# w2b     GPU 0 and GPU 1: W2 async no quotas, async equal quotas (34/33/33 %), and one async run whose rollout
#         quota changes at iteration 20 (the quota-change cost).
# w2seedsN  issue 5's W2 (fused, sync, async; 12 M env steps) for seeds 1 and 2, one per GPU; N=1: fused and
#         sync, N=2: async.
# w2s_fused | w2s_sync | w2s_async   the same seeds on a 1-GPU machine (16 cores): one schedule per call, seeds 1
#         and 2 one after the other on GPU 0, cores 0-15 (the kept seed 0 ran on one GPU and 16 cores too).
# On a 1-GPU machine, what issues 4 and 5 still lack, one call each (~9 min):
# w3a     W3 sync and async (no quotas), 2 M env steps, MPS, after deferred pinning (3c5130b); sync first, on a
#         cold compilation cache, which is where it stalled before.
# w3b     W3 async planned (--plan, calibrated at 100 %) and async with equal quotas (generation 50 / trainer 50).
# w3p     W3 async planned once more, after the planner's no-quota candidate (the same flags as w3b's async_plan).
# w2auto  W2 fused / sync / async / auto (MPS for the last three), 2 M env steps, 1 seed (issue 14 item 6).
# bf16w6  W2 fused in float32 and bfloat16, 2 M env steps; W6 fused and async, 1 M env steps, with its stage profile.
# w3ov    issue 15: W3 (native MuJoCo, separate generation) under sync, overlap, and overlap with slack-aware quotas
#         (--slack_quotas), MPS, 1.5 M env steps, 1 seed; the stage profile from w3_resources_1gpu.json.
# w2slack issue 15: W2 sync beside overlap with slack-aware quotas (--slack_quotas, the real MPS daemon), 2 M steps.
# w6      issues 13/14: W6 (the token policy) fused and async (MPS), 1 M env steps, no stage profile.
# autocal issue 14: what --schedule=auto's calibration costs on W2 (2 groups, MPS, quotas 25/50/100) on a fresh
#         machine (cold XLA cache) and then with the cache it left (warm), per quota and phase
#         (experiments/calibration_cost.py; before this change the first quota alone took 155 s, w2_auto_1gpu.json).
# w2screen issue 13 item 7: why W2's transformer does not learn, a screen of 4 variants at once on the one GPU
#         (XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 each; their throughputs are shared, not each one's own), fused, bf16,
#         up to 50 M env steps or 480 s: the trunk-shared critic (what W2 ran), the separate MLP critic
#         (--critic=auto), and the MLP critic with Brax's Ant optimiser settings (lr 3e-4, clip 0.3, grad norm 1),
#         with 2 and 4 epochs per batch.
# w2learn issue 13 item 7: W2 as its flagfile now says, alone on the GPU, fused, to its target (3000) or 50 M steps.
# w2chunk issue 13 item 7 (run: w2_chunk_screen_h200.json): the next suspect of W2's plateau at ~1300, the open-loop action chunk: W2
#         with chunks of 4 (as W2), 2 and 1 at once on the one GPU (a screen: shared throughputs), bf16, W2CHUNK_WALL_S (480 s) each.
# ipcmps  issue 14 item 1 (not yet run): the CUDA IPC generation check again under the run's MPS daemon, to test
#         whether the IPC path lost in the W1 run (0.33x co-located) from time-slicing without MPS.
# w1warp  issue 13: W1 fused on --backend=mjx and --backend=mjx_warp beside Brax's PPO on both (Brax on Warp through
#         our Warp env's wrappers, experiments/bench/brax_ppo.py), to 3000; one seed a call (W1WARP_SEED), each run
#         cut at W1WARP_RUN_S (135 s) so the four fit one call.
# manip   issue 13: push_cube learning, 3 runs at once on the one GPU (a screen: their throughputs are shared):
#         from state (MLP, MJX-Warp, experiments/push_cube_state.flags), from pixels (W5 on MJX-Warp) and the token
#         policy (W6), each stopped by --max_wall_s=MANIP_WALL_S (480 s).
# w6ratio issue 13 item 4: W6 (the token policy) with --policy_ratio=joint and =geometric, 2 runs at once on the GPU
#         (shared throughputs), --max_wall_s=MANIP_WALL_S (480 s): does the per-token ratio learn where the joint
#         one clips most samples (results/token_ratio_cpu.json)?
# w6dec   issues 13/14: experiments/decode_bench.py (W6's KV-cache decoding alone: ms per policy step, float32 and
#         bfloat16, scan unroll 1/3/12, beside prefill and the teacher-forced forward+gradient), then W6 fused vs
#         async with 4 groups (MPS), each stopped by --max_wall_s=W6_WALL_S (190 s) to see past W6's start-up.
# matrix  issue 14's matrix one call at a time: workload MATRIX_W (w1 | w1warp | w2 | w3 | w5 | w6), seed MATRIX_SEED,
#         MATRIX_U (--num_updates_per_batch: unset = the flagfile's, 1 / 16 for the other balance points), fused /
#         sync / async / auto (MPS, 2 groups), each stopped by --max_wall_s=MATRIX_RUN_S (125 s; four fit a call).
#         `auto` calibrates on a fresh machine's first use (into $ROOT/profiles, kept for later calls on the same warm
#         machine and brought back as OUT_DIR/matrix_profiles.tgz). MATRIX_SCHEDULES picks labels (e.g. auto alone first,
#         its calibration inside MATRIX_AUTO_S, auto's own --max_wall_s), MATRIX_AUTO_EXTRA harness flags for it (e.g.
#         --only=auto:--calibration_quotas=100 where a call cannot hold three quotas), MATRIX_TAG names the call,
#         MATRIX_TRAIN_S gives every label the same seconds of training (--max_train_s, start-up excluded; then
#         MATRIX_RUN_S is only the wall-clock safety net). Merge:
#         python -m experiments.bench.run --merge=matrix_w6_s0.json,matrix_w6_s1.json,... --out=...
# solver  experiments/solver_caps.py on the GPU (MJX-JAX push_cube steps/s at the default solver options and with
#         the iteration / linesearch caps, native fidelity; SOLVER_IMPLS=jax,warp adds MJX-Warp), then W6 fused with the defaults vs --ls_iterations=8,
#         each stopped by --max_wall_s=W6_WALL_S (150 s): is W6's simulation the linesearch's 50-step scan?
# w6ov    issue 15: W6 sync vs overlap (MPS, 2 groups, 1 seed), each stopped by --max_wall_s=W6_WALL_S (240 s), and
#         the timeline of overlap's iteration 10: what exact on-policy overlap buys on the VLA-style workload.
# startup issue 14 item 3: experiments/startup_cache.py on W1, `fused` then `sync` (MPS, 2 groups): cold and warm
#         start-up with and without the trace cache (startup_cache_h200.json measured `fused` before init was jitted).
# w6ov2   issue 15: W6 sync vs overlap again (W6_WALL_S each), now that overlap evaluates in the evaluator process.
# w5ov    issue 15: W5 on native MuJoCo (pixels rendered by EGL, experiments/w5_pixels.flags) sync vs overlap, MPS,
#         2 groups, each stopped by --max_wall_s=W5_WALL_S (130 s), and overlap's timeline (--trace_dir). The GPU
#         machine lacks GLVND's libEGL.so.1: carry the Debian packages the device README names (`.gl`) and unpack them
#         first (`for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig`), else `import mujoco` fails under MUJOCO_GL=egl.
# detcost issues 14/15: the throughput cost of XLA_FLAGS=--xla_gpu_deterministic_ops=true (what makes sync and
#         overlap repeat bit for bit on the GPU): `sync` and `sync_det` (the same with the flag, through the harness's
#         --label_env), MPS, 2 groups, each stopped by --max_wall_s=DETCOST_WALL_S (120 s); W1 unless DETCOST_FLAGFILE.
#         The budget counts from process start: at 45 s (stop 29) both runs ended after their first iteration, inside
#         W1's cold start-up (46-54 s), with no throughput to compare; keep it well above the start-up. At 120 s:
#         w1_detcost_1gpu.json (0.53x).
# ovdet   issue 15: whether `overlap` replays `sync` on the GPU once XLA's GPU ops are deterministic
#         (XLA_FLAGS=--xla_gpu_deterministic_ops=true for every process): W6 `sync`, `sync` again and `overlap`, MPS,
#         2 groups, OVDET_STEPS (4.1 M) env steps, 3 evaluations, then experiments/bench/curve_agreement.py on the
#         result (w6_overlap2_1gpu.json's curves parted from version 62 without it). OVDET_FLAGFILE / OVDET_NAME: another
#         workload (W1: experiments/w1_ant.flags, OVDET_STEPS=1000000, OVDET_RUN_S=70 fits what a call has left).
# startup now: the trace-cache mode only (STARTUP_MODES=trace_cache,notrace_cache for both), fused cold + 2 warm
#         and one more warm run under cProfile (where a warm start-up still goes), sync cold + warm.
# w2learn with W2LEARN_EXTRA="--extra=--action_chunk=2 --extra=--compute_dtype=bfloat16 --extra=--max_grad_norm=0.5":
#         the next W2 suspect after w2_learn_chunk2_h200.json's collapse (W2's flags clip no gradient norm).
# w5prof | w6prof  issues 13/14: the isolated stage times (t_sim, t_gen, t_train) of W5 on MJX-Warp or of W6 at
#         the three balance points' --num_updates_per_batch=1/4/16, each profile cut at 180 s: what W5's 6.5 k env
#         steps/s in manip_screen_h200 spends its time on, and which rho each point lands at.
# w2x     W2 fused seed 1 again (cut by its limit at 11.5 M in the w2s_fused call), then the quota-change run
#         (rollout 20 -> 25 % at iteration 10 of 48, 3 M steps) whose whole output is kept.
# pixlearn issue 13 item 3: push_cube learned from pixels (experiments/push_cube_pixels.flags: MJX-Warp frames beside
#         the arm's own state only, CNN + MLP heads), fused, alone on the GPU, to its target or PIXLEARN_WALL_S (470 s;
#         PIXLEARN_EXTRA adds harness flags, e.g. --seeds=1); then tests/sim/test_warp_pixels.py on the GPU with
#         EBRL_FULL_TESTS=1 (its Warp rendering and --pixel_state=proprio tests, which skip on CPU machines; the first
#         call ran without it and did not print why 3 skipped) into pixlearn_warp_tests.log.
# w6learn issue 13 item 4: the token policy (W6's flags) learning push_cube, a screen of 4 variants at once on the one
#         GPU under one MPS daemon that every run shares (so their kernels run side by side instead of time-slicing;
#         throughputs are shared ones), fused, each stopped by --max_wall_s=W6LEARN_WALL_S (480 s): W2's learning recipe
#         (lr 1e-4, gradient-norm clip 0.5, PopArt, the lr decaying to 0) with action chunks of 4 (W6's), 2 and 1, and
#         chunk 4 at W6's lr of 3e-4 with the rest of the recipe. Compile caches shared (warm for a later call on the
#         same machine); W6LEARN_EXTRA adds harness flags (e.g. --extra=--resume to continue the runs' checkpoints).
# w6seeds issue 13 item 4: experiments/w6_learn.flags (the screen's chunk-1 variant as a flagfile) at seeds W6SEEDS
#         (1,2), two at once under one shared MPS daemon, each stopped by --max_wall_s=W6LEARN_WALL_S (525 s);
#         W6LEARN_EXTRA=--extra=--resume continues them in the next call on the same warm machine.
# The device tool brings back at most 8 files a call: each invocation leaves one file, OUT_DIR/PART.tgz (what it
# wrote: JSON, telemetry, log tails, each run's output and metrics), so OUT_DIR=$OUT is fine, several parts a call too;
# part `pack` packs what is already there (PACK_SINCE). EBRL_BENCH_ROOT moves the work folder (/tmp/ebrl_bench).
# Every MPS daemon a run started is stopped by the run itself,
# and any left behind (a killed run) is stopped here.
set -u
PART=$1
OUT_DIR=$2
mkdir -p "$OUT_DIR"
ROOT=${EBRL_BENCH_ROOT:-/tmp/ebrl_bench}
mkdir -p $ROOT
TIMEOUT=${BENCH_TIMEOUT_S:-560}
STAMP=$(mktemp)  # what this invocation writes is newer than this
trap 'rm -f "$STAMP"' EXIT  # also when a part is refused or the script is stopped

bench() {  # bench NAME CORES ARGS...: one harness invocation, its output under $ROOT/NAME
  local name=$1 cores=$2
  shift 2
  timeout -s TERM "$TIMEOUT" taskset -c "$cores" python3 -m experiments.bench.run --out=$ROOT/$name.json "$@" \
    > $ROOT/$name.log 2>&1
  echo "[$name] exit $?"
}

overlap_pair() {  # overlap_pair NAME FLAGFILE WALL_S [ITERATION]: sync vs overlap (MPS, 2 groups), each stopped by
  # --max_wall_s=WALL_S; with ITERATION, overlap traced and that iteration's timeline in NAME's stem_h200_timeline_itN.json
  local name=$1 flagfile=$2 w=$3 it=${4:-} trace=()
  [ -n "$it" ] && trace=(--only=overlap:--trace_dir=$ROOT/${name}_tr)
  bench $name 0-15 --bench_flagfile=$flagfile --gpus=0 --schedules=sync,overlap --extra=--num_groups=2 \
    --extra=--use_mps --extra=--max_wall_s=$w "${trace[@]}" --timeout_s=$((w + 40))
  [ -z "$it" ] && return
  timeout -s TERM 60 python3 -m experiments.bench.timeline --traces=$ROOT/${name}_tr --timeline_iteration=$it \
    --timeline_out=$ROOT/${name%_1gpu}_h200_timeline_it$it.json > $ROOT/${name}_timeline.log 2>&1
  echo "[${name}_timeline] exit $?"
}

shared_mps() {  # one MPS daemon for every process started after this (the end of the script stops it)
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps_shared.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY/log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "[mps] one daemon for every run: $CUDA_MPS_PIPE_DIRECTORY"
}

W2="--bench_flagfile=experiments/w2_transformer.flags --extra=--target_return=1000"
# Issue 5's W2 flags, in the order of the kept seed-0 result (results/w2_bench.json), so the seeds merge.
W2SEEDS="--bench_flagfile=experiments/w2_transformer.flags --extra=--num_groups=2 --extra=--num_timesteps=12000000
  --extra=--num_evals=24 --extra=--target_return=1000"
W3="--bench_flagfile=experiments/w3_heterogeneous.flags"
case $PART in
  w3)
    bench w3_resources 0-13 $W3 --gpus=0 --stage_profile --timeout_s=240 \
      --schedules=sync,async_plan=async,async,async_eq=async --extra=--use_mps \
      --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_plan:--plan --only=async_eq:--sm_quotas=generation=50,trainer=50 &
    bench w2_resources_a 16-31 $W2 --gpus=1 --stage_profile --timeout_s=330 \
      --schedules=async_plan=async,sync --extra=--use_mps --extra=--num_groups=2 \
      --extra=--num_timesteps=3000000 --extra=--num_evals=3 --only=async_plan:--plan &
    wait ;;
  w3w2)  # after the memory-plan fix: both workloads' four variants, stage profiles from the first call's results
    bench w3_resources 0-13 $W3 --gpus=0 --stage_profile_from=experiments/results/w3_resources_oom.json \
      --timeout_s=240 --schedules=sync,async,async_plan=async,async_eq=async --extra=--use_mps \
      --extra=--num_timesteps=2000000 --extra=--num_evals=3 \
      --only=async_plan:--plan --only=async_plan:--calibration_quotas=100 \
      --only=async_eq:--sm_quotas=generation=50,trainer=50 &
    bench w2_resources 16-31 $W2 --gpus=1 --stage_profile_from=experiments/results/w2_resources_oom.json \
      --timeout_s=330 --schedules=sync,async,async_plan=async,async_eq=async --extra=--use_mps \
      --extra=--num_groups=2 --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_plan:--plan --only=async_plan:--calibration_quotas=100 \
      --only=async_eq:--sm_quotas=trainer=34,rollout=33 &
    wait ;;
  last)  # the third call: W3 again at 500 k env steps (its sync did not finish 2 M in 240 s), and on GPU 1 W2's
          # equal-quota run (cut by the second call's time limit) and the quota-change run
    bench w3_resources_500k 0-13 $W3 --gpus=0 --stage_profile_from=experiments/results/w3_resources_oom.json \
      --timeout_s=125 --schedules=sync,async,async_plan=async,async_eq=async --extra=--use_mps \
      --extra=--num_timesteps=500000 --extra=--num_evals=2 \
      --only=async_plan:--plan --only=async_plan:--calibration_quotas=100 \
      --only=async_eq:--sm_quotas=generation=50,trainer=50 &
    (bench w2_resources_eq 16-31 $W2 --gpus=1 --stage_profile_from=experiments/results/w2_resources_oom.json \
      --timeout_s=200 --schedules=async_eq=async --extra=--use_mps \
      --extra=--num_groups=2 --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_eq:--sm_quotas=trainer=34,rollout=33
     bench w2_quota_change 16-31 $W2 --gpus=1 --timeout_s=250 --schedules=async_swap=async \
      --extra=--use_mps --extra=--num_groups=2 --extra=--num_timesteps=2000000 --extra=--num_evals=2 \
      --only=async_swap:--sm_quotas=trainer=50,rollout=20 --only=async_swap:--quota_schedule=10:rollout=25) &
    wait ;;
  w2b)
    bench w2_resources_b 0-15 $W2 --gpus=0 --timeout_s=270 --schedules=async,async_eq=async \
      --extra=--use_mps --extra=--num_groups=2 --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_eq:--sm_quotas=trainer=34,rollout=33 &
    bench w2_quota_change 16-31 $W2 --gpus=1 --timeout_s=400 --schedules=async_swap=async \
      --extra=--use_mps --extra=--num_groups=2 --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_swap:--sm_quotas=trainer=50,rollout=20 --only=async_swap:--quota_schedule=15:rollout=25 &
    wait ;;
  w2seeds1)
    for s in 1 2; do
      c=$([ $s = 1 ] && echo 0-15 || echo 16-31)
      bench w2_bench_fs_seed$s $c $W2SEEDS --gpus=$((s - 1)) --seeds=$s --schedules=fused,sync --timeout_s=300 \
        --only=sync:--use_mps &
    done
    wait ;;
  w2seeds2)
    for s in 1 2; do
      c=$([ $s = 1 ] && echo 0-15 || echo 16-31)
      bench w2_bench_a_seed$s $c $W2SEEDS --gpus=$((s - 1)) --seeds=$s --schedules=async --timeout_s=330 \
        --only=async:--use_mps &
    done
    wait ;;
  w2s_fused|w2s_sync|w2s_async)
    sched=${PART#w2s_}
    mps=$([ $sched = fused ] || echo --only=$sched:--use_mps)
    bench w2_bench_${sched}_seeds12 0-15 $W2SEEDS --gpus=0 --seeds=1,2 --schedules=$sched --timeout_s=285 $mps ;;
  w3a|w3b)
    if [ $PART = w3a ]; then sched="--schedules=sync,async"; else
      sched="--schedules=async_plan=async,async_eq=async --only=async_plan:--plan
        --only=async_plan:--calibration_quotas=100 --only=async_eq:--sm_quotas=generation=50,trainer=50"; fi
    bench w3_resources_1gpu_$PART 0-15 $W3 --gpus=0 --stage_profile_from=experiments/results/w3_resources_oom.json \
      --timeout_s=270 $sched --extra=--use_mps --extra=--num_timesteps=2000000 --extra=--num_evals=3 ;;
  w3p)  # W3 planned again after the planner learned to predict runs without quotas (it chose quotas before)
    bench w3_resources_1gpu_w3p 0-15 $W3 --gpus=0 --stage_profile_from=experiments/results/w3_resources_oom.json \
      --timeout_s=280 --schedules=async_plan_shared=async --only=async_plan_shared:--plan \
      --only=async_plan_shared:--calibration_quotas=100 --extra=--use_mps --extra=--num_timesteps=2000000 \
      --extra=--num_evals=3 ;;
  w2x)
    bench w2_bench_fused_seed1 0-15 $W2SEEDS --gpus=0 --seeds=1 --schedules=fused --timeout_s=300
    bench w2_quota_change_1gpu 0-15 $W2 --gpus=0 --timeout_s=230 --schedules=async_swap=async \
      --extra=--use_mps --extra=--num_groups=2 --extra=--num_timesteps=3000000 --extra=--num_evals=3 \
      --only=async_swap:--sm_quotas=trainer=50,rollout=20 --only=async_swap:--quota_schedule=10:rollout=25 ;;
  w2auto)  # issue 14: the four schedules side by side after the evaluator process, --schedule=auto among them
    bench w2_auto_1gpu 0-15 $W2 --gpus=0 --schedules=fused,sync,async,auto --extra=--num_groups=2 \
      --extra=--num_timesteps=2000000 --extra=--num_evals=3 --only=sync:--use_mps --only=async:--use_mps \
      --only=auto:--use_mps --timeout_s=125 --label_timeout_s=auto:175 ;;
  bf16w6)  # issue 13: W2 in bfloat16 beside float32 (fused); W6 (the token policy) fused and async, its stages
    bench w2_bf16_1gpu 0-15 $W2 --gpus=0 --schedules=fused,fused_bf16=fused --extra=--num_timesteps=2000000 \
      --extra=--num_evals=3 --only=fused_bf16:--compute_dtype=bfloat16 --timeout_s=130
    bench w6_token_1gpu 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0 --schedules=fused,async \
      --stage_profile --extra=--num_groups=2 --extra=--num_timesteps=1000000 --extra=--num_evals=3 \
      --only=async:--use_mps --timeout_s=130 ;;
  w3ov)  # issue 15: W3 sync / overlap / overlap with slack-aware quotas, one call
    bench w3_overlap_1gpu 0-15 $W3 --gpus=0 --stage_profile_from=experiments/results/w3_resources_1gpu.json \
      --schedules=sync,overlap,overlap_slack=overlap --extra=--use_mps --extra=--num_timesteps=1500000 \
      --extra=--num_evals=3 --only=overlap_slack:--slack_quotas --only=overlap:--trace_dir=$ROOT/w3_tr \
      --timeout_s=160 ;;
  w2slack)  # issue 15: slack-aware quotas on a workload whose rollout workers hold a GPU context (MJX)
    bench w2_slack_1gpu 0-15 $W2 --gpus=0 --schedules=sync,overlap_slack=overlap --extra=--num_groups=2 \
      --extra=--use_mps --extra=--num_timesteps=2000000 --extra=--num_evals=3 --only=overlap_slack:--slack_quotas \
      --timeout_s=140 ;;
  w6)  # issues 13/14: W6 fused and async, no stage profile (it took > 130 s on the H200)
    bench w6_token_1gpu 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0 --schedules=fused,async \
      --extra=--num_groups=2 --extra=--num_timesteps=1000000 --extra=--num_evals=3 --only=async:--use_mps \
      --timeout_s=120 ;;
  autocal)  # issue 14: auto's calibration cost on W2, cold then warm compilation cache
    timeout -s TERM "$TIMEOUT" taskset -c 0-15 python3 -m experiments.calibration_cost \
      --flagfile=experiments/w2_transformer.flags --num_groups=2 --use_mps \
      --calibration_out=$ROOT/calibration_cost_w2_h200.json --calibration_label=after > $ROOT/autocal.log 2>&1
    echo "[autocal] exit $?" ;;
  w2screen)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.22
    bench w2_learn_screen 0-15 --bench_flagfile=experiments/w2_transformer.flags --gpus=0,0,0,0 \
      --schedules=shared=fused,mlp=fused,mlp_lr=fused,mlp_lr_u4=fused --extra=--compute_dtype=bfloat16 \
      --extra=--num_timesteps=50000000 --extra=--num_evals=25 --extra=--max_wall_s=480 --extra=--target_return=3000 \
      --only=shared:--critic=shared --only=mlp_lr:--learning_rate=3e-4 --only=mlp_lr:--clip_epsilon=0.3 \
      --only=mlp_lr:--max_grad_norm=1.0 --only=mlp_lr_u4:--learning_rate=3e-4 --only=mlp_lr_u4:--clip_epsilon=0.3 \
      --only=mlp_lr_u4:--max_grad_norm=1.0 --only=mlp_lr_u4:--num_updates_per_batch=4 --timeout_s=540 ;;
  w2learn)
    bench w2_learn 0-15 --bench_flagfile=${W2LEARN_FLAGFILE:-experiments/w2_transformer.flags} --gpus=0 --schedules=fused \
      --extra=--num_timesteps=50000000 --extra=--num_evals=25 --extra=--max_wall_s=${W2LEARN_WALL_S:-540} \
      --timeout_s=$((${W2LEARN_WALL_S:-540} + 30)) ${W2LEARN_EXTRA:-} ;;
  w2chunk)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    bench w2_chunk_screen 0-15 --bench_flagfile=experiments/w2_transformer.flags --gpus=0,0,0 \
      --schedules=k4=fused,k2=fused,k1=fused --extra=--compute_dtype=bfloat16 --extra=--num_timesteps=50000000 \
      --extra=--num_evals=25 --extra=--max_wall_s=${W2CHUNK_WALL_S:-480} --only=k2:--action_chunk=2 --only=k1:--action_chunk=1 \
      --timeout_s=$((${W2CHUNK_WALL_S:-480} + 60)) ;;
  ipcmps)
    timeout -s TERM "$TIMEOUT" taskset -c 0-15 python3 experiments/ipc_generation_check.py \
      --out $ROOT/ipc_generation_check_mps_h200.json --extra_flags=--use_mps > $ROOT/ipcmps.log 2>&1
    echo "[ipcmps] exit $?" ;;
  w1warp)  # issue 13: W1 fused on MJX (JAX) and MJX-Warp beside Brax's PPO on both, one seed per call
    bench w1_warp_1gpu_s${W1WARP_SEED:-0} 0-15 --bench_flagfile=experiments/w1_ant.flags --gpus=0 \
      --seeds=${W1WARP_SEED:-0} --schedules=fused,fused_warp=fused,brax,brax_warp=brax \
      --only=fused_warp:--backend=mjx_warp --only=brax_warp:--backend=mjx_warp --timeout_s=${W1WARP_RUN_S:-135} ;;
  manip)  # issue 13: the manipulation task learning, 3 runs at once on the one GPU (shared throughputs)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    w=${MANIP_WALL_S:-480}
    for spec in state:push_cube_state:0-4 pixels:w5_pixels_warp:5-9 token:w6_token:10-15; do
      IFS=: read -r label flagfile cores <<< "$spec"
      bench manip_$label $cores --bench_flagfile=experiments/$flagfile.flags --gpus=0 --schedules=fused \
        --extra=--max_wall_s=$w --timeout_s=$((w + 60)) &
    done
    wait ;;
  w6ratio)  # issue 13 item 4: W6's token policy with the joint vs the geometric (per-token) PPO ratio, at once
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
    w=${MANIP_WALL_S:-480}
    bench w6_ratio 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0,0 --schedules=joint=fused,geometric=fused \
      --only=geometric:--policy_ratio=geometric --extra=--max_wall_s=$w --timeout_s=$((w + 60)) ;;
  w6dec)  # issues 13/14: W6's token decoding timed alone, then W6 fused vs async with 4 groups (MPS) past start-up
    timeout -s TERM 150 taskset -c 0-15 python3 -m experiments.decode_bench --out=$ROOT/decode_bench_h200.json \
      > $ROOT/decode_bench.log 2>&1
    echo "[decode_bench] exit $?"
    bench w6_async4_1gpu 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0 --schedules=fused,async \
      --only=async:--use_mps --only=async:--num_groups=4 --extra=--max_wall_s=${W6_WALL_S:-190} \
      --timeout_s=$((${W6_WALL_S:-190} + 40)) ;;
  matrix)  # issue 14: one workload's fused / sync / async / auto at one seed and one --num_updates_per_batch
    w=${MATRIX_W:-w6}; seed=${MATRIX_SEED:-0}; u=${MATRIX_U:-}; run_s=${MATRIX_RUN_S:-125}
    case $w in
      w1) ff=w1_ant; x= ;;  w1warp) ff=w1_ant; x=--extra=--backend=mjx_warp ;;  w2) ff=w2_transformer; x= ;;
      w3) ff=w3_heterogeneous; x= ;;  w5) ff=w5_pixels_warp; x= ;;  w6) ff=w6_token; x= ;;
      *) echo "MATRIX_W=$w: one of w1 w1warp w2 w3 w5 w6"; exit 2 ;;
    esac
    scheds=${MATRIX_SCHEDULES:-fused,sync,async,auto}; auto_s=${MATRIX_AUTO_S:-$run_s}
    mkdir -p $ROOT/profiles  # the auto label's profile store: calibrated once on this machine, read by later calls
    per=()  # the per-label flags of the labels this call runs (the harness refuses flags for absent labels)
    for l in sync async; do [[ ,$scheds, == *,$l,* ]] && per+=(--only=$l:--use_mps); done
    [[ ,$scheds, == *,auto,* ]] && per+=(--only=auto:--use_mps --only=auto:--profile_dir=$ROOT/profiles \
      --only=auto:--max_wall_s=$auto_s --label_timeout_s=auto:$((auto_s + 20)) ${MATRIX_AUTO_EXTRA:-})
    bench matrix_${w}${u:+_u$u}_s$seed${MATRIX_TAG:+_$MATRIX_TAG} 0-15 --bench_flagfile=experiments/$ff.flags \
      --gpus=0 --seeds=$seed $x --schedules=$scheds --extra=--num_groups=2 ${u:+--extra=--num_updates_per_batch=$u} \
      --extra=--max_wall_s=$run_s ${MATRIX_TRAIN_S:+--extra=--max_train_s=$MATRIX_TRAIN_S} "${per[@]}" \
      --timeout_s=$((run_s + 15))
    tar czf $OUT_DIR/matrix_profiles.tgz -C $ROOT profiles ;;
  solver)  # the solver caps on the GPU: MJX step rates per cap, then W6 fused with the defaults vs --ls_iterations=8
    timeout -s TERM 200 taskset -c 0-15 python3 -m experiments.solver_caps --impls=${SOLVER_IMPLS:-jax} --out=$ROOT/solver_caps_h200.json \
      > $ROOT/solver_caps.log 2>&1
    echo "[solver_caps] exit $?"
    bench w6_ls8_1gpu 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0 --schedules=fused,ls8=fused \
      --only=ls8:--ls_iterations=8 --extra=--max_wall_s=${W6_WALL_S:-150} --timeout_s=$((${W6_WALL_S:-150} + 40)) ;;
  w6ov)  # issue 15: W6 (the token policy, VLA-style) under sync and overlap (MPS, 2 groups), 1 seed, each stopped
    # by --max_wall_s=W6_WALL_S (240 s); the timeline of overlap's iteration 10
    overlap_pair w6_overlap_1gpu experiments/w6_token.flags ${W6_WALL_S:-240} 10 ;;
  startup)  # issue 14 item 3: start-up cold then warm, with and without the trace cache: W1 fused, then W1 sync (MPS)
    timeout -s TERM 200 taskset -c 0-15 python3 -m experiments.startup_cache --flagfile_run=experiments/w1_ant.flags \
      --repeats=3 --modes=${STARTUP_MODES:-trace_cache} --profile --profile_top=60 --out=$ROOT/startup_cache_h200.json \
      > $ROOT/startup_cache.log 2>&1
    echo "[startup fused] exit $?"
    if [ "${STARTUP_SYNC:-1}" != 0 ]; then  # STARTUP_SYNC=0: fused only
      timeout -s TERM 200 taskset -c 0-15 python3 -m experiments.startup_cache --flagfile_run=experiments/w1_ant.flags \
        --repeats=2 --modes=${STARTUP_MODES:-trace_cache} --out=$ROOT/startup_cache_sync_h200.json \
        -- --schedule=sync --num_groups=2 --use_mps > $ROOT/startup_cache_sync.log 2>&1
      echo "[startup sync] exit $?"
    fi ;;
  w6ov2)  # issue 15: W6 sync vs overlap again after overlap moved its evaluation to the evaluator process
    overlap_pair w6_overlap2_1gpu experiments/w6_token.flags ${W6_WALL_S:-240} ;;
  detcost)  # issues 14/15: what XLA's deterministic GPU ops cost, side by side in one invocation
    w=${DETCOST_WALL_S:-120}
    bench ${DETCOST_NAME:-w1_detcost_1gpu} 0-15 --bench_flagfile=${DETCOST_FLAGFILE:-experiments/w1_ant.flags} --gpus=0 \
      --schedules=sync,sync_det=sync --label_env="sync_det:XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true" \
      --extra=--num_groups=2 --extra=--use_mps --extra=--max_wall_s=$w --timeout_s=$((w + 60)) ;;
  ovdet)  # issue 15: GPU non-determinism apart from semantics: W6 sync twice and overlap under XLA's deterministic GPU ops
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
    n=${OVDET_NAME:-w6_ovdet_1gpu}
    bench $n 0-15 --bench_flagfile=${OVDET_FLAGFILE:-experiments/w6_token.flags} --gpus=0 \
      --schedules=sync,sync_b=sync,overlap --extra=--num_groups=2 --extra=--use_mps \
      --extra=--num_timesteps=${OVDET_STEPS:-4100000} --extra=--num_evals=3 --timeout_s=${OVDET_RUN_S:-180}
    python3 -m experiments.bench.curve_agreement $ROOT/$n.json --out=$ROOT/${n}_agreement.json \
      > $ROOT/ovdet_agreement.log 2>&1
    echo "[ovdet agreement] exit $?" ;;
  w5ov)  # issue 15: W5 (native MuJoCo pixels, EGL) sync vs overlap (MPS, 2 groups), W5_WALL_S each, overlap's timeline
    export MUJOCO_GL=egl
    overlap_pair w5_overlap_1gpu experiments/w5_pixels.flags ${W5_WALL_S:-130} 5 ;;
  w5prof|w6prof)  # issues 13/14: W5 (Warp pixels) or W6 isolated stage times at --num_updates_per_batch=1/4/16
    ff=$([ $PART = w5prof ] && echo w5_pixels_warp || echo w6_token)
    for u in 1 4 16; do
      timeout -s TERM 180 taskset -c 0-15 python3 -m experiments.bench.stage_profile --flagfile=experiments/$ff.flags \
        --num_updates_per_batch=$u --repeats=3 --profile_out=$ROOT/${PART}_u$u.json > $ROOT/${PART}_u$u.log 2>&1
      echo "[${PART}_u$u] exit $?"
    done ;;
  pixlearn)  # issue 13 item 3: push_cube from pixels and the arm's own state, fused, alone, then the Warp pixel tests
    w=${PIXLEARN_WALL_S:-470}
    bench pixlearn_h200 0-15 --bench_flagfile=experiments/push_cube_pixels.flags --gpus=0 --schedules=fused \
      --extra=--max_wall_s=$w --timeout_s=$((w + 40)) ${PIXLEARN_EXTRA:-}
    EBRL_FULL_TESTS=1 timeout -s TERM 240 python3 -m pytest -q -rs -p no:cacheprovider tests/sim/test_warp_pixels.py \
      > $ROOT/pixlearn_warp_tests.log 2>&1  # the opt-in Warp tests too, and why any test skipped
    echo "[pixlearn warp tests] exit $?" ;;
  w6learn)  # issue 13 item 4: the token policy learning push_cube, 4 variants at once under one shared MPS daemon
    w=${W6LEARN_WALL_S:-480}
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
    shared_mps
    bench w6_learn_screen 0-15 --bench_flagfile=experiments/w6_token.flags --gpus=0,0,0,0 --compile_cache=shared \
      --schedules=c4=fused,c2=fused,c1=fused,c4_lr3e4=fused --extra=--learning_rate=1e-4 --extra=--max_grad_norm=0.5 \
      --extra=--value_norm_rate=0.05 --extra=--learning_rate_end=0 --only=c2:--action_chunk=2 \
      --only=c1:--action_chunk=1 --only=c4_lr3e4:--learning_rate=3e-4 --extra=--max_wall_s=$w \
      --timeout_s=$((w + 60)) ${W6LEARN_EXTRA:-} ;;
  w6seeds)  # issue 13 item 4: w6_learn.flags at more seeds, two at once under one shared MPS daemon
    w=${W6LEARN_WALL_S:-525}
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    shared_mps
    bench w6_learn_seeds 0-15 --bench_flagfile=experiments/w6_learn.flags --gpus=0,0 --seeds=${W6SEEDS:-1,2} \
      --compile_cache=shared --schedules=c1=fused --extra=--max_wall_s=$w --timeout_s=$((w + 35)) ${W6LEARN_EXTRA:-} ;;
  pack)  # runs nothing: packs what earlier parts left in the work folder since PACK_SINCE (a date; default: all of
    # it) into OUT_DIR/pack.tgz, e.g. after a part was killed by its call's time limit before packing
    touch -d "${PACK_SINCE:-1970-01-01}" "$STAMP" ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
if [ "$PART" != pack ]; then  # `pack` started nothing, so it stops nothing (another run's daemon stays)
  # MPS's control endpoint is a UNIX socket on this driver (580), a named pipe on older ones: a search for pipes
  # alone found none, so every shared_mps daemon outlived its call (two were left running on one warm machine)
  for c in $(find /tmp $ROOT runs -name control \( -type p -o -type s \) 2>/dev/null); do
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$(dirname "$c") timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1
  done
  pgrep -a -f nvidia-cuda-mps-control || true; pgrep -a -f nvidia-cuda-mps-server || true
fi
# Only what this invocation wrote (newer than its stamp: an earlier part's files on a warm machine stay out),
# packed into one OUT_DIR/PART.tgz: the device tool brings back at most 8 files a call, and files past that are
# dropped (stop 30 lost two parts' JSON that way). Each log's last lines go to stdout as well.
PACK=$(mktemp -d)/$PART
mkdir -p "$PACK"
for f in $(find $ROOT -maxdepth 1 -name '*.json' -newer "$STAMP" 2>/dev/null); do cp "$f" "$PACK"/; done
for f in $(find $ROOT -path '*_runs/telemetry_gpu*.jsonl' -newer "$STAMP" 2>/dev/null); do
  gzip -c "$f" > "$PACK/$(basename $(dirname $f) _runs)_$(basename $f).gz"
done
for f in $(find $ROOT -maxdepth 1 -name '*.log' -newer "$STAMP" 2>/dev/null); do
  tail -c 3000 "$f" > "$PACK/$(basename $f).tail"
  echo "== $(basename $f)"; tail -n 4 "$f"
done
# the whole output of every run (the controller's and its workers' lines) and its metrics (losses, KL, clip
# fractions: what a learning result is diagnosed from), compressed
for f in $(find $ROOT \( -name output.log -o -name metrics.jsonl \) -newer "$STAMP" 2>/dev/null); do
  d=$(dirname "$f")
  gzip -c "$f" > "$PACK/$(echo "${d#$ROOT/}" | tr / _)_$(basename $f).gz"
done
tar czf "$OUT_DIR/$PART.tgz" -C "$(dirname "$PACK")" "$PART"
rm -rf "$(dirname "$PACK")"
tar tzf "$OUT_DIR/$PART.tgz"
ls -la "$OUT_DIR"
