#!/usr/bin/env bash
# The GPU session in one prepared script (run from the repository root on a CUDA machine; results go to $OUT):
#   1. training throughput at 224 px, bf16, the largest power-of-two batch that fits: MoCo v2 ResNet-50 and
#      MoCo v3 ViT-S (bench/train_throughput.py --max-batch), then ResNet-50 end to end through the real image
#      cache, loader and on-GPU augmentations (--data, 224 px generated images) next to compute-only;
#   2. learning curves (k-NN against minutes of --time-budget runs) of auto and paper recipes on the demo data
#      (bench/learning_curves.py), one run at a time;
#   3. meanwhile, a smoke run of the GPU code paths end to end: `moco train` with bf16 autocast and with
#      torch.compile, `moco export` (checked against ONNX Runtime), `moco eval knn` of the ONNX file and of the
#      checkpoint on the GPU.
# Every step has its own time limit, so one that hangs cannot take the rest down. QUICK=1 shrinks everything
# to run on a CPU in a minute (to check this script, not to measure).
set -u
OUT=${OUT:-/tmp/gpu_checks_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
LOG=$OUT/gpu_checks.log
if [ "${QUICK:-0}" = 1 ]; then
  DEV=cpu; TP="--image-size 32 --batch-size 8 --max-batch 16 --steps 1 --warmup 0 --device cpu --amp off"
  E2E="--image-size 32 --batch-size 16 --steps 2 --warmup 1 --device cpu --amp off"; E2E_PER_CLASS=8; E2E_SIZE=40
  LC="--recipes auto_v2 --budget 20s"; SMOKE_SIZE=32; SMOKE_EPOCHS=1
else
  DEV=cuda; TP="--image-size 224 --batch-size 512 --max-batch 8192 --steps 8 --warmup 2 --device cuda --amp on"
  E2E="--image-size 224 --batch-size 512 --steps 20 --warmup 3 --device cuda --amp on --workers 8"
  E2E_PER_CLASS=1000; E2E_SIZE=256
  LC="--recipes auto_v2 paper_v2 auto_v3 --budget 60s"; SMOKE_SIZE=64; SMOKE_EPOCHS=2
fi

step() {  # step NAME SECONDS CMD...: run with a time limit, log its outcome
  local name=$1 limit=$2; shift 2
  local tic=$SECONDS
  echo "=== $name: $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: exit $? after $((SECONDS - tic)) s" >>"$LOG"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch, torchvision, timm, onnxruntime as ort; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'onnxruntime', ort.__version__, 'cuda', torch.cuda.is_available())"
  nproc
} >>"$LOG" 2>&1

step throughput_r50_v2 170 $PY bench/train_throughput.py --moco-version 2 --arch resnet50 $TP --out "$OUT/train_throughput_r50_v2.json"
step throughput_vits_v3 170 $PY bench/train_throughput.py --moco-version 3 --arch vit_small $TP --out "$OUT/train_throughput_vits_v3.json"
step e2e_data 120 $PY -c "from moco_retrieval.trainer.demo_data import write_demo_dataset as w; w('/tmp/gpu_e2e_data', per_class=$E2E_PER_CLASS, size=$E2E_SIZE)"
step throughput_r50_v2_e2e 300 $PY bench/train_throughput.py --data /tmp/gpu_e2e_data --moco-version 2 --arch resnet50 $E2E \
  --out "$OUT/train_throughput_r50_v2_e2e.json"

SMOKE=/tmp/gpu_smoke
rm -rf "$SMOKE"
(
  step smoke_data 60 $PY -c "from moco_retrieval.trainer.demo_data import write_demo_dataset as w; w('$SMOKE/data', per_class=40, size=$SMOKE_SIZE)"
  step smoke_train_amp 120 $PY -m moco_retrieval train "$SMOKE/data" --out "$SMOKE/run" --moco-version 3 --arch resnet18 \
    --image-size $SMOKE_SIZE --batch-size 64 --epochs $SMOKE_EPOCHS --workers 2 --device $DEV
  step smoke_resume_noop 60 $PY -m moco_retrieval train "$SMOKE/data" --out "$SMOKE/run" --moco-version 3 --arch resnet18 \
    --image-size $SMOKE_SIZE --batch-size 64 --epochs $SMOKE_EPOCHS --workers 2 --device $DEV
  step smoke_export 120 $PY -m moco_retrieval export "$SMOKE/run" --out "$SMOKE/model.onnx"
  step smoke_eval_onnx 120 $PY -m moco_retrieval eval knn --train "$SMOKE/data" --test "$SMOKE/data" "$SMOKE/model.onnx"
  step smoke_eval_ckpt 120 $PY -m moco_retrieval eval knn --train "$SMOKE/data" --test "$SMOKE/data" "$SMOKE/run" --device $DEV
  step smoke_train_vit_compile 200 $PY -m moco_retrieval train "$SMOKE/data" --out "$SMOKE/run_vit" --moco-version 3 \
    --arch vit_tiny --image-size $SMOKE_SIZE --batch-size 64 --epochs 1 --workers 2 --device $DEV --compile
) &
SMOKE_PID=$!
step learning_curves 300 $PY bench/learning_curves.py --datasets demo $LC --extra=--device=$DEV \
  --work /tmp/gpu_curves --out "$OUT/learning_curves_gpu.json"
wait $SMOKE_PID
echo "=== done after $SECONDS s" >>"$LOG"
