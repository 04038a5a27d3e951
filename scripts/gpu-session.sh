#!/usr/bin/env bash
# One device call on a lent GPU, in the order that matters when its minutes are counted:
# `grpo-cli check --device cuda` in f32, bf16 and f16, then scripts/bench-gpu-vs-trl.sh under a
# time budget (our runs with GRPO_MEMLOG=1, so each run's log says which phase holds memory),
# then `bench-model` on the 0.77B model beside torch if time is left. Everything lands under
# $OUT (res.tgz: logs, nvidia-smi timelines, tables; table.md), packed every 20 s so that a
# call cut at its limit still returns what it had.
#
#   bash scripts/gpu-session.sh          (from the project root, with .gpu/ from scripts/build-cuda.sh
#                                         and TRL's wheels in .gpu/whl/ for the TRL side)
#   END=555 ROWS=name,name SIDES=both|ours|trl STEPS=3 SPEED=1 OVERLAP=1|name,name
#   OPTIM8=name,name PROFILE=1|decode|both MLA=1
#   (environment knobs; OVERLAP=1 adds our runs at max_staleness 1, OVERLAP=name,name on those
#   workloads only; OPTIM8 our runs with
#   checkpointing and the 8-bit AdamW on the workloads named; PROFILE=1 ends with Nsight
#   Compute's kernel times of one learner forward + backward on the 0.77B model, summed by
#   kernel name; PROFILE=decode those of a few eager decode steps at 128 rows, per step;
#   PROFILE=both both; MLA=1 times DeepSeek's latent KV cache against each head's keys and
#   values on a GLM-4.7-Flash-shaped model, bf16, 32 rows after a 1,024-token prompt)
set -u
T0=$SECONDS
END=${END:-555}
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_CACHE_MAXSIZE=4294967296
R=/tmp/res; mkdir -p $R/models
pack() { (cd /tmp && tar czf "$OUT/res.tgz" --exclude=res/models res) 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/gpu.txt
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
PY=$(command -v python3); export PYTHON=$PY
for m in "m29 512 8 8 4 8192" "m319 1024 24 16 8 16384" "m770 1536 28 12 2 16384"; do
  set -- $m
  $PY .gpu/make_tiny_model.py $R/models/$1 --hidden $2 --layers $3 --heads $4 --kv-heads $5 \
    --vocab $6 > $R/models-$1.log 2>&1 &
done
for dt in f32 bf16 f16; do
  timeout 100 bash .gpu/run-gpu.sh check --device cuda --dtype $dt > $R/check-$dt.txt 2>&1
  echo "== check $dt rc=$? at $((SECONDS-T0))s"
  grep -E -i "passed|FAIL|switch|error|panick" $R/check-$dt.txt | head -20
done
pack
wait; echo "models done at $((SECONDS-T0))s"
# In priority order (the budget cuts the last): the small full fine-tunes (memory against
# TRL's), the big rows (step time), then the rest.
ROWS=${ROWS:-319M-f32-4x8x64,319M-bf16-4x8x64,0.77B-bf16-8x16x256-mb32,319M-bf16-8x16x256-mb32,0.77B-bf16-lora16-8x16x256-mb32,29M-f32-4x8x64,319M-bf16-lora16-4x8x64}
PROFILE=${PROFILE:-0}
case "$PROFILE" in 1) PROF_S=150 ;; decode) PROF_S=100 ;; both) PROF_S=250 ;; *) PROF_S=0 ;; esac
left=$((END - (SECONDS - T0) - ${SPEED:-0} * 120 - PROF_S - ${MLA:-0} * 150))
GRPO_MEMLOG=1 GPU_DIR=$PWD/.gpu bash scripts/bench-gpu-vs-trl.sh --steps ${STEPS:-3} --rows $ROWS \
  --budget $left --sides ${SIDES:-both} $(case "${OVERLAP:-0}" in 0) ;; 1) echo --overlap ;;
    *) echo --overlap-rows "$OVERLAP" ;; esac) \
  $([ -n "${OPTIM8:-}" ] && echo --optim8 "$OPTIM8") --out $R 2>&1 \
  | tee $R/bench.txt &
