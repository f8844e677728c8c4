#!/usr/bin/env bash
# The GPU checks and the parallel-scaling rows of BENCHMARKS.md, in one command on a 2-GPU host.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [tests] [scaling] [nccl-proto]
#
# Parts (all by default):
#   tests       pytest -m gpu: kernels on real shapes, bf16 training, every NCCL layout vs one GPU
#   scaling     llama-1b: one GPU, then TP=2 (plain; tp_async_grad_reduce, profiled; the same with SP)
#               and DP=2 + ZeRO-1 + overlap, each 2-GPU row against the 1-GPU row of this same run
#   nccl-proto  the TP=2 row again with NCCL_PROTO=Simple (NCCL picked LL for 17-34 MB messages)
# Every job has its own time limit (a fresh machine compiles llama-1b in ~90 s) and writes its
# log as it goes (OUT_DIR/NAME.log, unbuffered), so a job cut short still leaves its output.
# Results: OUT_DIR/NAME.json (benchmarks/train_throughput.py) and a summary on stdout.
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR [tests] [scaling] [nccl-proto]}
shift
parts=${*:-tests scaling nccl-proto}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
B="benchmarks/train_throughput.py --config deploy/configs/llama-1b.toml --data.default_corpus_bytes=4000000 --steps 6 --warmup 3 --skip-baseline"
T="torchrun --standalone --nproc-per-node 2"

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

for part in $parts; do
  case $part in
    tests)
      job tests 900 python3 -m pytest -m gpu -v -p no:cacheprovider tests
      grep -E "passed|failed|error" "$out/tests.log" | tail -n 3 ;;
    scaling)
      job 1gpu 240 python3 $B --out "$out/1gpu.json" --run-dir "$out/runs/1gpu"
      row 1gpu
      if [ "$ngpu" -lt 2 ]; then echo "scaling: $ngpu GPU(s), the 2-GPU rows need 2"; continue; fi
      S="--single-gpu-json $out/1gpu.json"
      job tp2 240 $T $B $S --tensor-model-parallel-size 2 --out "$out/tp2.json" --run-dir "$out/runs/tp2"
      row tp2
      job tp2-async 270 $T $B $S --tensor-model-parallel-size 2 --parallel.tp_async_grad_reduce=true \
        --profile-steps 1 --out "$out/tp2-async.json" --run-dir "$out/runs/tp2-async"
      row tp2-async
      grep -A14 "where a step goes" "$out/tp2-async.log" | head -n 15
      job tp2-sp-async 240 $T $B $S --tensor-model-parallel-size 2 --sequence-parallel \
        --parallel.tp_async_grad_reduce=true --out "$out/tp2-sp-async.json" --run-dir "$out/runs/tp2-sp-async"
      row tp2-sp-async
      job dp2-zero1 240 $T $B $S --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
        --out "$out/dp2-zero1.json" --run-dir "$out/runs/dp2-zero1"
      row dp2-zero1 ;;
    nccl-proto)
      if [ "$ngpu" -lt 2 ] || [ ! -f "$out/1gpu.json" ]; then echo "nccl-proto: needs 2 GPUs and the scaling part"; continue; fi
      job tp2-async-simple 240 env NCCL_PROTO=Simple $T $B --single-gpu-json "$out/1gpu.json" \
        --tensor-model-parallel-size 2 --parallel.tp_async_grad_reduce=true \
        --out "$out/tp2-async-simple.json" --run-dir "$out/runs/tp2-async-simple"
      row tp2-async-simple ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
