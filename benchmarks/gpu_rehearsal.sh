#!/usr/bin/env bash
# The GPU checks, within 8 minutes on one GPU; run it whenever a GPU is at hand:
#
#   bash benchmarks/gpu_rehearsal.sh          # writes benchmarks/gpu_rehearsal.md
#   bash benchmarks/gpu_rehearsal.sh --cpu    # the same steps with a small model on the CPU
#
# 1. The Turing-NLG 17B rehearsal (launch.rehearse) of rank 0 of 256 at the preset's layout
#    (ZeRO-2, SP, full recomputation, all 8 micro-batches) and of rank 255 at ZeRO-3 with
#    selective recomputation: memory by category against the planner, and the CUDA
#    allocator's peak beside MemTracker's.
# 2. The 1.5B MFU measurement of benchmarks/compare/gpu.py (ours and plain PyTorch, with
#    and without recomputation, at the largest micro-batch that fits).
# 3. A short bf16 pretraining run of gpt2-124m on the bundled corpus (launch.pretrain): the
#    MFU and the CUDA allocator's peak that the run itself logs (metrics.jsonl, summary).
# Each step has its own time limit, so one that hangs cannot take the others' time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/$([[ "${1:-}" == "--cpu" ]] && echo gpu/gpu_rehearsal_cpu || echo gpu_rehearsal).md}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [[ "${1:-}" == "--cpu" ]]; then
  rehearsals=(
    "--config tiny --world 4 parallel.tp=2"
    "--config tiny --world 4 --rank 3 parallel.tp=2 parallel.zero_stage=3 parallel.recompute=selective"
  )
  section=(--gpu-device cpu --gpu-model tiny --gpu-micro-batches 1 2 --gpu-steps 2)
  # No peak is known on the CPU: one given, so that the MFU columns show.
  pretrain="--config configs/tiny.yaml train.steps=6 train.eval_every=6 train.peak_tflops=1"
  limit=120
else
  rehearsals=(
    "--config turing-nlg-17b --world 256"
    "--config turing-nlg-17b --world 256 --rank 255 parallel.zero_stage=3 parallel.recompute=selective"
  )
  section=(--gpu-micro-batches 1 2 4 8 16 --gpu-steps 5)
  pretrain="--config configs/gpt2-124m.yaml train.steps=30 train.global_batch_size=8 train.micro_batch_size=8 train.warmup_steps=5 train.eval_every=30 train.eval_batches=2"
  limit=150
fi

{
  echo "# GPU checks: \`bash benchmarks/gpu_rehearsal.sh $*\`"
  echo
  echo "$(date -u +%F) on $($PY -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU")')"
  echo
} > "$OUT"
for i in "${!rehearsals[@]}"; do
  # shellcheck disable=SC2086
  if timeout "$limit" $PY -m launch.rehearse ${rehearsals[$i]} --json "$tmp/$i.json" > "$tmp/$i.txt" 2>&1; then
    { echo "## python -m launch.rehearse ${rehearsals[$i]}"; echo; echo '```'; cat "$tmp/$i.txt"; echo '```'; echo; } >> "$OUT"
  else
    { echo "## python -m launch.rehearse ${rehearsals[$i]}: failed"; echo; echo '```'; tail -5 "$tmp/$i.txt"; echo '```'; echo; } >> "$OUT"
  fi
done
{ echo "## benchmarks/gpu/gpu_section.py ${section[*]}"; echo; } >> "$OUT"
timeout 240 $PY benchmarks/gpu/gpu_section.py "${section[@]}" --out "$tmp/section.md" > "$tmp/section.log" 2>&1 \
  && cat "$tmp/section.md" >> "$OUT" || { echo "failed:"; tail -5 "$tmp/section.log"; } >> "$OUT"
# shellcheck disable=SC2086
if timeout "$limit" $PY -m launch.pretrain $pretrain run_dir="$tmp/run" tracking.wandb.mode=disabled sample.tokens=0 > "$tmp/pretrain.txt" 2>&1; then
  {
    echo "## python -m launch.pretrain $pretrain"
    echo
    echo "The last step's metrics.jsonl record, and the run's summary:"
    echo
    echo '```'
    grep '"loss"' "$tmp/run/metrics.jsonl" | tail -1
    tail -3 "$tmp/pretrain.txt"
    echo '```'
  } >> "$OUT"
else
  { echo "## python -m launch.pretrain $pretrain: failed"; echo; echo '```'; tail -5 "$tmp/pretrain.txt"; echo '```'; } >> "$OUT"
fi
echo "written $OUT"
