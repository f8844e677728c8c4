#!/usr/bin/env bash
# The GPU tests and the GPU rows of BENCHMARKS.md, as a few named suites.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [SUITE...]
#
# Suites (in the order given; by default all of them, in this order):
#   tests      pytest -m gpu: kernels on real shapes, bf16 training, every NCCL layout against one
#              GPU (the two-GPU cases skip themselves on one GPU)
#              (TESTS_K: a pytest -k filter; TESTS_LIMIT: seconds, default 900)
#   train      one GPU, end to end (benchmarks/train_throughput.py): every config against the plain
#              compiled baseline in the same process, at the configs' defaults (so llama-1b has RoPE
#              and SwiGLU on Triton). Rows: gpt2-125m-s1024, gpt2-125m-s2048, gpt2-350m, llama-1b;
#              gpt2-125m-s1024-gelu with GELU on Triton as well (its defaults leave it to Inductor);
#              gpt2-125m-s1024-ce and llama-1b-ce with the Triton cross-entropy on the compiled
#              projection's logits; llama-1b-lce with the fused linear + cross-entropy (no baseline:
#              compare with the llama-1b row).
#              Every baseline runs twice: plainly (its residual stream in fp32, the ratio's
#              denominator) and with the stream cast to bf16, as meshtrain's is by default
#              (model.fp32_residual_connection), for the like-for-like ratio.
#              Each row keeps every side built and times them in turn, TRAIN_ROUNDS times over
#              (default 3; train_throughput.py --rounds: a drift of the machine falls on every side
#              alike); TRAIN_ROUNDS=1 builds and times each side once, in turn, which --profile-steps
#              and a --variant that changes the kernel choice need. 2.5-6 min a row.
#              TRAIN_ROWS="gpt2-350m llama-1b" runs those rows only; TRAIN_FLAGS adds flags to every
#              row and TRAIN_TAG a suffix to its name, e.g. TRAIN_FLAGS=--train.bf16_weight_copies=false
#              TRAIN_TAG=-nocopies; TRAIN_FLAGS=--variant=FLAG adds meshtrain with FLAG to each row, in
#              the same process; TRAIN_FLAGS=--train.micro_batch_size=16 runs both sides at that size.
#   kernels    benchmarks/kernels.py: each Triton kernel against the eager and the compiled reference,
#              and against a copy of as many bytes (KERNEL_OPS: a comma-separated subset of ops)
#   scaling    two GPUs, llama-1b (torchrun), each row against the one-GPU row of OUT_DIR:
#                1gpu                   one GPU, the reference row (run it first, or keep its JSON)
#                tp2                    TP=2, the input gradients' all-reduce beside the weight-gradient
#                                       GEMM (parallel.tp_async_grad_reduce, the default), profiled
#                tp2-sync-grad          TP=2 with tp_async_grad_reduce=false
#                tp2-sp                 TP=2 + sequence parallelism
#                tp2-sp-comm-overlap    the same with --tp-comm-overlap (symmetric-memory fused GEMMs)
#                dp2                    DP=2, all-reduce after backward (whole-model compile)
#                dp2-zero1              DP=2 + ZeRO-1 with both overlaps (per-block compile), profiled
#                dp2-zero1-bf16-reduce  the same with --grad-reduce-in-bf16
#                dp2-zero1-gbs128       the same at global batch 128: each GPU runs the one-GPU row's
#                                       micro-batches (weak scaling; dp2-zero1 keeps the batch)
#                1gpu-fp8               one GPU in FP8 (hybrid, tensorwise): the fp8-* rows' reference
#                fp8-dp2-zero1          FP8 with DP=2 + ZeRO-1, both overlaps
#                fp8-tp2-sp             FP8 with TP=2 + SP, inputs all-gathered in FP8, profiled
#                fp8-tp2-sp-bf16-gather the same gathering in bf16 (train.fp8_all_gather=false)
#                fp8-tp2-sp-delayed     TP=2 + SP with delayed scaling (no amax collective in the step)
#                pp2-1f1b, pp2-interleaved (2 chunks a stage), pp2-zb-h1
#                                       PP=2 with each schedule, profiled (device idle: the bubble, against
#                                       (p-1)/m = 1/16 for 1F1B at 16 micro-batches, 1/32 interleaved)
#                1gpu-s32k              one GPU at sequence 32k (micro-batch 1, global 8, full recompute):
#                                       the cp2-* rows' reference
#                cp2-p2p, cp2-a2a       CP=2 at 32k with each comm type (a2a+p2p needs cp >= 4), profiled
#                cp2-p2p-s64k, cp2-p2p-s128k  CP=2 at 64k and 128k (tokens/s and peak memory per GPU)
#                1gpu-moe               one GPU on deploy/configs/moe.toml: the ep2-* rows' reference
#                ep2-moe                EP=2 (and DP=2) on the moe config, profiled (all-to-all time)
#              SCALING_ROWS="1gpu tp2" runs those rows only; SCALING_MBS=N runs every row, the
#              one-GPU one too, at micro-batch N (names end in -mbsN: like is compared with like).
#   nodescale  four or eight GPUs of one host (N: 8 where there are 8, else 4), each row against a one-GPU
#              row of OUT_DIR (the 1gpu* rows run first, on one GPU; an existing JSON is reused
#              only when the row is skipped with NODE_ROWS):
#                1gpu, 1gpu-fp8         llama-1b, bf16 and FP8 (tensorwise)
#                1gpu-8b-8layers(-fp8)  eight Llama-3-8B-wide blocks: the 8B rows' per-GPU reference
#                1gpu-moe, 1gpu-s64k    deploy/configs/moe.toml; llama-1b at sequence 64k
#                dpN-zero1-weak         DP=N + ZeRO-1, global batch 64*N: weak scaling (goal >= 90%)
#                3d-tp2-pp2-dpN/4(-fp8) TP=2 + SP x PP=2 interleaved x DP with ZeRO-1, llama-1b, bf16 and
#                                       FP8 (goal: MFU per GPU within 10% of the one-GPU row)
#                llama3-8b-tp2-pp2-dpN/4(-fp8)  the same layout on benchmarks/configs/llama3-8b.toml
#                                       (~7.2B: too large for one GPU's optimizer state)
#                moe-epN                EP=N on the moe config (all-to-all time in the profile)
#                cp4-s64k               CP=4 at sequence 64k, on four GPUs
#              NODE_ROWS="1gpu dp8-zero1-weak" runs those rows only. Checkpoints across layouts (saved
#              at tp2 x pp2, resumed at cp2 x dp2 with ZeRO-1 and on one GPU, exported to Hugging Face) are
#              a test: TESTS_K=crosses_layouts bash benchmarks/gpu_suite.sh OUT tests.
#   ce-sweep   benchmarks/ce_launch_sweep.py: the cross-entropy kernels under every launch setting
#              of a small grid, against the current one
#   host-time  benchmarks/host_time.py on gpt2-125m and llama-1b: host time per step against the
#              wall, and the CUDA runtime calls that can block the host inside two steps
#   fp8        FP8 training (not in the default list; needs torchao for the float8 baseline:
#              python3 -m pip install --no-deps .whl/torchao-0.18.0-*.whl). Rows, in order:
#                fp8-tests         pytest -m gpu -k fp8 (FP8 layers against bf16, scaling on the GPU)
#                fp8-llama-1b      train_throughput.py on llama-1b, four sides built and timed in turn
#                                  (--rounds 1: one side's memory at a time): meshtrain bf16, the plain
#                                  baseline in bf16, meshtrain FP8 (--variant), and last the plain
#                                  baseline with torchao's float8 (--baseline-float8; last because
#                                  torchao patches Inductor's codegen for the process); the FP8 speedup
#                                  and every ratio in the JSON
#                fp8-llama3-8b-8layers  the same on benchmarks/configs/llama3-8b-8layers.toml (eight
#                                  Llama-3-8B-wide blocks, mb2 x 4)
#                fp8-loss-curve    benchmarks/fp8_loss_curve.py: gpt2-350m, bf16 and FP8 for
#                                  FP8_LOSS_STEPS steps (default 1000) at seq 1024, mb8 x 1; JSON + PNG
#              FP8_FLAGS: meshtrain's FP8 flags (default --train.fp8=hybrid --train.fp8_recipe=tensorwise;
#              the loss curve's FP8 run gets them too); FLOAT8_RECIPE: torchao's recipe
#              (default tensorwise). FP8_TRAIN_FLAGS: more flags for both throughput rows (e.g.
#              --train.micro_batch_size=8); FP8_LOSS_FLAGS: more flags for fp8_loss_curve.py (e.g.
#              --global-batch-size 16, or --data.default_corpus_bytes=4000000 for a cached corpus).
#              FP8_MORE_VARIANTS: more meshtrain sides for the throughput rows, flag sets separated by '|'
#              (e.g. "--train.fp8=hybrid --train.fp8_recipe=delayed|--train.fp8=hybrid --train.cuda_graph=true"),
#              each with its speedup over bf16. FP8_ROWS="fp8-tests fp8-llama-1b" runs those rows only. Expected on
#              one H200 (compilation included): tests 1-3 min, llama-1b ~6 min, the 8B-wide ~4 min, the loss
#              curve ~5 min; where one command may run 10 minutes at most, run the rows in three calls:
#              FP8_ROWS="fp8-tests fp8-llama3-8b-8layers", then "fp8-llama-1b", then "fp8-loss-curve".
#              A fresh H100 was slower: the loss curve took 5.7 min, and llama-1b's bf16 and FP8 sides
#              took 8 min together (each line "timed ..." says when its side finished).
# NCCL and CUDA environment variables set for the script (NCCL_*, TORCH_NCCL_*,
# CUDA_DEVICE_MAX_CONNECTIONS) reach every row, and train_throughput.py records them in its JSON;
# give such a run its own OUT_DIR, with its own 1gpu row.
# Every job has its own time limit (a fresh machine compiles llama-1b in ~90 s) and writes its
# log as it goes (OUT_DIR/NAME.log, unbuffered), so a job cut short still leaves its output.
# Results: OUT_DIR/NAME.json and a summary on stdout; run directories under $RUNS_DIR (default
# OUT_DIR/runs: no checkpoints, but many files).
#
# Run from the repository root, with the project and its test dependencies importable beside the
# host's CUDA build of torch (e.g. `pip install -e '.[test]'` without replacing torch). The gRPC
# health and reflection packages must not be newer than the installed grpcio: their generated
# code refuses an older grpcio, and pytest then stops at collecting the service tests.
set -u
set -f  # row flags such as --train.compiled_triton_ops=["gelu"] are split into words, never globbed
out=${1:?usage: gpu_suite.sh OUT_DIR [SUITE...]}
shift
suites=${*:-tests train kernels scaling ce-sweep host-time}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
runs=${RUNS_DIR:-$out/runs}

