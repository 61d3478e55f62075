#!/bin/bash
# The GPU check, sized for a lent machine with one NVIDIA GPU: 15 minutes of device time in
# all, at most 10 minutes and 8 returned files a call. The default call fits in 6 minutes
# (BUDGET_S = 20 s of start + each part's time) and returns 4 files, the figures that matter
# first:
#   check      tfpar-check (auto: one GPU): versions, devices, all-reduce, matmul (10 products
#              of n = 8192: float32 with TF32 math as TensorFlow runs it, float32 with TF32 off,
#              bfloat16), one GPT step in Keras fit and in tfpar's loop       -> check.json
#   steps      one step table, benchmarks/gpu_steps.py: mirrored on 2 logical GPUs
#              (hierarchical_copy), none, fp16, topk, powersgd, onebit_adam   -> gpu_steps.json
#   schedules  pipeline schedules gpipe, 1f1b, zb-h1 at S = 2 on 2 logical GPUs, M = 8, on
#              the deep-wide GPT of docs/placement.md                         -> schedules.tgz
# and log.txt (all that was printed, every part's stderr included). The rest, each its own
# call: PARTS names the parts, CHECK_ARGS / STEPS_ARGS / SCHEDULES_ARGS are appended to that
# part's command line (argparse: the last of a repeated option wins):
#   mirrored   tfpar-check --strategy=mirrored --virtual-devices=2        -> check_mirrored.json
#   PARTS=steps STEPS_ARGS="--replicas 1 --configs none,fp16,int8,sign"  (another table)
#   PARTS=schedules SCHEDULES_ARGS="--schedules=interleaved,zb-v"        (the other schedules)
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh                 # the default call
#   bash benchmarks/gpu_check.sh --dry-run                     # its plan and files; runs nothing
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh mirrored steps   # parts as arguments (= PARTS)
#
# Time one part leaves goes to the next; each part keeps its own share (a part that would get
# under 20 s is skipped, saying so). It stops at once when there is no GPU, or when
# TensorFlow sees none (a CUDA library that does not load makes TensorFlow run everything on
# the CPU without a word). TensorFlow comes from the Python path; SITE, if set, is a folder
# holding it (and CUDA 12 libraries in SITE/cuda/lib) for a machine without TensorFlow
# (benchmarks/gpu_bundle.py).
set -u
START_S=20          # nvidia-smi and TensorFlow's GPU probe
MAX_FILES=8 MAX_CALL_S=570
declare -A SHARE=([check]=70 [steps]=120 [schedules]=150 [mirrored]=120)
declare -A FILES=([check]=check.json [steps]=gpu_steps.json [schedules]=schedules.tgz
                  [mirrored]=check_mirrored.json)
ORDER=(check mirrored steps schedules)
STEP_CONFIGS="none,fp16,topk(0.01),powersgd(4),onebit_adam"

DRY=0 ARGS=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$arg") ;;
  esac
