#!/usr/bin/env bash
# The GPU checks and the parallel-scaling rows of BENCHMARKS.md, in one command on a 2-GPU host.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [PART...]
#
# Parts (in the order given; all of them by default):
#   tests       pytest -m gpu: kernels on real shapes, bf16 training, every NCCL layout vs one GPU
#               (TESTS_K: a pytest -k filter; TESTS_LIMIT: seconds, default 900)
#   1gpu        llama-1b on one GPU: the row every 2-GPU row of the same run is compared with
#   tp          TP=2: without tp_async_grad_reduce (on by default), and with it (profiled)
#   tp-split    TP=2 with tp_async_grad_reduce + tp_batch_split (profiled)
#   tp-sp       TP=2 + SP with tp_async_grad_reduce, without and with tp_batch_split
#   dp          DP=2 + ZeRO-1 with both overlaps (per-block compile; profiled)
#   dp-nopg     DP=2 + ZeRO-1 with grad-reduce overlap only (whole-model compile)
#   dp-plain    DP=2 without the distributed optimizer (whole-model compile)
#   tp-async    TP=2 with tp_async_grad_reduce, unprofiled
#   nccl-proto  TP=2 with tp_async_grad_reduce under NCCL_PROTO=Simple (NCCL picks LL for these
#               16-32 MB all-reduces); nccl-proto-split: the same with tp_batch_split
#   tp-sched    TP=2 with tp_async_grad_reduce and train.compile_overlap_scheduling (Inductor's
#               overlap scheduler), without and with tp_batch_split (profiled)
#   1gpu-mbsN   one GPU at micro-batch N (N = 8, 16, ...; the 1gpu row is at the config's 4)
#   baseline-mbsN  one GPU at micro-batch N with the plain-torch baseline in the same process
#               (issue 6's ratio at that micro-batch)
#   triton-mbsN the same with meshtrain on its Triton kernels under torch.compile (--train.kernels=triton:
#               triton_ops that Inductor launches itself) instead of Inductor's fusions of the reference ops
#   issue6      issue 6's end-to-end table on one GPU: gpt2-125m at seq 1024 and 2048, gpt2-350m and
#               llama-1b, each against the plain compiled baseline in the same process (the configs'
#               defaults, so llama-1b has RoPE and SwiGLU on Triton); and gpt2-125m with GELU on Triton
#               as well (--train.compiled_triton_ops='["gelu"]'), which its defaults leave to Inductor;
#               and llama-1b with the fused linear + cross-entropy on Triton too (no baseline: compare
#               with the i6-llama-1b row); and gpt2-125m and llama-1b with the Triton cross-entropy on the
#               compiled projection's logits (-ce rows, each with its baseline).
#               Every baseline runs twice: plainly (its residual stream in fp32, the ratio's
#               denominator) and with the stream cast to bf16, as meshtrain's is by default
#               (model.fp32_residual_connection), for the like-for-like ratio.
#               ~2.5-6 min a row with the rounds; I6_ROWS="i6-gpt2-350m i6-llama-1b" runs those only.
#               The defaults include the bf16 weight copies of one process; I6_FLAGS adds flags to every
#               row and I6_TAG a suffix to its name, e.g. I6_FLAGS=--train.bf16_weight_copies=false
#               I6_TAG=-nocopies for the same rows without them; I6_FLAGS=--variant=FLAG adds a row of
#               meshtrain with FLAG, in the same process (train_throughput.py --variant). Each row keeps every
#               side built and times them in turn, I6_ROUNDS times over (default 3; train_throughput.py
#               --rounds: per-round ratios, every side's memory at once: llama-1b's three sides fit in an
#               H200, with a variant too they would not); I6_ROUNDS=1 times each side once, built and
#               released in turn, as before the nineteenth session (needed for --profile-steps, and for a
#               --variant that changes the kernel choice)
#   kernels     benchmarks/kernels.py: issue 6's kernel table (KERNEL_OPS: a comma-separated subset of ops)
#   ce-sweep    benchmarks/ce_launch_sweep.py: the cross-entropy kernels under every launch setting of a
#               small grid, against the current one
#   host-time   benchmarks/host_time.py on gpt2-125m and llama-1b: host time per step against the wall,
#               and the CUDA runtime calls that can block the host inside two steps
#   tp-mbsN     TP=2 with tp_async_grad_reduce at micro-batch N, against 1gpu-mbsN (fewer
#               micro-batches per step, so less of the host's launch work per token)
#   tp-streams  TP=2 with tp_async_grad_reduce, CUDA_DEVICE_MAX_CONNECTIONS=1 and
#               TORCH_NCCL_HIGH_PRIORITY=1: the launch order is kept on the device and NCCL's
#               kernels get SMs first, so an all-reduce launched before a GEMM is not queued
#               behind it (what Megatron requires for its TP overlap), profiled
#   tp-split-streams  tp-split under the same two variables, profiled
#   tp-streams-nchN  tp-streams with NCCL_MAX_NCHANNELS=N (N = 2, 4, ...): the all-reduce's kernel
#               takes fewer SMs from the GEMMs it runs beside (with the streams they slow by about
#               as much as the all-reduce they hide: BENCHMARKS.md, sixth session), profiled
#   tp-streams-mbsN  tp-streams at micro-batch N, against 1gpu-mbsN
#   tp-symm     tp-streams with --tp-reduce-impl symm_mem (the forward all-reduces through PyTorch's
#               symmetric-memory two-shot kernel instead of NCCL's ring), profiled
#   tp-symm-mbsN  the same at micro-batch N, against 1gpu-mbsN
#   tp-carveout tp-streams with train.matmul_sm_carveout=16 (cuBLASLt matmuls leave 16 SMs free
#               for NCCL's kernels), profiled
#   dp-bf16     the dp row with gradients reduced in bf16 (--grad-reduce-in-bf16: half the bytes), profiled
#   dp-streams  the dp row under the same two variables (its reduce-scatters and all-gathers
#               run beside backward and forward GEMMs), profiled
#   allreduce   TP's all-reduce alone (benchmarks/allreduce_bench.py): NCCL under its default and
#               under NCCL_PROTO=LL128 / Simple and NCCL_MIN_NCHANNELS=16 / 32, against PyTorch's
#               symmetric-memory one-shot and two-shot all-reduces (peer loads, no multicast);
#               AR_SETTINGS: other settings, comma-separated (e.g. "NCCL_MAX_NCHANNELS=8,NCCL_MAX_NCHANNELS=16")
#   allreduce-gemm  the same all-reduces (NCCL's default setting) alone and each beside llama-1b's
#               fc1 weight-gradient GEMM at TP=2 (what the async input-gradient all-reduce hides
#               behind), without and with the streams settings: how much of it each really hides
#   dp-weak     DP=2 + ZeRO-1 with both overlaps at global batch 128: each GPU does the 16
#               micro-batches of the 1gpu row (weak scaling; the dp row keeps the batch, 8 each)
# The 2-GPU parts need the 1gpu part's JSON in OUT_DIR (from this run or an earlier one;
# tp-mbsN needs 1gpu-mbsN's).
# Every job has its own time limit (a fresh machine compiles llama-1b in ~90 s) and writes its
# log as it goes (OUT_DIR/NAME.log, unbuffered), so a job cut short still leaves its output.
# Results: OUT_DIR/NAME.json (benchmarks/train_throughput.py) and a summary on stdout.
#
# On the device machine the image lacks zarr and the gRPC health/reflection packages. Carry them
# as wheels in .whl (see /work/.library/device/README.md), one version of each, for cp312:
#   zarr numcodecs donfig google-crc32c msgspec (zarr 3.4 needs it) tomli-w tqdm typing-extensions
#   grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
# and first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# (without the gRPC ones, pytest stops at collecting the service tests; their version must not be
# newer than the image's grpcio, 1.84.0: the generated code in newer wheels refuses an older grpcio).
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR [PART...]}
shift
parts=${*:-tests allreduce allreduce-gemm 1gpu tp tp-async tp-split tp-sp dp dp-nopg dp-plain nccl-proto nccl-proto-split tp-sched 1gpu-mbs8 tp-mbs8 1gpu-mbs16 tp-mbs16 tp-streams tp-streams-mbs16 tp-symm tp-symm-mbs16 tp-split-streams tp-carveout dp-streams dp-bf16 dp-weak}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
B="benchmarks/train_throughput.py --config deploy/configs/llama-1b.toml --data.default_corpus_bytes=4000000 --steps 6 --warmup 3 --skip-baseline"
T="torchrun --standalone --nproc-per-node 2"
runs=${RUNS_DIR:-$out/runs}  # run directories (checkpoint-free, but many files)

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