job() {  # job NAME LIMIT_S COMMAND...: run with a limit, log to OUT/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo " (time limit $limit s)")"
}

row() {  # row NAME: one line from a train_throughput JSON
  python3 - "$out/$1.json" "$1" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
r = next(iter(d["results"].values()))
extra = f"  speedup {d['speedup_vs_1gpu']:.3f}x" if "speedup_vs_1gpu" in d else ""
mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "-"
print(f"  {sys.argv[2]:<26} {r['tokens_per_s']:>10,.0f} tokens/s  MFU {mfu}  "
      f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}{extra}")
EOF
}

where() {  # where NAME: the step breakdown a profiled row printed
  grep -A20 "where a step goes" "$out/$1.log" 2>/dev/null | head -n 21
}

sharded_row() {  # sharded_row NAME REF PROCS LIMIT ARGS...: torchrun ARGS on PROCS GPUs, against OUT/REF.json
  local name=$1 ref=$2 procs=$3 limit=$4
  shift 4
  if [ ! -f "$out/$ref.json" ]; then echo "$name: needs the $ref row in $out"; return; fi
  job "$name" "$limit" torchrun --standalone --nproc-per-node "$procs" "$@" --single-gpu-json "$out/$ref.json" \
    --out "$out/$name.json" --run-dir "$runs/$name"
  row "$name"
  where "$name"
}

