#!/bin/bash
# Issue 20's GPU run in one call of the device tool, from the repository root on the device machine:
#   mkdir -p .git/info && bash ../shared/gpu/prepare-device.sh   # here: .device/wheels (nltk) for the device
#   git rev-parse HEAD > .device/commit           # the commit, named in summary.txt (the device's git metadata
#                                                 # had once named an older one)
#   run: command "bash benchmarks/device_run.sh", carry [".device"], timeout_s 450
# (DEADLINE_S 420 leaves a warm second call room within the 15 minutes: STEPS="bench_train torchrun train_compiled")
# The default steps (DEFAULT_STEPS below) run in order of importance: the tests, the evaluate targets,
# the NCCL job, the training step, then what explains the figures. STEPS="test_gpu sweep" runs only those
# (sweep and eval_compiled: not by default). Each step has its own time limit, and one that would pass
# DEADLINE_S is cut short or skipped, so the call ends inside its limit with every finished step's output.
# Two files come back (at most 8 can): summary.txt (the machine, each step's command, exit status and
# seconds) and steps.txt (each step's whole log, in order, under "## NAME.txt", written as it runs: a
# call cut short by the tool keeps what its last step had printed).
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); DEADLINE_S=${DEADLINE_S:-420}
DEFAULT_STEPS="probe test_gpu test_fused eval_f30k eval_coco bench_train torchrun train_compiled gpu_profile host_copy train_matrix"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 SGRAF_CACHE_DIR=/tmp/sgraf-cache
if ! python3 -c "import nltk" 2>/dev/null; then   # every step that tokenises would fail after spending device time
  echo "no nltk on the device: run bash ../shared/gpu/prepare-device.sh here and carry .device" | tee "$OUT/summary.txt"
  exit 3
fi
{
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "commit (carried): $(cat .device/commit 2>/dev/null || echo none)"
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
  nproc; uname -r
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
LOGS=/tmp/device-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"   # a warm machine keeps the last call's

# step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the time left, its log appended to
# $OUT/steps.txt
step() {
  local name=$1 limit=$2; shift 2
  [[ " ${STEPS:-$DEFAULT_STEPS} " == *" $name "* ]] || return 0
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "=== $name: skipped (${left} s left)" | tee -a "$OUT/summary.txt"; return; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit} s): $*" | tee -a "$OUT/summary.txt"
  local t0=$(date +%s)
  echo "## $name.txt" >> "$OUT/steps.txt"
  timeout --kill-after 5 "$limit" "$@" 2>&1 | tee "$LOGS/$name.txt" >> "$OUT/steps.txt"
  local rc=${PIPESTATUS[0]}
  # a step cut short: torchrun's workers run in sessions of their own (torch.distributed.elastic), out of
  # timeout's reach once their agent is killed, and one still stopping (saving its checkpoint) would
  # hold the GPU through the next step: what is left of the step's Python is stopped
  if (( rc == 124 || rc == 137 )) && pkill -KILL -f -- "-m sgraf |benchmarks/[a-z_]+[.]py"; then
    echo "!!! $name: processes left after its time limit were killed" | tee -a "$OUT/summary.txt"
  fi
  echo >> "$OUT/steps.txt"
  echo "--- $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-12}" "$LOGS/$name.txt"
}

# what the command's fixed costs are made of, into summary.txt: the imports (PyTorch's CUDA
# build) and the clock `sgraf evaluate --timings` reads its startup from (/proc/uptime against the
# process's start)
if [[ " ${STEPS:-$DEFAULT_STEPS} " == *" probe "* ]]; then
  { python3 -X importtime -c "import sgraf.evaluate" 2>&1 | sort -t"|" -k2 -n | tail -12
    for pause in 0 3; do sleep $pause; python3 -c "from sgraf.stopwatch import process_age
print('uptime', open('/proc/uptime').read().split()[0], 'process age at entry', process_age())"; done
  } >> "$OUT/summary.txt" 2>&1