two() {  # two NAME LIMIT FLAGS...: a 2-GPU llama-1b row against the 1-GPU row in OUT_DIR (BASE=its name)
  local name=$1 limit=$2 base=${BASE:-1gpu}
  shift 2
  if [ "$ngpu" -lt 2 ] || [ ! -f "$out/$base.json" ]; then echo "$name: needs 2 GPUs and the $base part"; return; fi
  job "$name" "$limit" $T $B --single-gpu-json "$out/$base.json" "$@" --out "$out/$name.json" \
    --run-dir "$runs/$name"
  row "$name"
}

TPA="--tensor-model-parallel-size 2 --parallel.tp_async_grad_reduce=true"  # TP=2, async input-grad reduction
ZERO="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"  # ZeRO-1, both overlaps

where() {  # where NAME: the step breakdown a profiled row printed
  grep -A20 "where a step goes" "$out/$1.log" 2>/dev/null | head -n 21
}

streams() {  # streams COMMAND...: keep the launch order on the device, NCCL on high-priority streams
  CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_HIGH_PRIORITY=1 "$@"
}

for part in $parts; do
  case $part in
    tests)
      job tests "${TESTS_LIMIT:-900}" python3 -m pytest -m gpu -v -p no:cacheprovider --durations 15 \
        ${TESTS_K:+-k "$TESTS_K"} tests
      grep -E "passed|failed|error" "$out/tests.log" | tail -n 3 ;;
    1gpu)
      job 1gpu 240 python3 $B --out "$out/1gpu.json" --run-dir "$runs/1gpu"
      row 1gpu ;;
    tp)
      two tp2 240 --tensor-model-parallel-size 2 --parallel.tp_async_grad_reduce=false
      two tp2-async 270 $TPA --profile-steps 1
      where tp2-async ;;
    tp-async)
      two tp2-async-unprofiled 240 $TPA ;;
    tp-split)
      two tp2-async-split 270 $TPA --parallel.tp_batch_split=true --profile-steps 1
      where tp2-async-split ;;
    tp-sp)
      two tp2-sp-async 240 $TPA --sequence-parallel
      two tp2-sp-async-split 240 $TPA --sequence-parallel --parallel.tp_batch_split=true ;;
    dp)
      two dp2-zero1 240 $ZERO --profile-steps 1
      where dp2-zero1 ;;
    dp-nopg)
      two dp2-zero1-nopg 240 --use-distributed-optimizer --overlap-grad-reduce ;;
    dp-plain)
      two dp2 240 ;;
    nccl-proto)
      NCCL_PROTO=Simple two tp2-async-simple 240 $TPA ;;
    nccl-proto-split)
      NCCL_PROTO=Simple two tp2-async-split-simple 240 $TPA --parallel.tp_batch_split=true ;;
    tp-sched)
      two tp2-async-sched 270 $TPA --train.compile_overlap_scheduling=true
      two tp2-async-split-sched 300 $TPA --parallel.tp_batch_split=true --train.compile_overlap_scheduling=true \
        --profile-steps 1
      where tp2-async-split-sched ;;
    1gpu-mbs[1-9]*)
      job "$part" 240 python3 $B --train.micro_batch_size="${part#1gpu-mbs}" --out "$out/$part.json" \
        --run-dir "$runs/$part"
      row "$part" ;;
    baseline-mbs[1-9]*)
      job "$part" 400 python3 ${B/ --skip-baseline/} --train.micro_batch_size="${part#baseline-mbs}" \
        --out "$out/$part.json" --run-dir "$runs/$part"
      grep -A4 "^impl" "$out/$part.log" 2>/dev/null ;;
    triton-mbs[1-9]*)
      job "$part" 400 python3 ${B/ --skip-baseline/} --train.micro_batch_size="${part#triton-mbs}" \
        --train.kernels=triton --out "$out/$part.json" --run-dir "$runs/$part"
      grep -A4 "^impl" "$out/$part.log" 2>/dev/null ;;
    issue6)
      C="benchmarks/train_throughput.py --data.default_corpus_bytes=4000000 --baseline-bf16-residual"
      G1="$C --config deploy/configs/gpt2-125m.toml --steps 30 --warmup 8"
      for row in "i6-gpt2-125m-s1024|$G1" "i6-gpt2-125m-s1024-gelu|$G1 --train.compiled_triton_ops=[\"gelu\"]" \
          "i6-gpt2-125m-s2048|$G1 --model.seq_length=2048 --train.micro_batch_size=8" \
          "i6-gpt2-350m|$C --config deploy/configs/gpt2-350m.toml --steps 12 --warmup 5" \
          "i6-llama-1b|$C --config deploy/configs/llama-1b.toml --steps 6 --warmup 3" \
          "i6-llama-1b-lce|$C --config deploy/configs/llama-1b.toml --steps 6 --warmup 3 --skip-baseline \
--train.compiled_triton_ops=[\"rope\",\"swiglu\",\"linear_cross_entropy\"]" \
          "i6-gpt2-125m-s1024-ce|$G1 --train.compiled_triton_ops=[\"cross_entropy\"]" \
          "i6-llama-1b-ce|$C --config deploy/configs/llama-1b.toml --steps 6 --warmup 3 \
--train.compiled_triton_ops=[\"rope\",\"swiglu\",\"cross_entropy\"]"; do
        name=${row%%|*}
        [ -n "${I6_ROWS:-}" ] && [[ " $I6_ROWS " != *" $name "* ]] && continue
        name=$name${I6_TAG:-}
        job "$name" 560 python3 ${row#*|} --rounds "${I6_ROUNDS:-3}" ${I6_FLAGS:-} --out "$out/$name.json" \
          --run-dir "$runs/$name"
        sed -n '/^impl/,/^wrote/p' "$out/$name.log" 2>/dev/null | grep -v "^wrote"
      done ;;
    kernels)
      job kernels 480 python3 benchmarks/kernels.py ${KERNEL_OPS:+--ops "$KERNEL_OPS"} --rounds 2 --budget-s 150 \
        --out "$out/kernels.json"
      tail -n 30 "$out/kernels.log" ;;
    ce-sweep)
      job ce-sweep 360 python3 benchmarks/ce_launch_sweep.py --out "$out/ce-sweep.json"
      tail -n 80 "$out/ce-sweep.log" ;;
    host-time)
      for cfg in gpt2-125m llama-1b; do
        job "host-time-$cfg" 300 python3 benchmarks/host_time.py --config "deploy/configs/$cfg.toml" \
          --data.default_corpus_bytes=4000000 --steps 10 --warmup 5 --out "$out/host-time-$cfg.json" \
          --run-dir "$runs/host-time-$cfg"
        tail -3 "$out/host-time-$cfg.log" 2>/dev/null
      done ;;
    tp-mbs[1-9]*)
      BASE=1gpu-mbs${part#tp-mbs} two "tp2-async-mbs${part#tp-mbs}" 240 $TPA --train.micro_batch_size="${part#tp-mbs}" ;;
    tp-streams)
      streams two tp2-async-streams 270 $TPA --profile-steps 1
      where tp2-async-streams ;;
    tp-streams-nch[1-9]*)  # NCCL_MAX_NCHANNELS: fewer channels, so fewer SMs taken from the GEMMs beside it
      NCCL_MAX_NCHANNELS=${part#tp-streams-nch} streams two "tp2-async-streams-nch${part#tp-streams-nch}" 270 \
        $TPA --profile-steps 1
      where "tp2-async-streams-nch${part#tp-streams-nch}" ;;
    tp-streams-mbs[1-9]*)
      BASE=1gpu-mbs${part#tp-streams-mbs} streams two "tp2-async-streams-mbs${part#tp-streams-mbs}" 240 $TPA \
        --train.micro_batch_size="${part#tp-streams-mbs}" ;;
    tp-symm)
      streams two tp2-async-symm 270 $TPA --tp-reduce-impl symm_mem --profile-steps 1
      where tp2-async-symm ;;
    tp-symm-mbs[1-9]*)
      BASE=1gpu-mbs${part#tp-symm-mbs} streams two "tp2-async-symm-mbs${part#tp-symm-mbs}" 240 $TPA \
        --tp-reduce-impl symm_mem --train.micro_batch_size="${part#tp-symm-mbs}" ;;
    tp-split-streams)
      streams two tp2-async-split-streams 270 $TPA --parallel.tp_batch_split=true --profile-steps 1
      where tp2-async-split-streams ;;
    tp-carveout)
      streams two tp2-async-carveout 270 $TPA --train.matmul_sm_carveout=16 --profile-steps 1
      where tp2-async-carveout ;;
    dp-streams)
      streams two dp2-zero1-streams 240 $ZERO --profile-steps 1
      where dp2-zero1-streams ;;
    dp-bf16)
      two dp2-zero1-bf16-reduce 240 $ZERO --grad-reduce-in-bf16 --profile-steps 1
      where dp2-zero1-bf16-reduce ;;
    allreduce)
      [ "$ngpu" -ge 2 ] || { echo "allreduce: needs 2 GPUs"; continue; }
      i=0
      settings=("" NCCL_PROTO=LL128 NCCL_PROTO=Simple NCCL_MIN_NCHANNELS=16 NCCL_MIN_NCHANNELS=32
                "NCCL_PROTO=Simple NCCL_MIN_NCHANNELS=32")
      [ -n "${AR_SETTINGS:-}" ] && IFS=, read -r -a settings <<< "$AR_SETTINGS"
      for setting in "${settings[@]}"; do
        i=$((i + 1))
        (export $setting NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
         job "allreduce-$i" 120 $T benchmarks/allreduce_bench.py --out "$out/allreduce-$i.json")
        grep -v "NCCL INFO" "$out/allreduce-$i.log" | grep -A12 "^all-reduce,"
        grep -m3 -E "NCCL INFO.*(nChannels|[0-9]+ coll channels)" "$out/allreduce-$i.log"
      done ;;
    allreduce-gemm)
      [ "$ngpu" -ge 2 ] || { echo "allreduce-gemm: needs 2 GPUs"; continue; }
      G="benchmarks/allreduce_bench.py --mb 16 32 64 --beside-gemm 5632 8192 2048"
      job allreduce-gemm 150 $T $G --label default --out "$out/allreduce-gemm.json"
      grep -A14 "^all-reduce," "$out/allreduce-gemm.log"
      streams job allreduce-gemm-streams 150 $T $G --label streams --out "$out/allreduce-gemm-streams.json"
      grep -A14 "^all-reduce," "$out/allreduce-gemm-streams.log" ;;
    dp-weak)
      two dp2-zero1-gbs128 270 $ZERO --train.global_batch_size=128 ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
