#!/usr/bin/env bash
# Every GPU test and benchmark in one call on the GPU machine (one H200, jax 0.11.2).
#   bash bench/gpu_suite.sh [step ...]
# steps: env tests decode ops (default), startup (cold and warm start of the GPU example),
#        engine_gpu e2e_smoke e2e (the end-to-end decode
#        benchmark, about 8 minutes), e2e_compare (HiSparse and all-resident at 1 and 256
#        requests, for the code in .baseline/ when present and then for this tree, in one call:
#        a before/after comparison on the same machine), decode_fp8 / e2e_fp8 (the decode
#        check and bf16 against fp8_ds_mla KV rows at 1, 64, 256 requests), or one op benchmark:
#        resolve_residency gather_compact mirror_rows invalidate_written_rows sparse_mla_decode
#        stage_prefill_rows copies_beside_attention (`ops` runs them all); grouped_matmul (the MoE's
#        grouped matmul: its GPU tests, then bench/ops/grouped_matmul.py at DeepSeek-V3.2 decode
#        shapes; not part of `ops`); spec_gpu (the GPU-scale speculative exactness test),
#        decode_spec (the decode check with 2 MTP draft tokens per step), speculative (the
#        speculative decoding benchmark, k = 0, 1, 2 at acceptance 0.6 / 0.8 / 0.9), profile
#        (host phases and device profile of one step: HiSparse at 256 and 64, all-resident),
#        decode_chunked (the decode check with chunked prefill), e2e_repeat1 (three pairs at 1
#        request), e2e_indexer (the model's indexer at 64K), e2e_deep (8 layers), cmdbuf (XLA
#        command buffers: tokens and e2e at 256 with and without), async (asynchronous
#        scheduling: decode check, e2e with and without, profile at 256), multiturn (prefix
#        reuse with real chunked prefill: bench/multiturn.py), multiturn_scale (the same past
#        64K tokens, 8 conversations, against all-resident with seat reuse), profile_compare
#        (the async profile at 256 for .baseline/ and for this tree), e2e_repeat1_async (the
#        three pairs at 1 request with asynchronous scheduling), ncu (Nsight Compute profiles
#        of the attention, resolve and gather kernels: bench/ncu_kernels.py), attention_splits
#        (the attention kernel's device time at N = 1-8 against its K split count),
#        beside (EngineConfig.copy_with_attention: tests, the kernel benchmark, profiles at 256
#        with and without, e2e pairs with it), ab_async (alternating e2e pairs at 1 and 256 for
#        .baseline/ and this tree, async; this tree's profiles at 1 and 256; pairs at 1 request),
#        sweep_async (the e2e benchmark's full sweep and plot with asynchronous scheduling),
#        house_ab (decode checks and e2e pairs for .baseline/ and this tree, alternating),
#        real_slice / real_slice_drift / profile_real (DeepSeek-V3.2's real-dimension slice: e2e
#        pairs at 1, 64, 256 requests with its indexer / the drift top-k; the profile at 256),
#        rows_sweep (the row-copy Mosaic GPU attention kernel's candidates against the Triton
#        defaults: correctness, device time, TFLOP/s; JSON to $OUT), flashmla (FlashMLA's sm90
#        sparse fp8 decode built from .flashmla/ and timed at our attention shapes, then ours at
#        the same shapes: bench/flashmla_side_by_side.py), fp8_e2e (DeepSeek-V3.2's real-dimension
#        slice at 256 requests: fp8_ds_mla rows on triton and on mosaic_gpu against bf16 rows on
#        triton; JSON to $OUT)
# jax's persistent compilation cache is on for every step (JAX_COMPILATION_CACHE_DIR, default
# .jax_cache/ in the tree), so a step that compiles what an earlier one compiled does not.
# Each step has its own time limit and a failing step does not stop the others. The log goes
# to $OUT/suite.log and bench/results/ (also packed as $OUT/results.tar.gz) when OUT is set.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
export OUT=${OUT:-/tmp/hisparse-gpu-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests decode ops)
summary=()