fi
# the tests: each one named with its outcome and the slowest timed; a test that hangs fails alone
# (pytest-timeout, in the device's image); the tests' own cache folder, apart from the benchmarks'.
# The Triton kernels' tests (their compilations, and a fault there would spoil every later CUDA
# call of the process) in a process of their own, after the others, which take the eager routes
PYTEST_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90")
TAIL=25 step test_gpu 120 env SGRAF_CACHE_DIR=/tmp/sgraf-test-cache SGRAF_WORD_ROUTE=eager SGRAF_STEP_ROUTE=eager SGRAF_ATTENTION_ROUTE=eager SGRAF_FILTER_ROUTE=eager python3 -m pytest -v -rfEs --durations=12 -p no:cacheprovider $PYTEST_TIMEOUT tests/test_gpu.py -k "not fused"
TAIL=25 step test_fused 150 env SGRAF_CACHE_DIR=/tmp/sgraf-test-cache python3 -m pytest -v -rfEs --durations=12 -p no:cacheprovider $PYTEST_TIMEOUT tests/test_gpu.py -k fused
# a kernel that faulted on the device (a CUDA context cannot recover): the later steps score by the
# eager routes, and the summary says so
if grep -qE "illegal memory access|unspecified launch failure|misaligned address|CUDA error" "$LOGS/test_fused.txt" 2>/dev/null; then
  export SGRAF_WORD_ROUTE=eager SGRAF_STEP_ROUTE=eager SGRAF_ATTENTION_ROUTE=eager SGRAF_FILTER_ROUTE=eager
  echo "!!! a fused kernel failed on the device (test_fused): the later steps run the eager routes" | tee -a "$OUT/summary.txt"
fi
# the Flickr30K-size run first pays the device's probes (edge route, word-node route with the fused
# kernel's compilation) in an untimed run per precision, and stores them for the MSCOCO-size one
TAIL=20 step eval_f30k 120 python3 benchmarks/bench_eval.py --device cuda --images 1000 --precisions bf16 fp32 --authors-captions 100 --token-cache both --probed --tuning /tmp/sgraf-tuning
TAIL=20 step eval_coco 230 python3 benchmarks/bench_eval.py --device cuda --images 5000 --precisions bf16 fp32 --authors-captions 100 --tuning /tmp/sgraf-tuning
# the train step rows of the targets, ours (fp32, bf16) and the authors' algorithm, SGR and SAF, with peak memory
TAIL=20 step bench_train 150 python3 benchmarks/bench_train.py --device cuda --batch 128 --steps 3
# torchrun on CUDA: one process per GPU, so WORLD_SIZE=1 forms no process group (the NCCL group
# itself is tested in test_gpu, with one rank); the saved bf16 and fp32 matrices side by side
step torchrun 110 bash -c 'set -e; python3 -m sgraf generate --out /tmp/gen --features synthetic --n-train 400 --n-dev 60 --n-test 60 --no-images
  python3 -m torch.distributed.run --nproc-per-node 1 -m sgraf train --data /tmp/gen --out /tmp/run --preset tiny --set device=cuda epochs=2
  python3 -m torch.distributed.run --nproc-per-node 1 -m sgraf evaluate --checkpoint /tmp/run/best.pt --data /tmp/gen --split test --precision bf16 --quiet --save-sims /tmp/run/sims_bf16.npy
  python3 -m sgraf evaluate --checkpoint /tmp/run/best.pt --data /tmp/gen --split test --device cuda --quiet --timings --save-sims /tmp/run/sims.npy
  python3 -c "import numpy as np; a, b = np.load(\"/tmp/run/sims_bf16.npy\"), np.load(\"/tmp/run/sims.npy\"); print(\"saved matrices\", a.shape, b.shape, \"bf16 - fp32 at most\", float(abs(a - b).max()))"'
# the SGR bf16 step (the host-bound one) with its selected pairs compiled (SGRAF_COMPILE=train, session 22) beside eager: the warm-up
# step compiles the batch's one graph (forward and backward), the timed steps say whether launches bound the step; SAF's
# (no pairs' backward) compiles only its bf16 word nodes' elementwise passes (Triton): whether `auto` should fuse them on a
# GPU too, as it does on the CPU (session 28)
TAIL=12 step train_compiled 150 python3 benchmarks/bench_train.py --device cuda --batch 128 --steps 5 --modules sgr saf --precisions bf16 --no-authors --no-memory --compiled
# the blocks at 1,024 captions only (128 was for the launch counts, read in session 14): each module is
# profiled once per set of routes, SGR five times and SAF four (the attention's and the filtration's kernels)
TAIL=14 step gpu_profile 150 python3 benchmarks/gpu_profile.py --steps 5 --captions 1024
TAIL=20 step sweep 90 python3 benchmarks/gpu_profile.py --sweep --steps 3
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