done
[ ${#ARGS[@]} -gt 0 ] && PARTS="${ARGS[*]}"
PARTS=${PARTS:-check steps schedules}
OUT=${OUT:-gpu_out}
PY=${PY:-python3}

say() { echo "gpu_check: $*"; }

selected() {  # the parts asked for, in the order they run
  local part
  for part in "${ORDER[@]}"; do [[ " $PARTS " == *" $part "* ]] && echo "$part"; done
}

check_plan() {  # unknown parts, too many files, a call that cannot fit: refuse before anything
  local part files=1 budget=$START_S
  for part in $PARTS; do
    [ -n "${SHARE[$part]:-}" ] || { say "unknown part '$part': use ${ORDER[*]}" >&2; exit 2; }
  done
  for part in $(selected); do files=$((files + 1)); budget=$((budget + SHARE[$part])); done
  BUDGET_S=${BUDGET_S:-$budget}
  if [ "$files" -gt "$MAX_FILES" ] || [ "$BUDGET_S" -gt "$MAX_CALL_S" ]; then
    say "PARTS=\"$PARTS\" needs $files files and $BUDGET_S s: a call returns $MAX_FILES files" \
        "and runs 10 minutes at most; give the parts separate calls" >&2
    exit 2
  fi
}

plan() {
  local part names="log.txt"
  say "plan for PARTS=\"$PARTS\": at most $BUDGET_S s ($(awk "BEGIN {printf \"%.1f\", $BUDGET_S / 60}") min), $START_S s of start included"
  for part in $(selected); do
    printf '  %-9s %3d s  -> %s\n' "$part" "${SHARE[$part]}" "${FILES[$part]}"
    names="$names ${FILES[$part]}"
  done
  echo "files ($(wc -w <<< "$names") of at most $MAX_FILES): $names"
}

need_gpu() {  # exit 3: no driver or no GPU; exit 4: TensorFlow sees none
  if ! command -v nvidia-smi > /dev/null; then
    say "no nvidia-smi on this machine: no NVIDIA driver, so no GPU to check. Nothing was run."
    exit 3
  fi
  if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    say "nvidia-smi lists no GPU. Nothing was run."
    exit 3
  fi
  local err
  err=$(mktemp)
  if ! $PY -c "import sys, tensorflow as tf
gpus = tf.config.list_physical_devices('GPU')
print('tensorflow', tf.__version__, 'sees', [g.name for g in gpus])
sys.exit(0 if gpus else 4)" 2> "$err"; then
    say "TensorFlow sees no GPU although nvidia-smi shows one: a CUDA library it needs did not" \
        "load, and everything would run on the CPU. Nothing was run. TensorFlow said:"
    grep -i -E "dlopen|could not (load|find)|cuda|libcu|no module" "$err" | head -n 8
    [ -n "${SITE:-}" ] && say "SITE=$SITE: are the CUDA 12 libraries in $SITE/cuda/lib?"
    rm -f "$err"
    exit 4
  fi
  rm -f "$err"
}

run_part() {  # PART LIMIT: runs it under `timeout LIMIT`, its stderr into the log
  local part=$1 limit=$2 err rc
  err=$(mktemp)
  case $part in
    check)
      timeout -k 5 "$((limit - 5))" $PY -m tfpar.check --json ${CHECK_ARGS:-} > "$OUT/check.json" 2> "$err" ;;
    mirrored)
      timeout -k 5 "$((limit - 5))" $PY -m tfpar.check --strategy=mirrored --virtual-devices=2 --json \
        ${CHECK_ARGS:-} > "$OUT/check_mirrored.json" 2> "$err" ;;
    steps)
      timeout -k 5 "$((limit - 5))" $PY benchmarks/gpu_steps.py --out "$OUT" --replicas 2 --configs "$STEP_CONFIGS" \
        --steps 20 --rounds 3 --budget-s $((limit - 15)) ${STEPS_ARGS:-} 2> "$err" ;;
    schedules)
      timeout -k 5 "$((limit - 5))" $PY benchmarks/placement.py --stages=2 --micro-batches=8 --depth=8 --dim=768 \
        --seq=32 --batch=64 --cost=seconds --rounds=2 --schedules=gpipe,1f1b,zb-h1 \
        --out="$OUT/schedules" ${SCHEDULES_ARGS:-} 2> "$err" ;;
  esac
  rc=$?
  { echo "---- $part stderr"; cat "$err"; } >> "$OUT/log.txt"
  say "$part rc $rc$([ $rc = 124 ] || [ $rc = 137 ] && echo " (stopped at its $limit s)")"
  [ $rc = 0 ] || tail -n 5 "$err"
  rm -f "$err"
}

summary() {  # the figures that matter, readable in the call's output
  case $1 in
    check|mirrored) $PY -c "import json, sys
r = json.loads([line for line in open(sys.argv[1]) if line.startswith('{')][-1])
print(r.get('verdict'))
for m in r.get('matmul', []): print('  matmul', m['device'], m.get('math', m['dtype']), round(m['tflops'], 1), 'TFLOP/s')
s = r.get('fit_vs_loop') or {}
print('  fit vs loop', {k: s[k] for k in s if k != 'equal'})" "$OUT/${FILES[$1]}" 2> /dev/null ;;
    schedules)
      [ -d "$OUT/schedules" ] && tar czf "$OUT/schedules.tgz" -C "$OUT" schedules && rm -rf "$OUT/schedules" ;;
  esac
}

main() {
  T0=$(date +%s)
  plan
  if [ -n "${SITE:-}" ]; then
    export PYTHONPATH=$SITE:$PWD LD_LIBRARY_PATH=$SITE/cuda/lib:${LD_LIBRARY_PATH:-} PATH=$SITE/cuda/bin:$PATH
    export XLA_FLAGS="--xla_gpu_cuda_data_dir=$SITE/cuda ${XLA_FLAGS:-}"
  else
    export PYTHONPATH=$PWD
  fi
  export CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
  need_gpu
  local parts i part next later limit
  parts=($(selected))
  for i in "${!parts[@]}"; do
    part=${parts[$i]} later=0
    for next in "${parts[@]:$((i + 1))}"; do later=$((later + SHARE[$next])); done
    limit=$((T0 + BUDGET_S - $(date +%s) - later))
    if [ "$limit" -lt 20 ]; then say "$part skipped: $limit s left of its share"; continue; fi
    say "== $part (up to $limit s)"
    run_part "$part" "$limit"
    summary "$part"
  done
  say "done in $(($(date +%s) - T0)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
}

check_plan
if [ "$DRY" = 1 ]; then plan; exit 0; fi
mkdir -p "$OUT"
main 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
