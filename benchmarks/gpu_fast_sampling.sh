#!/usr/bin/env bash
# The GPU half of benchmarks/fast_sampling.py as one command for a lent GPU machine: the testbed models (the
# natural and anchored presets, MDLM and ADLM) train side by side on the card with --train-only, each stopped at
# LIMIT_S if unfinished (it checkpoints every 2,000 steps, and a rerun on the same machine resumes it), and are
# distilled there (SDTT, the preset's own models); then the whole work directory is packed under $OUT in parts
# under the device tool's 16 MiB a file (a larger file, or a ninth one, does not come back).
#
#   bash benchmarks/gpu_fast_sampling.sh [STEPS [LIMIT_S [KINDS [NETWORK [BATCH [PRESETS]]]]]]
#                                        # defaults: 18000 540 mdlm,adlm 128x2 256 natural,anchored
#
# NETWORK is WIDTHxBLOCKS, BATCH the training rows a step (--hidden, --blocks, --batch of fast_sampling.py; all
# part of the models' cache key, so the CPU half below names them too).
# Each process draws its rows ahead in loader processes (--loader-workers: the same rows, not in the key), the
# machine's cores shared out (16 cores: 3 each for four processes, 7 each for two): the natural preset's row
# sampler, not the card, is what a large BATCH waits on.
#
# The work directory stays on the machine (work/gpu_fast_sampling, git-ignored) while it is held: a second call
# resumes the unfinished models. Two processes of 18,000 steps of 256 rows take about 5-7 minutes on an H100 or
# H200, the SDTT rounds a few more: run one preset a call.
# Then, here (the CPU half, which times the samplers; the recipe's cache key leaves the device out):
#   cat fs.tgz.part.* | tar -xzf - -C /tmp && python benchmarks/fast_sampling.py --train-steps STEPS --hidden W --blocks B \
#       --batch BATCH --presets PRESET --distill-presets PRESET --workdir /tmp/fs --record
set -uo pipefail
STEPS=${1:-18000}
LIMIT_S=${2:-540}
KINDS=${3:-mdlm,adlm}
NETWORK=${4:-128x2}
[[ $NETWORK =~ ^([0-9]+)x([0-9]+)$ ]] || { echo "NETWORK $NETWORK: write WIDTHxBLOCKS, e.g. 256x4" >&2; exit 2; }
HIDDEN=${BASH_REMATCH[1]}
BLOCKS=${BASH_REMATCH[2]}
BATCH=${5:-256}
PRESETS=${6:-natural,anchored}
DEVICE=${ADLM_FS_DEVICE:-cuda}   # cpu: a dry run of this script on a machine without a GPU (tiny STEPS)
OUT=${OUT:?set OUT to the folder whose files come back (the device tool sets it)}
WORK=work/gpu_fast_sampling
mkdir -p "$WORK/fs" "$OUT"
n_procs=$(( $(wc -w <<<"${PRESETS//,/ }") * $(wc -w <<<"${KINDS//,/ }") ))
LOADERS=$(( ($(nproc) - n_procs) / n_procs ))
(( LOADERS >= 1 )) || LOADERS=1
pids=()
for preset in ${PRESETS//,/ }; do
  for kind in ${KINDS//,/ }; do
    timeout "$LIMIT_S" python3 benchmarks/fast_sampling.py --train-only --train-device "$DEVICE" \
      --train-steps "$STEPS" --checkpoint-every 2000 --presets "$preset" --distill-presets "$preset" --kinds "$kind" \
      --workdir "$WORK/fs" \
      --hidden "$HIDDEN" --blocks "$BLOCKS" --batch "$BATCH" --loader-workers "$LOADERS" \
      > "$OUT/fs_${preset}_${kind}.log" 2>&1 &
    pids+=($!)
  done
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?   # 124: stopped at LIMIT_S (resumable); other codes: see the process's log
done
# in parts of 15 MiB: the device tool drops any file over 16 MiB (two natural models and their eight SDTT students
# make about 28 MB)
tar -C "$WORK" -czf - fs | split -b 15M - "$OUT/fs.tgz.part."
echo "packed $(cat "$OUT"/fs.tgz.part.* | wc -c) bytes into $(ls "$OUT"/fs.tgz.part.* | wc -l) part(s) under $OUT; last exit status $status"
tail -n 3 "$OUT"/fs_*.log
