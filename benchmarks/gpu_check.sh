#!/bin/bash
# The GPU checks of issues 13 and 18 in one run, on a machine with one NVIDIA GPU:
#   1. tfpar-check (versions, devices, auto's choice, one GPT step in fit and in the loop),
#      with auto (one GPU) and with mirrored on 2 logical GPUs;
#   2. benchmarks/gpu_steps.py: each compressor's cost per step under mirrored, 1 and 2
#      replicas (2 logical GPUs joined by hierarchical_copy);
#   3. benchmarks/placement.py: every schedule at S = 2 (2 logical GPUs), M = 8, on
#      the deep-wide GPT of docs/placement.md.
# Results land in $OUT (JSON, and the schedule charts as one tarball). TensorFlow comes from
# the Python path; SITE, if set, is a folder holding it (and CUDA 12 libraries in
# SITE/cuda/lib) for a machine without TensorFlow installed.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#   OUT=/tmp/gpu PARTS="steps placement" bash benchmarks/gpu_check.sh    # some of them
# A device call runs at most 10 minutes: give steps and placement a call each.
set -u
PARTS=${PARTS:-check steps placement}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -n "${SITE:-}" ]; then
  export PYTHONPATH=$SITE:$PWD LD_LIBRARY_PATH=$SITE/cuda/lib:${LD_LIBRARY_PATH:-} PATH=$SITE/cuda/bin:$PATH
  export XLA_FLAGS="--xla_gpu_cuda_data_dir=$SITE/cuda ${XLA_FLAGS:-}"
else
  export PYTHONPATH=$PWD
fi
export CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
PY=${PY:-python3}
# the first H200 run: 210 s covered only the 1-replica rows (each configuration's first
# call, mostly tracing, took 10-30 s), and the schedules took about 240 s
STEPS_S=${STEPS_S:-420} PLACEMENT_S=${PLACEMENT_S:-300}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"
$PY -c "import tensorflow as tf; print('tensorflow', tf.__version__, tf.config.list_physical_devices('GPU'))" || exit 1

if [[ $PARTS == *check* ]]; then
  echo "== tfpar-check"
  timeout 150 $PY -m tfpar.check --json > "$OUT/check.json" 2> "$OUT/check.err"
  echo "tfpar-check rc $?"; tail -c 2500 "$OUT/check.json"; tail -n 8 "$OUT/check.err"
  echo "== tfpar-check, mirrored on 2 logical GPUs (Keras fit against tfpar's loop, 2 replicas)"
  timeout 150 $PY -m tfpar.check --strategy=mirrored --virtual-devices=2 --json \
    > "$OUT/check_mirrored.json" 2> "$OUT/check_mirrored.err"
  echo "tfpar-check (mirrored) rc $?"; tail -c 1500 "$OUT/check_mirrored.json"
fi

if [[ $PARTS == *steps* ]]; then
  echo "== compressors per step"
  timeout "$STEPS_S" $PY benchmarks/gpu_steps.py --out "$OUT" 2> "$OUT/gpu_steps.err"
  echo "gpu_steps rc $?"; tail -n 5 "$OUT/gpu_steps.err"
fi

if [[ $PARTS == *placement* ]]; then
  echo "== pipeline schedules, S = 2 on 2 logical GPUs"
  timeout "$PLACEMENT_S" $PY benchmarks/placement.py --stages=2 --micro-batches=8 --depth=8 --dim=768 \
    --seq=32 --batch=64 --cost=seconds --rounds=2 --out="$OUT/schedules" 2> "$OUT/placement.err"
  echo "placement rc $?"; tail -n 5 "$OUT/placement.err"
  tar czf "$OUT/schedules.tgz" -C "$OUT" schedules && rm -rf "$OUT/schedules"
fi