BPID=$!
while kill -0 $BPID 2>/dev/null; do sleep 20; pack; done
if [ "${SPEED:-0}" = 1 ]; then
  M=$R/models/m770
  for b in 128 8; do
    timeout 60 bash .gpu/run-gpu.sh bench-model --model $M --device cuda --dtype bf16 --batch $b \
      --new-tokens 256 --prompt-len 64 --seq-len 320 --reps 2 2>&1 | tail -1 | tee $R/bench-model-$b.json
  done
  # The learner by variants (no profiler needed): without layer blocks (the default tapes
  # each layer: this is the plain graph), with the driver's pool releasing its free memory at
  # every synchronisation (the default keeps it); each line's bwd_issue_s_median beside
  # bwd_s_median says launch- or device-bound. (GRPO_CUDA_KERNELS=-flash_attention: without
  # the flash kernels, measured in attempts 7 and 17.)
  for v in GRPO_LAYER_SEGMENTS=0 GRPO_CUDA_POOL=sync; do
    env $v timeout 40 bash .gpu/run-gpu.sh bench-model --model $M --device cuda --dtype bf16 \
      --phase fwd-bwd --batch 32 --seq-len 320 --reps 2 2>&1 | tail -1 | tee $R/bench-model-$v.json
  done
fi
if [ "${MLA:-0}" = 1 ]; then
  $PY .gpu/make_mla_model.py $R/models/mla --tokenizer $R/models/m29 > $R/models-mla.log 2>&1
  for form in latent heads; do
    GRPO_MLA_CACHE=$form timeout 60 bash .gpu/run-gpu.sh bench-model --model $R/models/mla \
      --device cuda --dtype bf16 --phase generate --batch 32 --new-tokens 64 --prompt-len 1024 \
      --reps 2 2>&1 | tail -1 | tee $R/bench-mla-$form.json
  done
  pack
fi
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
if [ "$PROFILE" = decode ] || [ "$PROFILE" = both ]; then
  if [ -n "$ncu" ]; then
    # Eager steps (graphs off: the same kernels, each one timed); the bench line gives the wall.
    GRPO_CUDA_GRAPHS=0 timeout 95 "$ncu" --target-processes all --clock-control none \
      --metrics gpu__time_duration.sum --csv bash .gpu/run-gpu.sh bench-model \
      --model $R/models/m770 --phase generate --reps 1 --batch 128 --new-tokens 8 \
      --prompt-len 64 --seq-len 320 --device cuda --dtype bf16 > $R/ncu-decode.csv 2> $R/ncu-decode.err
    echo "== ncu decode rc=$? at $((SECONDS-T0))s"
    $PY scripts/ncu_summary.py $R/ncu-decode.csv decode $R/bench-model-128.json 2>&1 \
      | tee $R/ncu-decode.md | head -20
  else
    echo "== ncu not found"
  fi
fi
if [ "$PROFILE" = 1 ] || [ "$PROFILE" = both ]; then
  if [ -n "$ncu" ]; then
    timeout 140 "$ncu" --target-processes all --clock-control none --metrics gpu__time_duration.sum --csv \
      bash .gpu/run-gpu.sh bench-model --model $R/models/m770 --phase fwd-bwd --reps 1 --batch 8 \
      --seq-len 320 --device cuda --dtype bf16 > $R/ncu-learner.csv 2> $R/ncu-learner.err
    echo "== ncu rc=$? at $((SECONDS-T0))s"
    $PY scripts/ncu_summary.py $R/ncu-learner.csv learner 2>&1 | tee $R/ncu-learner.md | head -40
  else
    echo "== ncu not found"
  fi
fi
pack; cp $R/table.md "$OUT/" 2>/dev/null
echo "== done at $((SECONDS-T0))s"
