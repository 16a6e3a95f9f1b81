#!/usr/bin/env bash
# GPU proofs and measurements, one section per argument. Each step is bounded by `timeout`
# and by DEADLINE (seconds since the script started, default 585: the device's 10-minute commands), so a command
# ends with its archive written; a step that no longer fits is skipped and says so. Most sections fill a command.
# The logs and JSON reports go to $LOGS (/tmp/gpu_proofs_logs) and, after every step, into one archive
# $OUT/proofs.tgz (the device returns at most 8 files from $OUT).
#   bash bench/gpu_proofs.sh tests      # every @pytest.mark.gpu test (two files need `datasets`: skipped); on an
#                                       # H100 it no longer fits one command: testsa (engine, bench, distributed),
#                                       # then testsb (the rest), one command each
#   bash bench/gpu_proofs.sh newtests   # the GPU tests of the 2026-12-01 kernels: decode attention (q/k norm fused), FP8
#                                       # paths forced by engine.fp8_gemm, the fused LayerNorm
#   bash bench/gpu_proofs.sh logprobs   # job path, plain (A) vs sampling.logprobs=5 (B), ABBA (~6 min)
#   bash bench/gpu_proofs.sh moe        # qwen3-30b-a3b seed workload (1,024 new; ~1 min)
#   bash bench/gpu_proofs.sh moejob     # qwen3-30b-a3b job at 256 seqs (61 GB saved and loaded: ~7 min)
#   bash bench/gpu_proofs.sh fp8moe     # FP8 MoE GPU tests, then qwen3-30b-a3b W1 in FP8 (never run; ~5 min?)
#   bash bench/gpu_proofs.sh fp8moejob  # qwen3-30b-a3b job at 256 seqs in FP8 (never run; ~6 min?)
#   bash bench/gpu_proofs.sh longrun    # a 20,000-row job's window rates (middle vs last tenths; ~8 min)
#   bash bench/gpu_proofs.sh sweep      # decode attention launches (starcoder2-7b, qwen2-7b, starcoder2-3b, gemma2-9b,
#                                       # phi3-mini, olmo2-7b at 32:768 and
#                                       # 256:512 (12 compile workers; at most 5.5 min), the winners merged into
#                                       # batchgen/kernels/attention/decode_launches.json, which is copied to $OUT
#   bash bench/gpu_proofs.sh families   # W1 of every dense geometry but llama-8b, the launch table as committed
#                                       # (~35 s each, ~7 min)
#   bash bench/gpu_proofs.sh blas       # W1 of phi3-mini, qwen2-7b, starcoder2-3b: cuBLASLt and cuBLAS in the
#                                       # decode graphs, same run (~4 min)
#   bash bench/gpu_proofs.sh profiles   # decode-step kernel tables of gemma2-9b and phi3-mini (~2 min)
#   bash bench/gpu_proofs.sh fp8        # block-wise tests and probe, FP8 W1 (default vs block-wise), FP8 and bf16
#                                       # jobs at 256 (~8 min)
#   bash bench/gpu_proofs.sh fp8profile # an FP8 W1 decode step's kernels, block-wise and split-K (~3 min)
#   bash bench/gpu_proofs.sh fp8big     # W1 of Llama-3.1-70B geometry in FP8 on one GPU (~4 min)
#   bash bench/gpu_proofs.sh fp8bigjob  # the job workload (256 seqs, 500 rows) on Llama-3.1-70B geometry in FP8
#                                       # on one GPU, its checkpoint in a grown /dev/shm (not yet run; ~8 min?)
#   bash bench/gpu_proofs.sh tp         # two GPUs: TP GPU tests and the 70B bf16 seed workload at TP=2
#   bash bench/gpu_proofs.sh rayx2      # two GPUs: --gpus 1 and 2, then --ray --workers 2, the same 8,000 rows (needs
#                                       # Ray: bench/device_assets.sh --ray; ~8 min)
#   bash bench/gpu_proofs.sh fp8gemm    # the split-K FP8 GEMM (default at <= 32 rows) vs cuBLAS / Triton at M 16-64, sweep
#   bash bench/gpu_proofs.sh fp8splitk  # split-K FP8 GEMM GPU tests (M up to 256), then bench/fp8_gemm.py
#                                       # at M 256, 512 and the split-K sweep at 64-512 (row tiles 64 / 128): its
#                                       # gemm_launches.json split-K entries say which shapes take split-K at the FP8 job's
#                                       # sizes (~8 min?; SPLITK_SWEEP_ROWS narrows it)
#   bash bench/gpu_proofs.sh fp8kv      # engine.kv_cache_dtype: fp8: its GPU tests, then the job at 256 seqs, default (A)
#                                       # vs an fp8 K/V cache (B), A B B A (~7 min)
#   bash bench/gpu_proofs.sh refill     # job at 256 seqs, penalty 1.0 and 1.1, the checkout in .prev (A) vs this
#                                       # one (B), A B B A, with each run's decode / mixed / idle shares (~8 min)
#   bash bench/gpu_proofs.sh prefill    # a prefill step's kernels against its FLOP floor (8192 tokens of 68- and
#                                       # 2,048-token prompts, the mixed load's mixed step: 1,450 prompt tokens beside 250
#                                       # decode rows), then the mixed 2,000-request load with its step kinds (~5 min)
#   bash bench/gpu_proofs.sh mixedab    # the mixed load (MIXED_REQUESTS, default 1,000) from the checkout in
#                                       # .prev and from this one, in MIXED_ORDER (default .prev . . .prev; ~7 min):
#                                       # it was measured 7 % slower on 2026-12-02 than on 2026-12-01 (.prev: git archive 241f28b)
#   bash bench/gpu_proofs.sh mixedprof  # the mixed load's kernels and idle (bench/mixed_kernels.py, MIXED_PROF
#                                       # requests, default 400) from .prev and this checkout, then compared (~4 min);
#                                       # MIXED_PROF_WARMUP=load: warmed up on the load (idle without builds)
#   bash bench/gpu_proofs.sh fp8job     # the job at 256 and 512 seqs, bf16 then FP8 (block-scaled), each run's
#                                       # step kinds and idle gaps (~7 min each: one command each, FP8_WEIGHTS=bf16 | fp8)
#   bash bench/gpu_proofs.sh detcheck   # GPU tests, fixed-row GEMM bench, a deterministic step's kernels
#   bash bench/gpu_proofs.sh detcost    # job at 256 seqs, default (A) vs deterministic (B), A B B A
#   bash bench/gpu_proofs.sh det        # bench/deterministic_gpu.sh identity checks (16 vs 256, kill/resume)
#   bash bench/gpu_proofs.sh autotests  # engine.max_num_seqs auto: the GPU tests of decode graphs (to 1,024 rows), W1
#   bash bench/gpu_proofs.sh autojob    # the job at default settings (auto) against 256 and 512 sequences, 4,000 rows,
#                                       # in the order auto 256 512 auto (~9.5 min)
#   bash bench/gpu_proofs.sh autoone    # both in one command: the job at auto, 256, 512 (3,000 rows), W1, the graph tests
#   bash bench/gpu_proofs.sh idle       # the job at 512 and auto sequences (1,500 rows), each run's host ms between
#                                       # dispatches by phase, over every step and before the device's gaps (~5 min)
#   bash bench/gpu_proofs.sh bigbatch   # a 1,024-sequence decode step: llama-8b decode attention swept over scattered
#                                       # and contiguous K/V blocks (1,024 x 32-320 and x 192), then the graphed step's
#                                       # kernels and each GEMM against the matmul rate at 1,024 and 512 rows (~5 min)
#   bash bench/gpu_proofs.sh bigbatchab # the job at default settings (2,000 rows), the checkout in .prev (A: `git
#                                       # archive <commit> batchgen` unpacked there) vs this
#                                       # one (B), A B B A, then the same at 512 sequences (1,500 rows; ~9 min)
# Needs the wheels of pyproject's dependencies that the GPU image lacks on PYTHONPATH and a tokenizer folder in $TOK
# (default .bench-assets/tokenizer: SmolLM2's): `bash bench/device_assets.sh` prepares both here, and
# .bench-env/setup.sh, to source first in every GPU command.
set -u
OUT=${OUT:-/tmp/gpu_proofs}; mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/gpu_proofs_logs}; mkdir -p "$LOGS"
DEADLINE=${DEADLINE:-585}
TOK=${TOK:-.bench-assets/tokenizer}
# the geometries (and variants) of the families, blas and sweep sections, narrowed by setting these
FAMILIES=${FAMILIES:-gemma2-9b phi3-mini gemma-7b olmo2-7b gemma3-12b granite-8b qwen2-7b starcoder2-7b starcoder2-3b mistral-7b qwen3-8b}
BLAS_GEOMS=${BLAS_GEOMS:-phi3-mini qwen2-7b starcoder2-3b}
SWEEP_GEOMS=${SWEEP_GEOMS:-starcoder2-7b,qwen2-7b,starcoder2-3b,gemma2-9b,phi3-mini,olmo2-7b}
BLAS_VARIANTS=${BLAS_VARIANTS:-graphs_async,graphs_async_cublas}
BG=(python3 -m batchgen.cli bench)
JOB=("${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work --profile-steps 0 --seqs 256
     --penalties 1.0)
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS left=$((DEADLINE - SECONDS - 5))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then echo "== $name skipped: ${left}s left before the deadline"; return; fi
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s (limit ${limit}s)"
  tail -4 "$LOGS/$name.log"; tar czf "$OUT/proofs.tgz" -C "$LOGS" . ; }
