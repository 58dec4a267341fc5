#!/bin/bash
# Issue 20's GPU run in one call of the device tool, from the repository root on the device machine:
#   bash ../shared/gpu/prepare-device.sh          # here: .device/wheels (nltk) for the device
#   run: command "bash benchmarks/device_run.sh", carry [".device"], timeout_s 560
# STEPS="test_gpu sweep" runs only those steps (sweep: not by default). Each step writes its own log
# under $OUT, beside summary.txt (at most 8 files come back) and has its own time limit;
# the steps run in order of importance, and a step that would pass DEADLINE_S is skipped, so the
# call ends inside its limit with every finished step's output.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); DEADLINE_S=${DEADLINE_S:-520}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 SGRAF_CACHE_DIR=/tmp/sgraf-cache
{
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
  nproc; uname -r
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

# step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the time left, log to $OUT/NAME.txt
step() {
  local name=$1 limit=$2; shift 2
  [[ " ${STEPS:-probe test_gpu gpu_profile torchrun bench_train train_compiled eval_f30k eval_coco host_copy train_matrix} " == *" $name "* ]] || return 0
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "=== $name: skipped (${left} s left)" | tee -a "$OUT/summary.txt"; return; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit} s): $*" | tee -a "$OUT/summary.txt"
  local t0=$(date +%s)
  timeout --kill-after 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "--- $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-12}" "$OUT/$name.txt"
}

# what the command's fixed costs are made of, into summary.txt: the imports (PyTorch's CUDA
# build) and the clock `sgraf evaluate --timings` reads its startup from (/proc/uptime against the
# process's start)
if [[ " ${STEPS:-probe} " == *" probe "* ]]; then
  { python3 -X importtime -c "import sgraf.evaluate" 2>&1 | sort -t"|" -k2 -n | tail -12
    for pause in 0 3; do sleep $pause; python3 -c "from sgraf.stopwatch import process_age
print('uptime', open('/proc/uptime').read().split()[0], 'process age at entry', process_age())"; done
  } >> "$OUT/summary.txt" 2>&1
fi
step test_gpu 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
# the blocks at 1,024 captions only (128 was for the launch counts, read in session 14): each module is
# profiled once per set of routes, SGR five times and SAF four (the attention's and the filtration's kernels)
TAIL=14 step gpu_profile 150 python3 benchmarks/gpu_profile.py --steps 5 --captions 1024
TAIL=20 step sweep 90 python3 benchmarks/gpu_profile.py --sweep --steps 3
step torchrun 75 bash -c 'set -e; python3 -m sgraf generate --out /tmp/gen --features synthetic --n-train 400 --n-dev 60 --n-test 60 --no-images
  python3 -m torch.distributed.run --nproc-per-node 1 -m sgraf train --data /tmp/gen --out /tmp/run --preset tiny --set device=cuda epochs=2
  python3 -m torch.distributed.run --nproc-per-node 1 -m sgraf evaluate --checkpoint /tmp/run/best.pt --data /tmp/gen --split test --precision bf16 --quiet --save-sims /tmp/run/sims_bf16.npy
  python3 -m sgraf evaluate --checkpoint /tmp/run/best.pt --data /tmp/gen --split test --device cuda --quiet --timings --save-sims /tmp/run/sims.npy
  python3 -c "import numpy as np; a, b = np.load(\"/tmp/run/sims_bf16.npy\"), np.load(\"/tmp/run/sims.npy\"); print(\"saved matrices\", a.shape, b.shape, \"bf16 - fp32 at most\", float(abs(a - b).max()))"'
TAIL=20 step bench_train 240 python3 benchmarks/bench_train.py --device cuda --batch 128 --steps 3 --matrix
# the SGR bf16 step (the host-bound one) with its selected pairs compiled (SGRAF_COMPILE=train, session 22) beside eager: the warm-up
# step compiles the batch's one graph (forward and backward), the timed steps say whether launches bound the step; SAF's
# (no pairs' backward) compiles only its bf16 word nodes' elementwise passes (Triton): whether `auto` should fuse them on a
# GPU too, as it does on the CPU (session 28)
TAIL=12 step train_compiled 150 python3 benchmarks/bench_train.py --device cuda --batch 128 --steps 5 --modules sgr saf --precisions bf16 --no-authors --no-memory --compiled
# the Flickr30K-size run first pays the device's probes (edge route, word-node route with the fused
# kernel's compilation) in an untimed run per precision, and stores them for the MSCOCO-size one
TAIL=20 step eval_f30k 150 python3 benchmarks/bench_eval.py --device cuda --images 1000 --precisions bf16 fp32 tf32 --authors-captions 100 --token-cache both --probed --tuning /tmp/sgraf-tuning
TAIL=20 step eval_coco 230 python3 benchmarks/bench_eval.py --device cuda --images 5000 --precisions bf16 fp32 --authors-captions 100 --tuning /tmp/sgraf-tuning
# the MSCOCO-size matrix copied (and saved) after the scoring or band by band beside it (session 20)
TAIL=8 step host_copy 60 python3 benchmarks/bench_host_copy.py --repeats 3 --band-ms 150
# the SGR matrix a training step scores without autograd, by the training path and by the eval scorer (by the
# training chunks and whole): seconds and launches of each on the device (session 23, on the CPU: by the chunks
# 1.17x alone, but the whole step 0.96x; under the emulated GPU plan 211-243 operations by the chunks and 71-93
# whole, against 257-293)
TAIL=8 step train_matrix 60 python3 benchmarks/probe_train_matrix.py --device cuda --precisions bf16 fp32 --rounds 5
# the compiled eval chunk (sgraf.kernels.compiled, opt-in) on CUDA: not by default (on an H100 its
# compilations made a Flickr30K-size evaluate 13x slower, benchmarks/results/gpu-h100-*-b024312.txt)
TAIL=20 step eval_compiled 120 env SGRAF_COMPILE=on python3 benchmarks/bench_eval.py --device cuda --images 1000 --precisions ${COMPILED_PRECISIONS:-bf16 fp32} --no-authors
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