chosen() {  # chosen NAME LIST: whether NAME is in the space-separated LIST (an empty LIST chooses all)
  [ -z "$2" ] || [[ " $2 " == *" $1 "* ]]
}

fp8_summary() {  # fp8_summary NAME: the FP8 ratios of a train_throughput JSON
  python3 - "$out/$1.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
say = {"ratio_vs_variant": ("meshtrain FP8 / meshtrain bf16", True),
       "variant_ratio_vs_float8_baseline": ("meshtrain FP8 / plain + torchao float8", False),
       "ratio_vs_float8_baseline": ("meshtrain bf16 / plain + torchao float8", False),
       "float8_baseline_speedup": ("plain + torchao float8 / plain bf16", False),
       "ratio_tokens_per_s": ("meshtrain bf16 / plain bf16", False)}
for key, (words, inverse) in say.items():
    if key in d:
        mean, median = (1 / d[key], 1 / d[key + "_median"]) if inverse else (d[key], d[key + "_median"])
        print(f"  {words:<42} {mean:.3f}x (median steps {median:.3f}x)")
for flags, one in d.get("variants", {}).items():
    if "failed" in one:
        print(f"  meshtrain {flags}: failed ({one['failed'][:200]})")
    else:
        print(f"  meshtrain {flags} / meshtrain bf16: {one['speedup_vs_meshtrain']:.3f}x "
              f"(median steps {one['speedup_vs_meshtrain_median']:.3f}x)")
EOF
}