sections=("$@")
for section in "${sections[@]}"; do
  case $section in
    autotests) step graph_tests 300 python3 -m pytest -q -m gpu tests/runner/test_decode_graph_buckets.py \
                 tests/engine/test_engine_gpu.py tests/engine/test_engine_lifetime.py -rfE -p no:cacheprovider
               step w1 150 "${BG[@]}" --new-tokens 1024 --variants graphs_async --json "$LOGS/w1.json" ;;
    autoone) step job_auto 390 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
               --profile-steps 0 --seqs auto,256,512 --penalties 1.0 --rows 3000 --json "$LOGS/job_auto.json"
             step w1 100 "${BG[@]}" --new-tokens 1024 --variants graphs_async --json "$LOGS/w1.json"
             step graph_tests 200 python3 -m pytest -q -m gpu tests/runner/test_decode_graph_buckets.py \
               tests/engine/test_engine_gpu.py tests/engine/test_engine_lifetime.py -rfE -p no:cacheprovider ;;
    rayx2) step ray_x2 580 env RAY_USAGE_STATS_ENABLED=0 python3 bench/multi_gpu.py --rows "${RAYX2_ROWS:-8000}" \
             --launcher gpus --versus ray --no-kill ;;
    bigbatch) for blocks in scattered contiguous; do
                step "sweep_$blocks" 120 python3 bench/decode_attention_sweep.py --geometries llama-8b \
                  --shapes 1024:32-320,1024:192 --blocks "$blocks" --compile-workers 12 --json "$LOGS/sweep_$blocks.json"
              done
              for rows in 1024 512; do
                step "profile_$rows" 120 python3 bench/profile_decode.py --batch "$rows" --context 192 --no-sweep \
                  --json "$LOGS/profile_$rows.json"
              done ;;
    idle) step job_idle 300 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
            --profile-steps 0 --seqs 512,auto --penalties 1.0 --rows 1500 --json "$LOGS/job_idle.json" ;;
    bigbatchab) step job_auto_ab 330 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
                  --profile-steps 0 --seqs auto --penalties 1.0 --rows 2000 --compare .prev --json "$LOGS/job_auto_ab.json"
                step job_512_ab 250 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
                  --profile-steps 0 --seqs 512 --penalties 1.0 --rows 1500 --compare .prev --json "$LOGS/job_512_ab.json" ;;
    autojob) step job_auto 580 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
               --profile-steps 0 --seqs auto,256,512,auto --penalties 1.0 --rows 4000 --json "$LOGS/job_auto.json" ;;
    tests) step gpu_tests 560 python3 -m pytest -q -m gpu tests/ -rfE -p no:cacheprovider \
             --ignore=tests/job/test_job_end_to_end.py --ignore=tests/output/test_output_report.py ;;
    # the same tests in two commands (on an H100 on 2026-12-06 `tests` reached 188 of 206 tests in 560 s)
    testsa) step gpu_tests_a 560 python3 -m pytest -q -m gpu tests/engine tests/bench tests/distributed -rfE \
              -p no:cacheprovider ;;
    testsb) step gpu_tests_b 560 python3 -m pytest -q -m gpu tests/ -rfE -p no:cacheprovider --ignore=tests/engine \
              --ignore=tests/bench --ignore=tests/distributed --ignore=tests/job/test_job_end_to_end.py \
              --ignore=tests/output/test_output_report.py ;;
    newtests) step new_gpu_tests 240 python3 -m pytest -q -m gpu tests/kernels/test_kernels.py \
                tests/quant/test_fp8_kernels.py tests/kernels/test_layernorm_kernel.py -rfE -p no:cacheprovider ;;
    logprobs) step job_logprobs 560 "${JOB[@]}" --rows 1000 --ab-set sampling.logprobs=5 --json "$LOGS/job_lp5.json" ;;
    moe) step moe_seed 150 "${BG[@]}" --new-tokens 1024 --variants graphs_async --model-geometry qwen3-30b-a3b \
           --json "$LOGS/moe_seed.json" ;;
    fp8moe) step fp8_moe_tests 200 python3 -m pytest -q -m gpu tests/quant/test_fp8_moe.py -rfE -p no:cacheprovider
         step w1_fp8_moe 300 "${BG[@]}" --new-tokens 1024 --weights fp8 --variants graphs_async \
           --model-geometry qwen3-30b-a3b --json "$LOGS/w1_fp8_moe.json" ;;
    fp8moejob) rm -rf /tmp/gpu_proofs_work/model  # the 8B's folder: room for the ~31 GB FP8 MoE checkpoint
         step moe_job_fp8 580 "${JOB[@]}" --rows 1000 --model-geometry qwen3-30b-a3b --weights fp8 \
           --json "$LOGS/moe_job_fp8.json"
         rm -rf /tmp/gpu_proofs_work/model-qwen3-30b-a3b-fp8 ;;
    moejob) rm -rf /tmp/gpu_proofs_work/model  # the disk (64 GiB) holds one of the 8B and the 61 GB MoE model
         step moe_job 580 "${JOB[@]}" --rows 1000 --model-geometry qwen3-30b-a3b --json "$LOGS/moe_job.json"
         rm -rf /tmp/gpu_proofs_work/model-qwen3-30b-a3b ;;
    longrun) step longrun 590 "${JOB[@]}" --rows 20000 --json "$LOGS/longrun.json"
         grep -o '"tok_s_rows_[0-9_]*": [0-9.a-z]*' "$LOGS/longrun.log" ;;
    sweep) step attention_sweep 330 python3 bench/decode_attention_sweep.py \
             --geometries "$SWEEP_GEOMS" --shapes 32:768,256:512 \
             --compile-workers 12 --write-table batchgen/kernels/attention/decode_launches.json --json "$LOGS/attention_sweep.json"
         cp batchgen/kernels/attention/decode_launches.json "$OUT/" ;;  # the table comes back beside proofs.tgz
    families) for g in $FAMILIES; do
        step "w1-$g" 90 "${BG[@]}" --new-tokens 1024 --variants graphs_async --model-geometry "$g" \
          --json "$LOGS/w1-$g.json"; done ;;
    blas) for g in $BLAS_GEOMS; do  # engine.graph_blas_library: cublaslt (the default) and cublas
        step "w1-blas-$g" 150 "${BG[@]}" --new-tokens 1024 --variants "$BLAS_VARIANTS" \
          --model-geometry "$g" --json "$LOGS/w1-blas-$g.json"; done ;;
    profiles) for g in gemma2-9b phi3-mini; do
        step "profile-$g" 120 python3 bench/profile_decode.py --model-geometry "$g" --engine-only --batch 32 \
          --context 768 --json "$LOGS/profile-$g.json"; done ;;
    fp8) # the block-wise _scaled_mm with rows padded to 4 (its probe said no on 2026-12-01), then W1 by the default
         # (split-K at <= 32 rows) against block-wise forced, and the job (M = 256: block-wise where the probe passes)
         step fp8_tests 120 python3 -m pytest -q -m gpu tests/quant/test_fp8_kernels.py -rfE -p no:cacheprovider \
           -k "blockwise or probe or block_scaled or group_quantiser or per_channel"
         step fp8_probe 60 python3 -c "from batchgen.kernels.fp8.blockwise import blockwise_unsupported_reason as r; \
print('block-wise _scaled_mm:', r(0) or 'yes')"
         step w1_fp8 200 "${BG[@]}" --new-tokens 1024 --weights fp8 --json "$LOGS/w1_fp8.json" \
           --variants graphs_async,graphs_async_fp8_blockwise
         step job_bf16 170 "${JOB[@]}" --rows 1000 --json "$LOGS/job_bf16.json"
         step job_fp8 200 "${JOB[@]}" --rows 1000 --weights fp8 --json "$LOGS/job_fp8.json" ;;
    fp8profile) for path in blockwise splitk; do  # where an FP8 W1 step goes (quantisation, GEMMs, the rest)
        step "profile-fp8-$path" 120 python3 bench/profile_decode.py --weights fp8 --fp8-gemm "$path" --batch 32 \
          --context 768 --json "$LOGS/profile-fp8-$path.json"; done ;;
    fp8big) step w1_fp8_70b 400 "${BG[@]}" --new-tokens 1024 --weights fp8 --variants graphs_async \
              --model-geometry llama-70b --json "$LOGS/w1_fp8_70b.json" ;;
    fp8bigjob) rm -rf /tmp/gpu_proofs_work  # a 70B FP8 checkpoint (~70 GB) fits neither the 64 GiB disk nor the
         # default /dev/shm (half the 128 GiB of RAM): the job's model folder lives in a /dev/shm grown to 100 GiB
         mount -o remount,size=100G /dev/shm && df -h /dev/shm | tail -1
         step job_fp8_70b 580 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /dev/shm/bg70 --profile-steps 0 \
           --seqs 256 --penalties 1.0 --rows 500 --model-geometry llama-70b --weights fp8 --json "$LOGS/job_fp8_70b.json"
         rm -rf /dev/shm/bg70 ;;
    tp) step tp_tests 200 python3 -m pytest -q -m gpu tests/bench/test_bench_tensor_parallel.py \
          tests/distributed/test_tensor_parallel.py -rfE -p no:cacheprovider
        step tp2_70b 380 "${BG[@]}" --tensor-parallel 2 --model-geometry llama-70b --new-tokens 1024 \
          --variants graphs_async --json "$LOGS/tp2_70b.json" ;;
    fp8gemm) step splitk_tests 100 python3 -m pytest -q tests/quant/test_fp8_splitk.py -rfE -p no:cacheprovider
             step fp8_gemm 470 python3 bench/fp8_gemm.py --rows 32,64 --sweep --sweep-rows 16,32,64 \
               --json "$LOGS/fp8_gemm.json" ;;
    fp8kv) step fp8kv_tests 150 python3 -m pytest -q -m gpu tests/quant/test_fp8_kv_cache.py -rfE -p no:cacheprovider
           step job_fp8kv 420 "${JOB[@]}" --rows 1000 --ab-set engine.kv_cache_dtype=fp8 --json "$LOGS/job_fp8kv.json" ;;
    refill) step job_refill 580 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
              --profile-steps 0 --seqs 256 --penalties 1.0,1.1 --rows 1000 --compare .prev --json "$LOGS/job_refill.json" ;;
    prefill) step profile_prefill 180 python3 bench/profile_prefill.py --json "$LOGS/profile_prefill.json"
             step mixed 300 "${BG[@]}" --workload mixed --requests 2000 --json "$LOGS/mixed.json" ;;
    mixedab) i=0; for code in ${MIXED_ORDER:-.prev . . .prev}; do i=$((i + 1))  # checkouts, run in this order
               # run from inside the checkout: `python3 -m` puts the working directory first on sys.path
               tag=${code#.}; tag=${tag:-this}
               step "mixed_${i}_$tag" 200 bash -c "cd $code && PYTHONPATH=/tmp/site:\$PWD ${BG[*]} \
                 --workload mixed --requests ${MIXED_REQUESTS:-1000} --json $LOGS/mixed_$i.json"; done ;;
    mixedprof) step kernels_prev 220 bash -c "cd .prev && PYTHONPATH=/tmp/site:\$PWD python3 ../bench/mixed_kernels.py \
                 --requests ${MIXED_PROF:-400} --warmup ${MIXED_PROF_WARMUP:-short} --json $LOGS/kernels_prev.json"
               step kernels_this 220 python3 bench/mixed_kernels.py --requests "${MIXED_PROF:-400}" \
                 --warmup "${MIXED_PROF_WARMUP:-short}" \
                 --json "$LOGS/kernels_this.json"
               [ -f "$LOGS/kernels_prev.json" ] && [ -f "$LOGS/kernels_this.json" ] && python3 bench/mixed_kernels.py \
                 --compare "$LOGS/kernels_prev.json" "$LOGS/kernels_this.json" | tee "$LOGS/kernels_compare.txt"
               tar czf "$OUT/proofs.tgz" -C "$LOGS" . ;;
    fp8splitk) step splitk_tests 150 python3 -m pytest -q -m gpu tests/quant/test_fp8_splitk.py -p no:cacheprovider -rfE
               step fp8_gemm_256 420 python3 bench/fp8_gemm.py --rows 256,512 --sweep \
                 --sweep-rows "${SPLITK_SWEEP_ROWS:-64,128,256,512}" \
                 --json "$LOGS/fp8_gemm_256.json" ;;
    fp8job) for w in ${FP8_WEIGHTS:-bf16 fp8}; do
              step "job_$w" 560 "${BG[@]}" --workload job --tokenizer "$TOK" --work-dir /tmp/gpu_proofs_work \
                --profile-steps 0 --seqs "${FP8_SEQS:-256,512}" --penalties 1.0 --rows 1000 --weights "$w" \
                --json "$LOGS/job_$w.json"; done ;;
    detcheck) step det_tests 200 python3 -m pytest -q -m gpu tests/kernels/test_fixed_row_gemm.py \
                tests/kernels/test_invariant_kernels.py tests/engine/test_deterministic_engine.py \
                -rfE -p no:cacheprovider
              step invariant_gemm 150 python3 bench/invariant_gemm.py --json "$LOGS/invariant_gemm.json"
              step profile_det 120 python3 bench/profile_decode.py --deterministic --batch 256 --context 768 \
                --json "$LOGS/profile_det.json" ;;
    detcost) step detcost 580 "${JOB[@]}" --rows 1000 --ab-set engine.deterministic=true --json "$LOGS/detcost.json" ;;
    det) step det 590 bash bench/deterministic_gpu.sh /tmp/batchgen-det 500 0 "$TOK" ;;
    *) echo "unknown section $section (rayx2 bigbatch bigbatchab tests newtests logprobs moe moejob fp8moe fp8moejob longrun sweep families blas profiles fp8 fp8profile fp8big fp8bigjob tp fp8gemm fp8kv refill prefill mixedab mixedprof fp8job detcheck detcost det)"; exit 2 ;;
  esac
done