run_step() {  # name, time limit in s, command...
  local name=$1 limit=$2
  shift 2
  echo "=== [$name] $(date +%T) $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  summary+=("$name: exit $rc in $((SECONDS - t0)) s")
  echo "=== [$name] exit $rc after $((SECONDS - t0)) s"
  tar czf "$OUT/results.tar.gz" bench/results      # after every step: a cut run keeps results
}

{
  for step in "${steps[@]}"; do
    case $step in
      env) run_step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices(), [m.kind for m in jax.devices()[0].addressable_memories()])"' ;;
      # The GPU-scale engine test (2-4 min) is left to `decode`, which checks the same
      # exactness (--check: tokens against all-resident) on the same config.
      tests) run_step tests 480 python3 -m pytest -m gpu -q -rfE --timeout=300 -p no:cacheprovider -k "not gpu_scale" tests ;;
      # 8 prompts of up to 3500 tokens on 400 device blocks of 64 rows (all-resident: 8 x 56):
      # requests move to hot regions, pages are lost and read from host; tokens are checked.
      decode) run_step decode 150 python3 examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 4096 --check ;;
      # The same check with chunked prefill (1,024-token chunks sharing steps with decode)
      # against an all-resident reference that prefills in the same chunks (against one-shot
      # prefill the tokens differ on the GPU: bf16 GEMMs of other shapes round differently).
      decode_chunked) run_step decode_chunked 200 python3 examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 1024 --prefill-chunk-size 1024 --check --check-chunked ;;
      decode_fp8) run_step decode_fp8 150 python3 examples/decode.py --config dsv32-2l --kv-format fp8_ds_mla --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 4096 --check ;;
      attention_splits) run_step attention_splits 580 python3 -m bench.attention_splits --ns 1,2,4,8 ;;
      e2e_fp8) run_step e2e_fp8 "${E2E_FP8_LIMIT:-580}" python3 -m bench.e2e_decode --kv-format bf16,fp8_ds_mla --modes hisparse,all-resident --concurrency 1,64,256 --turnover-sweep= --time-budget "${E2E_FP8_BUDGET:-480}" --no-plot ;;
      # DeepSeek-V3.2's real-dimension slice (4 layers) at 256 requests, drift top-k,
      # asynchronous scheduling, in one process: fp8_ds_mla rows on the Triton and on the Mosaic
      # GPU row-copy attention against bf16 rows on Triton (32K contexts: bf16 rows of 64K for
      # 257 requests need a pinned pool past the host allocator's). JSON to $OUT.
      fp8_e2e) XLA_PYTHON_CLIENT_MEM_FRACTION=${REAL_MEM_FRACTION:-0.92} run_step fp8_e2e "${FP8_E2E_LIMIT:-580}" python3 -m bench.e2e_decode --config dsv32-real --num-layers 4 --async-scheduling --context "${FP8_E2E_CONTEXT:-32768}" --kv-format bf16,fp8_ds_mla --attention-backend "${FP8_E2E_BACKENDS:-triton,fp8_ds_mla:mosaic_gpu}" --concurrency 256 --modes hisparse --turnover-sweep= --warmup-steps 4 --measure-steps 16 --rounds 2 --time-budget "${FP8_E2E_BUDGET:-480}" --output "${FP8_E2E_JSON:-$OUT/e2e_decode-dsv32-real-fp8-backends-gpu.json}" --no-plot ;;
      e2e_smoke) run_step e2e_smoke 150 python3 -m bench.e2e_decode --context 8192 --gen-budget 512 --concurrency 1,8 --turnover-sweep "" --warmup-steps 4 --measure-steps 8 --output bench/results/e2e_decode-smoke-gpu.json --no-plot ;;
      # The e2e benchmark's sweep: every concurrency, then the turnover sweep (at E2E_SWEEP_AT).
      # sweep_async: with asynchronous scheduling, the turnover sweep at 256 (README table and
      # plot; bench/results/e2e_decode-async-$SWEEP_TAG-gpu.json).
      e2e|sweep_async)
        sweep=(--turnover-sweep-at "${E2E_SWEEP_AT:-128}")
        [ "$step" = sweep_async ] && sweep=(--async-scheduling --turnover-sweep-at "${E2E_SWEEP_AT:-256}" --output "bench/results/e2e_decode-async-${SWEEP_TAG:-sweep}-gpu.json")
        run_step "$step" "${E2E_LIMIT:-470}" python3 -m bench.e2e_decode --time-budget "${E2E_BUDGET:-380}" "${sweep[@]}" ;;
      e2e_compare)
        cmp_args=(--concurrency 1,256 --modes hisparse,all-resident --turnover-sweep= --no-plot)
        if [ -d .baseline ]; then
          run_step e2e_before 280 bash -c "cd .baseline && PYTHONPATH=. python3 -m bench.e2e_decode ${cmp_args[*]} --output $OUT/e2e_before.json"
        fi
        run_step e2e_after 280 python3 -m bench.e2e_decode "${cmp_args[@]}" --output "${E2E_COMPARE_OUT:-bench/results/e2e_decode-compare-gpu.json}" ;;
      # The async profile at 256 requests for the code in .baseline/ (when present), then for
      # this tree: host phases before and after on the same machine, in one call.
      profile_compare)
        pargs=(--mode hisparse --concurrency 256 --async-scheduling)
        if [ -d .baseline ]; then
          run_step profile_before 220 bash -c "cd .baseline && PYTHONPATH=. python3 -m bench.profile_step ${pargs[*]} --output $OUT/profile_before.json"
        fi
        run_step profile_after 220 python3 -m bench.profile_step "${pargs[@]}" --output "${PROFILE_COMPARE_OUT:-bench/results/profile_step-gpu-hisparse-256-async-after.json}" ;;
      # Copies from host in the launch of another index group's attention
      # (EngineConfig.copy_with_attention): its tests compiled, the kernel benchmark, the async
      # profile at 256 with and without it (BESIDE_PROFILES: beside, main; beside-pP: P copy
      # programs), then E2E_BESIDE HiSparse / all-resident pairs at 1 and 256 with it (the
      # default; main: --no-copy-with-attention).
      beside)
        tag=${BESIDE_TAG:-beside}
        HISPARSE_EXAMPLES=${HISPARSE_EXAMPLES:-10} run_step beside_tests 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_sparse_mla_decode_with_copies.py tests/test_cache.py tests/test_engine.py -k "with_copies or beside or gpu_at_the_engines"
        run_step beside_kernel 150 python3 -m bench.ops.copies_beside_attention
        for run in ${BESIDE_PROFILES:-beside main}; do
          progs=${run#beside}; progs=${progs#-p}
          flag=(--no-copy-with-attention)
          [ "${run%%-*}" = beside ] && flag=(--copy-with-attention ${progs:+--copy-programs $progs})
          run_step "profile_$run" 200 python3 -m bench.profile_step --mode hisparse --concurrency 256 --async-scheduling ${flag[@]+"${flag[@]}"} --output "bench/results/profile_step-gpu-hisparse-256-async-$tag-$run.json"
        done
        for i in $(seq 1 "${E2E_BESIDE:-1}"); do
          run_step "e2e_beside_$i" 240 python3 -m bench.e2e_decode --async-scheduling --copy-with-attention --concurrency 1,256 --modes hisparse,all-resident --turnover-sweep= --no-plot --output "bench/results/e2e_decode-async-$tag-$i-gpu.json"
        done ;;
      # Before / after on one warm machine, asynchronous scheduling: AB_PAIRS rounds of a
      # HiSparse / all-resident e2e pair at 1 and 256 requests, for the code in .baseline/ (when
      # present) then for this tree, alternating; then this tree's step profiles at 1 request
      # (both modes) and at 256 (HiSparse), and AB_REPEAT1 more pairs at 1 request.
      ab_async)
        tag=${AB_TAG:-ab}
        ab_args=(--async-scheduling --concurrency 1,256 --modes hisparse,all-resident --turnover-sweep= --no-plot)
        for i in $(seq 1 "${AB_PAIRS:-2}"); do
          if [ -d .baseline ]; then
            run_step "e2e_before_$i" 240 bash -c "cd .baseline && PYTHONPATH=. python3 -m bench.e2e_decode ${ab_args[*]} --output $PWD/bench/results/e2e_decode-async-$tag-before-$i-gpu.json"
          fi
          run_step "e2e_after_$i" 240 python3 -m bench.e2e_decode "${ab_args[@]}" --output "bench/results/e2e_decode-async-$tag-after-$i-gpu.json"
        done
        for run in hisparse-1 all-resident-1 hisparse-256; do
          run_step "profile_$run" 200 python3 -m bench.profile_step --mode "${run%-*}" --concurrency "${run##*-}" --async-scheduling --output "bench/results/profile_step-gpu-$run-async-$tag.json"
        done
        for i in $(seq 1 "${AB_REPEAT1:-3}"); do
          run_step "e2e_repeat1_$i" 150 python3 -m bench.e2e_decode --async-scheduling --concurrency 1 --modes hisparse,all-resident --turnover-sweep= --no-plot --output "bench/results/e2e_decode-repeat1-async-$tag-$i-gpu.json"
        done ;;
      # A restructuring's check, in one call: the decode example's --check (bf16 and fp8 rows)
      # for the code in .baseline/ (when present) and for this tree, their tokens compared
      # across the trees (HOUSE_FORMATS, "" for none), then HOUSE_PAIRS rounds of a HiSparse /
      # all-resident e2e pair at 1 and 256 requests (asynchronous scheduling), before and after
      # alternating.
      house_ab)
        dec=(examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 4096 --check)
        for fmt in ${HOUSE_FORMATS-bf16 fp8_ds_mla}; do
          if [ -d .baseline ]; then
            run_step "decode_${fmt}_before" 150 bash -c "cd .baseline && PYTHONPATH=. python3 ${dec[*]} --kv-format $fmt --json $OUT/decode-$fmt-before.json"
          fi
          run_step "decode_${fmt}_after" 150 python3 "${dec[@]}" --kv-format "$fmt" --json "$OUT/decode-$fmt-after.json"
          if [ -d .baseline ]; then
            run_step "decode_${fmt}_same_tokens" 30 python3 -c "import json,sys; a,b=(json.load(open(sys.argv[i]))['tokens'] for i in (1,2)); print('before/after: tokens identical' if a==b else 'before/after: TOKENS DIFFER'); sys.exit(a!=b)" "$OUT/decode-$fmt-before.json" "$OUT/decode-$fmt-after.json"
          fi
        done
        tag=${HOUSE_TAG:-house}
        ab_args=(--async-scheduling --concurrency 1,256 --modes hisparse,all-resident --turnover-sweep= --no-plot)
        for i in $(seq 1 "${HOUSE_PAIRS:-2}"); do
          if [ -d .baseline ]; then
            run_step "e2e_before_$i" 240 bash -c "cd .baseline && PYTHONPATH=. python3 -m bench.e2e_decode ${ab_args[*]} --output $PWD/bench/results/e2e_decode-async-$tag-before-$i-gpu.json"
          fi
          run_step "e2e_after_$i" 240 python3 -m bench.e2e_decode "${ab_args[@]}" --output "bench/results/e2e_decode-async-$tag-after-$i-gpu.json"
        done ;;
      # Cold and warm starts of the GPU example (fresh processes, a fresh compilation cache).
      startup) run_step startup 400 python3 -m bench.startup --warm-starts 2 ;;
      # Host phases and a device profile of one step (bench/profile_step.py), e2e budget.
      profile)
        run_step profile_hisparse_256 240 python3 -m bench.profile_step --mode hisparse --concurrency 256
        run_step profile_all_resident_256 150 python3 -m bench.profile_step --mode all-resident --concurrency 256
        run_step profile_hisparse_64 150 python3 -m bench.profile_step --mode hisparse --concurrency 64 --budget-concurrency 256 ;;
      # Three separate HiSparse / all-resident pairs at 1 request (the >= 1.0x target holds
      # in each run or not: min and median over the three).
      e2e_repeat1|e2e_repeat1_async)
        sched=() tag=""
        [ "$step" = e2e_repeat1_async ] && sched=(--async-scheduling) tag="async-"
        for i in 1 2 3; do
          run_step "${step}_$i" 150 python3 -m bench.e2e_decode ${sched[@]+"${sched[@]}"} --concurrency 1 --modes hisparse,all-resident --turnover-sweep= --no-plot --output "bench/results/e2e_decode-repeat1-$tag${REPEAT1_TAG:+$REPEAT1_TAG-}$i-gpu.json"
        done ;;
      # The model's own indexer selecting over 64K synthetic index keys (not the drift model).
      # REALISM_ASYNC=1: this and e2e_deep with asynchronous scheduling (-async in the name).
      e2e_indexer) run_step e2e_indexer "${E2E_INDEXER_LIMIT:-300}" python3 -m bench.e2e_decode ${REALISM_ASYNC:+--async-scheduling} --indexer --concurrency 1,256 --modes hisparse,all-resident --no-plot --output "bench/results/e2e_decode-indexer${REALISM_ASYNC:+-async}-gpu.json" ;;
      # A deeper model: 8 layers at 1 request and at 96 (the most whose 64K contexts the
      # 128 GiB host holds pinned at 8 layers: ~60 GiB).
      e2e_deep) run_step e2e_deep "${E2E_DEEP_LIMIT:-330}" python3 -m bench.e2e_decode ${REALISM_ASYNC:+--async-scheduling} --num-layers 8 --concurrency 1,96 --modes hisparse,all-resident --turnover-sweep= --no-plot --output "bench/results/e2e_decode-8layers${REALISM_ASYNC:+-async}-gpu.json" ;;
      # XLA command buffers (CUDA graphs) for every thunk kind: the decode check's tokens with
      # and without them (must be identical), then HiSparse / all-resident at 256 both ways.
      cmdbuf)
        cb="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
        dec=(examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 4096 --check)
        run_step cmdbuf_decode_off 150 python3 "${dec[@]}" --json "$OUT/cmdbuf_off.json"
        XLA_FLAGS="$cb" run_step cmdbuf_decode_on 150 python3 "${dec[@]}" --json "$OUT/cmdbuf_on.json"
        run_step cmdbuf_tokens 30 python3 -c "import json,sys; a,b=(json.load(open(sys.argv[i]))['tokens'] for i in (1,2)); print('command buffers: tokens identical' if a==b else 'command buffers: TOKENS DIFFER'); sys.exit(a!=b)" "$OUT/cmdbuf_off.json" "$OUT/cmdbuf_on.json"
        e2e_args=(--concurrency 256 --modes hisparse,all-resident --turnover-sweep= --no-plot)
        run_step cmdbuf_e2e_off 200 python3 -m bench.e2e_decode "${e2e_args[@]}" --output bench/results/e2e_decode-cmdbuf-off-gpu.json
        XLA_FLAGS="$cb" run_step cmdbuf_e2e_on 200 python3 -m bench.e2e_decode "${e2e_args[@]}" --output bench/results/e2e_decode-cmdbuf-on-gpu.json ;;
      # Asynchronous scheduling: the decode check with it, the e2e benchmark with it (every
      # concurrency, HiSparse and all-resident) and without (1, 64, 256), a profile at 256.
      async)
        run_step decode_async 150 python3 examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --hot-size 2048 --gpu-blocks 400 --prefill-bucket 4096 --async-scheduling --check
        run_step e2e_async 260 python3 -m bench.e2e_decode --async-scheduling --concurrency 1,4,16,64,128,256 --modes hisparse,all-resident --turnover-sweep= --no-plot --output bench/results/e2e_decode-async-gpu.json
        run_step e2e_sync 200 python3 -m bench.e2e_decode --concurrency 1,64,256 --modes hisparse,all-resident --turnover-sweep= --no-plot --output bench/results/e2e_decode-sync-gpu.json
        run_step profile_async_256 150 python3 -m bench.profile_step --mode hisparse --concurrency 256 --async-scheduling --output bench/results/profile_step-gpu-hisparse-256-async.json ;;
      # Multi-turn serving, real chunked prefill: prefix reuse against none and all-resident
      # (4 conversations, 8K-token first prompts, 7 turns of 1,024 new and 32 generated tokens).
      multiturn) run_step multiturn "${MULTITURN_LIMIT:-300}" python3 -m bench.multiturn --conversations 4 --first-prompt 8192 --turns 7 --user-tokens 1024 --gen-tokens 32 --prefill-chunk-size 2048 --ttft-from-turn 5 --prefix-hit-pages stage --modes hisparse-reuse,hisparse,all-resident-reuse,all-resident ;;
      # Contexts past 64K (61,440-token first prompts, 3 turns of 2,048 + 64) for 8
      # conversations on a GPU KV budget of 2,641 blocks: 1.1 x (8 hot regions + tails, two
      # prompts in flight), which holds 2 full conversations all-resident.
      multiturn_scale) run_step multiturn_scale "${MULTITURN_SCALE_LIMIT:-560}" python3 -m bench.multiturn --conversations 8 --first-prompt 61440 --turns 3 --user-tokens 2048 --gen-tokens 64 --prefill-chunk-size 2048 --gpu-blocks 2641 --ttft-from-turn 1 --prefix-hit-pages stage --modes hisparse-reuse,all-resident-reuse --output bench/results/multiturn-64k-gpu.json ;;
      spec_gpu) run_step spec_gpu 300 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -k gpu_scale tests/test_engine_speculative.py ;;
      decode_spec) run_step decode_spec 200 python3 examples/decode.py --config dsv32-2l --requests 8 --seats 8 --prompt-len 3500 --gen-len 32 --max-model-len 4096 --block-size 64 --gpu-blocks 500 --prefill-bucket 4096 --speculative-tokens 2 --check ;;
      speculative) run_step speculative "${SPEC_LIMIT:-590}" python3 -m bench.speculative --time-budget "${SPEC_BUDGET:-500}" ;;
      engine_gpu) run_step engine_gpu 420 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -k gpu_scale tests/test_engine.py ;;
      # Nsight Compute profiles of single kernel launches (bench/ncu_kernels.py): attention at
      # N=64 with h_q 128 and 16, at N=256 h_q 128 and N=1, resolve at N=64 and 256 (the search
      # rule and the position map rule), the host
      # gather at the rows of a 256-request e2e step (NCU_CASES picks; gather-step, gather-16g,
      # gather-step-16g are extra; NCU_RESOLVE_VARIANTS: resolve sweep candidates at N=256).
      # Reports: bench/results/ncu-*-gpu.txt.
      ncu) run_step ncu "${NCU_LIMIT:-420}" bash -c '
        sections=${NCU_SECTIONS:-"--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"}
        one() {  # name, kernel regex, args...
          local name=$1 regex=$2; shift 2
          echo "--- ncu $name"
          ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 $sections -f -o "/tmp/ncu-$name" python3 -m bench.ncu_kernels "$@" > "/tmp/ncu-$name.log" 2>&1
          echo "ncu exit $?"; tail -3 "/tmp/ncu-$name.log"
          ncu --import "/tmp/ncu-$name.ncu-rep" --page details --print-details all > "bench/results/ncu-$name-gpu.txt" 2>&1
        }
        for case in ${NCU_CASES:-attn-n64-h128 attn-n64-h16 attn-n256-h128 resolve-n64 resolve-n256 resolve-map-n64 resolve-map-n256 gather}; do
          case $case in
            attn-n64-h128) one $case sparse_mla_decode attention --n 64 --h 128 ;;
            attn-n64-h16) one $case sparse_mla_decode attention --n 64 --h 16 ;;
            attn-n256-h128) one $case sparse_mla_decode attention --n 256 --h 128 ;;
            attn-n1-h128) one $case sparse_mla_decode attention --n 1 --h 128 ;;
            attn-n64-h128-fp8) one $case sparse_mla_decode attention --n 64 --h 128 --kv-format fp8_ds_mla ;;
            # The Mosaic GPU row-copy kernel over fp8 rows (NCU_ROW_TUNING: a variant of
            # bench.ops.sparse_mla_decode.mosaic_row_variants, default `row`, its default).
            attn-n64-h128-fp8-row|attn-n256-h128-fp8-row|attn-n64-h16-fp8-row)
              n=${case#attn-n}; n=${n%%-*}; h=${case#attn-n*-h}; h=${h%%-*}
              one $case sparse_mla_decode attention --n "$n" --h "$h" --kv-format fp8_ds_mla --backend mosaic_gpu --tuning "${NCU_ROW_TUNING:-row}" ;;
            # The same kernel over bf16 rows.
            attn-n64-h128-bf16-row) one $case sparse_mla_decode attention --n 64 --h 128 --backend mosaic_gpu --tuning "${NCU_ROW_TUNING:-row}" ;;
            resolve-n64) one $case resolve resolve --n 64 ;;
            resolve-n256) one $case resolve resolve --n 256 ;;
            resolve-map-n64) one $case resolve resolve --n 64 --rule map ;;
            resolve-map-n256) one $case resolve resolve --n 256 --rule map ;;
            gather) one gather-27648 hisparse_gather gather --rows 27648 ;;
            # The same rows as the plan of an engine step (256 x 2048 entries, 108 misses each),
            # and both from a 16 GiB pool (the pool of an e2e run at 256 requests is ~19 GB).
            gather-step) one gather-27648-step hisparse_gather gather --rows 27648 --plan step ;;
            gather-16g) one gather-27648-16g hisparse_gather gather --rows 27648 --pool-gib 16 ;;
            gather-step-16g) one gather-27648-step-16g hisparse_gather gather --rows 27648 --plan step --pool-gib 16 ;;
          esac
        done
        for v in ${NCU_ATTN_VARIANTS:-}; do one "attn-n64-h128-$v" sparse_mla_decode attention --n 64 --h 128 --tuning "$v"; done
        # Resolve sweep candidates at N=256 (registers per thread and CTAs per SM).
        for v in ${NCU_RESOLVE_VARIANTS:-}; do one "resolve-n256-$v" resolve resolve --n 256 --tuning "$v"; done
        # N=1 with other K split counts (the default gives each split >= 4 steps of block_k).
        for sp in ${NCU_N1_SPLITS:-}; do one "attn-n1-h128-splits$sp" sparse_mla_decode attention --n 1 --h 128 --splits "$sp"; done
      ' ;;
      # The row-copy Mosaic GPU attention kernel (fp8_ds_mla and bf16 rows) against the Triton
      # defaults in one call: every candidate checked against the jnp reference, device time
      # and TFLOP/s at N x h_q = 64x128, 256x128, 64x16 (bench/ncu_kernels.py sweep). JSON to
      # $OUT (bench/results/ is full), printed lines in the log.
      rows_sweep) run_step rows_sweep "${ROWS_SWEEP_LIMIT:-560}" python3 -m bench.ncu_kernels sweep --json "${ROWS_SWEEP_JSON:-$OUT/attention_rows_sweep.json}" --shapes "${ROWS_SWEEP_SHAPES:-64x128,256x128,64x16}" --budget-s "${ROWS_SWEEP_BUDGET:-420}" --candidates "${ROWS_SWEEP_CANDIDATES:-}" ;;
      # FlashMLA's sm90 sparse fp8 decode (V3.2 rows, the fp8_ds_mla layout) built with nvcc from
      # .flashmla/ (carried: bench/flashmla_side_by_side.py --make-bundle writes it), checked
      # against a float32 reference, timed at N x h_q = FLASHMLA_SHAPES, K = 2048 (CUDA events and
      # profiler device time); then, in the same call, our attention at the same shapes for the
      # FLASHMLA_OURS candidates ("" for none). A failed build is recorded in the JSON.
      flashmla)
        run_step flashmla "${FLASHMLA_LIMIT:-590}" python3 -m bench.flashmla_side_by_side --json "$OUT/flashmla_side_by_side-gpu.json" --shapes "${FLASHMLA_SHAPES:-64x128,256x128,64x16}" --ours "${FLASHMLA_OURS-triton,row}" --budget-s "${FLASHMLA_BUDGET:-560}"
        cp "$OUT/flashmla_side_by_side-gpu.json" bench/results/ 2>/dev/null ;;
      # The op benchmarks (bench/ops/<op>.py), each in its own process within the budget.
      ops) run_step ops "${OPS_LIMIT:-500}" python3 -m bench.ops --budget "${OPS_BUDGET:-480}" ;;
      # The MoE's grouped matmul: its GPU tests (G = 256, skewed and empty groups, one 15 GB
      # DeepSeek-V3.2 weight stack), then every backend, the Triton variants and XLA's
      # ragged-dot fusion flag (a subprocess: hence no preallocation) at the decode shapes.
      grouped_matmul)
        run_step grouped_matmul_tests "${GMM_TEST_LIMIT:-300}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/ops/test_grouped_matmul.py
        XLA_PYTHON_CLIENT_PREALLOCATE=false HISPARSE_BENCH_LIMIT_S="${GMM_LIMIT:-540}" run_step grouped_matmul "${GMM_LIMIT:-540}" python3 -m bench.ops.grouped_matmul ;;
      resolve_residency|gather_compact|mirror_rows|invalidate_written_rows|sparse_mla_decode|stage_prefill_rows|copies_beside_attention)
        run_step "$step" 250 python3 -m bench.ops."$step" ;;
      # DeepSeek-V3.2 at its real dimensions, first REAL_LAYERS layers (3 dense + 1 MoE by default),
      # random bf16 weights, its own indexer and MoE, 64K-token contexts (synthetic prefill):
      # HiSparse / all-resident at 1, 64, 256 requests, asynchronous scheduling; then the step
      # profile at 256 (profile_real).
      real_slice) XLA_PYTHON_CLIENT_MEM_FRACTION=${REAL_MEM_FRACTION:-0.92} run_step real_slice "${REAL_LIMIT:-560}" python3 -m bench.e2e_decode --config dsv32-real --num-layers "${REAL_LAYERS:-4}" --indexer --async-scheduling --kv-format "${REAL_FORMAT:-fp8_ds_mla}" --context "${REAL_CONTEXT:-65536}" --concurrency "${REAL_CONCURRENCY:-1,64,256}" --modes hisparse,all-resident --warmup-steps 4 --measure-steps 16 --rounds 2 --time-budget "${REAL_BUDGET:-480}" --output "bench/results/e2e_decode-dsv32-real-gpu.json" --no-plot ;;
      # The same slice with the drift top-k at 5% turnover (no indexer).
      real_slice_drift) XLA_PYTHON_CLIENT_MEM_FRACTION=${REAL_MEM_FRACTION:-0.92} run_step real_slice_drift "${REAL_LIMIT:-560}" python3 -m bench.e2e_decode --config dsv32-real --num-layers "${REAL_LAYERS:-4}" --async-scheduling --kv-format "${REAL_FORMAT:-fp8_ds_mla}" --context "${REAL_CONTEXT:-65536}" --concurrency "${REAL_CONCURRENCY:-1,64,256}" --modes hisparse,all-resident --turnover-sweep= --warmup-steps 4 --measure-steps 16 --rounds 2 --time-budget "${REAL_BUDGET:-480}" --output "bench/results/e2e_decode-dsv32-real-drift-gpu.json" --no-plot ;;
      profile_real) XLA_PYTHON_CLIENT_MEM_FRACTION=${REAL_MEM_FRACTION:-0.92} run_step profile_real "${PROFILE_REAL_LIMIT:-400}" python3 -m bench.profile_step --config dsv32-real --num-layers "${REAL_LAYERS:-4}" --indexer --async-scheduling --kv-format "${REAL_FORMAT:-fp8_ds_mla}" --context "${REAL_CONTEXT:-65536}" --concurrency 256 --steps 16 --profile-steps 4 --output "bench/results/profile_step-dsv32-real-c256-gpu.json" ;;
      *) echo "unknown step $step" ;;
    esac
  done
  echo "=== summary"
  printf '%s\n' "${summary[@]}"
} 2>&1 | tee "$OUT/suite.log"
tar czf "$OUT/results.tar.gz" bench/results