fp8() {
  local fp8_flags=${FP8_FLAGS:---train.fp8=hybrid --train.fp8_recipe=tensorwise}
  local float8="--baseline-float8 ${FLOAT8_RECIPE:-tensorwise}"
  if ! python3 -c "import torchao.float8" 2>/dev/null; then
    echo "fp8: torchao is not importable: no float8 baseline (python3 -m pip install --no-deps .whl/torchao-*.whl)"
    float8=""
  fi
  if chosen fp8-tests "${FP8_ROWS:-}"; then
    job fp8-tests 420 python3 -m pytest -m gpu -k fp8 -v -p no:cacheprovider --durations 10 tests
    grep -E "passed|failed|error" "$out/fp8-tests.log" | tail -n 3
  fi
  local more=() one v  # FP8_MORE_VARIANTS: further meshtrain sides, '|'-separated flag sets
  if [ -n "${FP8_MORE_VARIANTS:-}" ]; then
    IFS="|" read -ra one <<< "$FP8_MORE_VARIANTS"
    for v in "${one[@]}"; do more+=("--variant=$v"); done
  fi
  local spec name config steps limit
  for spec in "fp8-llama-1b|deploy/configs/llama-1b.toml|--steps 6 --warmup 3|560" \
      "fp8-llama3-8b-8layers|benchmarks/configs/llama3-8b-8layers.toml|--steps 10 --warmup 3|420"; do
    IFS="|" read -r name config steps limit <<< "$spec"
    chosen "$name" "${FP8_ROWS:-}" || continue
    job "$name" "$limit" python3 benchmarks/train_throughput.py --config "$config" \
      --data.default_corpus_bytes=4000000 $steps --rounds 1 $float8 --variant="$fp8_flags" "${more[@]}" ${FP8_TRAIN_FLAGS:-} \
      --out "$out/$name.json" --run-dir "$runs/$name"
    sed -n '/^impl/,/^ratio/p' "$out/$name.log" 2>/dev/null | grep -v "^ratio"
    fp8_summary "$name"
  done
  if chosen fp8-loss-curve "${FP8_ROWS:-}"; then
    local format recipe rest
    format=$(grep -o -- "--train.fp8=[a-z0-9]*" <<< "$fp8_flags" | cut -d= -f2)
    recipe=$(grep -o -- "--train.fp8_recipe=[a-z]*" <<< "$fp8_flags" | cut -d= -f2)
    rest=$(sed -E 's/--train\.fp8(_recipe)?=[a-z0-9]+//g; s/^ +//; s/ +$//' <<< "$fp8_flags")
    job fp8-loss-curve 560 python3 benchmarks/fp8_loss_curve.py --steps "${FP8_LOSS_STEPS:-1000}" \
      --fp8-format "${format:-hybrid}" ${recipe:+--fp8-recipe "$recipe"} --fp8-extra="$rest" --timeout-s 270 \
      ${FP8_LOSS_FLAGS:-} \
      --run-dir "$runs/fp8-loss-curve" --out "$out/fp8-loss-curve.json" --plot "$out/fp8-loss-curve.png"
    tail -n 4 "$out/fp8-loss-curve.log"
  fi
}

scaling() {
  if [ "$ngpu" -lt 2 ]; then echo "scaling: needs 2 GPUs"; return; fi
  local mbs=${SCALING_MBS:-}
  local s=${mbs:+-mbs$mbs}  # every row's name ends with it, the reference row's too
  local B="benchmarks/train_throughput.py --config deploy/configs/llama-1b.toml --data.default_corpus_bytes=4000000"
  B="$B --steps 6 --warmup 3 --skip-baseline ${mbs:+--train.micro_batch_size=$mbs}"
  local TP="--tensor-model-parallel-size 2"
  local ZERO="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"  # ZeRO-1, both overlaps
  local F8="--fp8-format hybrid --fp8-recipe tensorwise"
  # sequence 32k: one sequence a micro-batch, 8 a step, every block recomputed (what fits one GPU)
  local S32="--model.seq_length=32768 --train.micro_batch_size=1"
  S32="$S32 --train.global_batch_size=8 --parallel.recompute_granularity=full"
  local MOE="--config deploy/configs/moe.toml"  # the last --config counts
  local ref
  # the reference rows, one GPU: bf16, FP8 for the fp8-* rows, sequence 32k for cp2-*, the MoE for ep2-*
  for ref in "1gpu|" "1gpu-fp8|$F8" "1gpu-s32k|$S32" "1gpu-moe|$MOE"; do
    chosen "${ref%%|*}" "${SCALING_ROWS:-}" || continue
    job "${ref%%|*}$s" 360 python3 $B ${ref#*|} --out "$out/${ref%%|*}$s.json" --run-dir "$runs/${ref%%|*}$s"
    row "${ref%%|*}$s"
  done
  local spec name flags
  for spec in "tp2|$TP --profile-steps 1" \
      "tp2-sync-grad|$TP --parallel.tp_async_grad_reduce=false" \
      "tp2-sp|$TP --sequence-parallel" \
      "tp2-sp-comm-overlap|$TP --sequence-parallel --tp-comm-overlap" \
      "dp2|" \
      "dp2-zero1|$ZERO --profile-steps 1" \
      "dp2-zero1-bf16-reduce|$ZERO --grad-reduce-in-bf16" \
      "dp2-zero1-gbs128|$ZERO --train.global_batch_size=128" \
      "fp8-dp2-zero1|$ZERO $F8" \
      "fp8-tp2-sp|$TP --sequence-parallel $F8 --profile-steps 1" \
      "fp8-tp2-sp-bf16-gather|$TP --sequence-parallel $F8 --train.fp8_all_gather=false" \
      "fp8-tp2-sp-delayed|$TP --sequence-parallel --fp8-format hybrid --fp8-recipe delayed" \
      "pp2-1f1b|--parallel.pp=2 --parallel.pipeline_schedule=1f1b --profile-steps 1" \
      "pp2-interleaved|--parallel.pp=2 --parallel.virtual_pipeline_model_parallel_size=2 --profile-steps 1" \
      "pp2-zb-h1|--parallel.pp=2 --parallel.pipeline_schedule=zb-h1 --profile-steps 1" \
      "cp2-p2p|$S32 --parallel.cp=2 --parallel.cp_comm_type=p2p --profile-steps 1" \
      "cp2-a2a|$S32 --parallel.cp=2 --parallel.cp_comm_type=a2a --profile-steps 1" \
      "cp2-p2p-s64k|$S32 --model.seq_length=65536 --train.global_batch_size=4 --parallel.cp=2" \
      "cp2-p2p-s128k|$S32 --model.seq_length=131072 --train.global_batch_size=2 --steps 3 --warmup 2 --parallel.cp=2" \
      "ep2-moe|$MOE --parallel.ep=2 --profile-steps 1"; do
    name=${spec%%|*} flags=${spec#*|}
    chosen "$name" "${SCALING_ROWS:-}" || continue
    ref=1gpu$s
    case $name in  # each row scales against one GPU running its own job
      fp8-*) ref=1gpu-fp8$s ;;
      cp2-*) ref=1gpu-s32k$s ;;
      ep2-*) ref=1gpu-moe$s ;;
    esac
    sharded_row "$name$s" "$ref" 2 270 $B $flags
  done
}

nodescale() {  # four or eight GPUs of one host, each row against a one-GPU row of OUT_DIR
  if [ "$ngpu" -lt 4 ]; then echo "nodescale: needs 4 or 8 GPUs"; return; fi
  local n=$(( ngpu >= 8 ? 8 : 4 ))
  local B="benchmarks/train_throughput.py --data.default_corpus_bytes=4000000 --steps 6 --warmup 3 --skip-baseline"
  local L="$B --config deploy/configs/llama-1b.toml"
  local W="$B --config benchmarks/configs/llama3-8b-8layers.toml"
  local TP="--tensor-model-parallel-size 2 --sequence-parallel"
  local ZERO="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
  local F8="--fp8-format hybrid --fp8-recipe tensorwise"
  local PP="--parallel.pp=2 --parallel.virtual_pipeline_model_parallel_size=2"  # interleaved, 2 chunks a stage
  local S64="--model.seq_length=65536 --train.micro_batch_size=1 --train.global_batch_size=4"
  S64="$S64 --parallel.recompute_granularity=full"
  local spec name cmd ref
  # the one-GPU rows (name|command): llama-1b bf16 and FP8, the 8B-wide blocks bf16 and FP8, the MoE,
  # llama-1b at 64k
  for spec in "1gpu|$L" "1gpu-fp8|$L $F8" "1gpu-8b-8layers|$W" "1gpu-8b-8layers-fp8|$W $F8" \
      "1gpu-moe|$L --config deploy/configs/moe.toml" "1gpu-s64k|$L $S64"; do
    name=${spec%%|*}
    chosen "$name" "${NODE_ROWS:-}" || continue
    job "$name" 420 python3 ${spec#*|} --out "$out/$name.json" --run-dir "$runs/$name"
    row "$name"
  done
  # the rows on n GPUs (name|reference|command flags)
  for spec in "dp$n-zero1-weak|1gpu|$L $ZERO --train.global_batch_size=$((64 * n))" \
      "3d-tp2-pp2-dp$((n / 4))|1gpu|$L $TP $PP $ZERO --profile-steps 1" \
      "3d-tp2-pp2-dp$((n / 4))-fp8|1gpu-fp8|$L $TP $PP $ZERO $F8" \
      "llama3-8b-tp2-pp2-dp$((n / 4))|1gpu-8b-8layers|$B --config benchmarks/configs/llama3-8b.toml $TP $PP $ZERO" \
      "llama3-8b-tp2-pp2-dp$((n / 4))-fp8|1gpu-8b-8layers-fp8|$B --config benchmarks/configs/llama3-8b.toml $TP $PP $ZERO $F8" \
      "moe-ep$n|1gpu-moe|$L --config deploy/configs/moe.toml --parallel.ep=$n --profile-steps 1" \
      "cp4-s64k|1gpu-s64k|$L $S64 --parallel.cp=4 --profile-steps 1"; do
    IFS="|" read -r name ref cmd <<< "$spec"
    chosen "$name" "${NODE_ROWS:-}" || continue
    sharded_row "$name" "$ref" "$([[ $name == cp4-* ]] && echo 4 || echo "$n")" 560 $cmd
  done
}

for suite in $suites; do
  case $suite in
    tests)
      job tests "${TESTS_LIMIT:-900}" python3 -m pytest -m gpu -v -p no:cacheprovider --durations 15 \
        ${TESTS_K:+-k "$TESTS_K"} tests
      grep -E "passed|failed|error" "$out/tests.log" | tail -n 3 ;;
    train)
      C="benchmarks/train_throughput.py --data.default_corpus_bytes=4000000 --baseline-bf16-residual"
      G1="$C --config deploy/configs/gpt2-125m.toml --steps 30 --warmup 8"
      L="$C --config deploy/configs/llama-1b.toml --steps 6 --warmup 3"
      for spec in "gpt2-125m-s1024|$G1" \
          "gpt2-125m-s1024-gelu|$G1 --train.compiled_triton_ops=[\"gelu\"]" \
          "gpt2-125m-s2048|$G1 --model.seq_length=2048 --train.micro_batch_size=8" \
          "gpt2-350m|$C --config deploy/configs/gpt2-350m.toml --steps 12 --warmup 5" \
          "llama-1b|$L" \
          "llama-1b-lce|$L --skip-baseline --train.compiled_triton_ops=[\"rope\",\"swiglu\",\"linear_cross_entropy\"]" \
          "gpt2-125m-s1024-ce|$G1 --train.compiled_triton_ops=[\"cross_entropy\"]" \
          "llama-1b-ce|$L --train.compiled_triton_ops=[\"rope\",\"swiglu\",\"cross_entropy\"]"; do
        name=${spec%%|*}
        chosen "$name" "${TRAIN_ROWS:-}" || continue
        name=$name${TRAIN_TAG:-}
        job "$name" 560 python3 ${spec#*|} --rounds "${TRAIN_ROUNDS:-3}" ${TRAIN_FLAGS:-} --out "$out/$name.json" \
          --run-dir "$runs/$name"
        sed -n '/^impl/,/^wrote/p' "$out/$name.log" 2>/dev/null | grep -v "^wrote"
      done ;;
    kernels)
      job kernels 480 python3 benchmarks/kernels.py ${KERNEL_OPS:+--ops "$KERNEL_OPS"} --rounds 2 --budget-s 150 \
        --out "$out/kernels.json"
      tail -n 30 "$out/kernels.log" ;;
    scaling)
      scaling ;;
    nodescale)
      nodescale ;;
    ce-sweep)
      job ce-sweep 360 python3 benchmarks/ce_launch_sweep.py --out "$out/ce-sweep.json"
      tail -n 80 "$out/ce-sweep.log" ;;
    fp8)
      fp8 ;;
    host-time)
      for cfg in gpt2-125m llama-1b; do
        job "host-time-$cfg" 300 python3 benchmarks/host_time.py --config "deploy/configs/$cfg.toml" \
          --data.default_corpus_bytes=4000000 --steps 10 --warmup 5 --out "$out/host-time-$cfg.json" \
          --run-dir "$runs/host-time-$cfg"
        tail -3 "$out/host-time-$cfg.log" 2>/dev/null
      done ;;
    *) echo "unknown suite: $suite (suites: tests train kernels scaling nodescale ce-sweep host-time fp8)"; exit 2 ;;
  esac
done
