#!/usr/bin/env bash
# The GPU session in one prepared script (run from the repository root on a CUDA machine; results go to $OUT).
# Issue 25's figures, most wanted first, each step with its own time limit and none started past $DEADLINE
# seconds, so the whole script fits one device call:
#   1. MoCo v2 ResNet-50, 224 px, bf16, compute only (bench/train_throughput.py): the batch sweep (512 / 1024 /
#      2048), the split-BN groups against plain BN (--bn-splits 1, the ceiling), and, when BEFORE_TREE names a
#      checkout of the code before a change, the same step measured there (before / after in one session);
#   2. MoCo v3 ViT-S/16, 224 px, bf16, compute only, batch 512 / 1024;
#   3. ResNet-50 end to end through the real image cache, loader and on-GPU augmentations (--data: generated
#      224-px images) next to compute only;
#      and where its time goes (--phases: waiting for the batch, the copy, the augmentations, the step);
#   4. torch.compile of both (--compile), whose compile time is paid once per run.
# E2E_ONLY=1 runs step 3 alone.
# QUICK=1 shrinks everything to run on a CPU in a minute or two (to check this script, not to measure).
set -u
OUT=${OUT:-/tmp/gpu_checks_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
LOG=$OUT/gpu_checks.log
DEADLINE=${DEADLINE:-540}
ROOT=$PWD
if [ "${QUICK:-0}" = 1 ]; then
  B1=16; B2=32; B3=64; V1=16; V2=32; PER_CLASS=8; DATA_SIZE=40
  COMMON="--image-size 32 --steps 1 --warmup 1 --device cpu --amp on"; WORKERS=2
else
  B1=512; B2=1024; B3=2048; V1=512; V2=1024; PER_CLASS=1000; DATA_SIZE=256
  COMMON="--image-size 224 --steps 10 --warmup 3 --device cuda --amp on"; WORKERS=12
fi

step() {  # step NAME SECONDS CMD...: run with a time limit (cut to what is left before DEADLINE), log the outcome
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, $left s left before the deadline" >>"$LOG"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local tic=$SECONDS
  echo "=== $name (limit $limit s): $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: exit $? after $((SECONDS - tic)) s" >>"$LOG"
}

shim() {  # shim TREE: print a folder that holds TREE's code as an installed moco_retrieval would lay it out
  # (pyproject's package-dir mapping, as links) beside a copy of its bench scripts, which put their own parent
  # first on sys.path: two checkouts measured in one session, neither installed
  local dir
  dir=$(mktemp -d)
  mkdir "$dir/moco_retrieval" "$dir/bench"
  ln -s "$1"/moco_retrieval/*.py "$dir/moco_retrieval/"
  for part in contracts trainer indexer serve app; do ln -s "$1/$part" "$dir/moco_retrieval/$part"; done
  cp "$1"/bench/*.py "$dir/bench/"
  echo "$dir"
}
SHIM=$(shim "$ROOT")
[ -n "${BEFORE_TREE:-}" ] && BEFORE_SHIM=$(shim "$BEFORE_TREE")

tp() {  # tp NAME SECONDS SHIM ARGS...: bench/train_throughput.py of the code in SHIM, JSON to $OUT/NAME.json
  local name=$1 limit=$2 path=$3; shift 3
  step "$name" "$limit" env PYTHONPATH="$path" "$PY" "$path/bench/train_throughput.py" $COMMON "$@" --out "$OUT/$name.json"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  PYTHONPATH=$SHIM $PY -P -c "import moco_retrieval.trainer as t; print('moco_retrieval.trainer from', t.__path__)"
  PYTHONPATH=$SHIM $PY -P -c "import torch, torchvision, timm, onnxruntime as ort; from timm.layers import use_fused_attn; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'fused attention', use_fused_attn(), 'onnxruntime', ort.__version__, ort.get_available_providers(), 'cuda', torch.cuda.is_available())"
  nproc
} >>"$LOG" 2>&1

R50="--moco-version 2 --arch resnet50"
VITS="--moco-version 3 --arch vit_small"
if [ "${E2E_ONLY:-0}" != 1 ]; then
[ -n "${BEFORE_TREE:-}" ] && tp r50_v2_b$B2.before 90 "$BEFORE_SHIM" $R50 --batch-size $B2
tp r50_v2_b$B2 90 "$SHIM" $R50 --batch-size $B2
tp r50_v2_b$B2.plain_bn 90 "$SHIM" $R50 --batch-size $B2 --bn-splits 1
tp r50_v2_b$B1 90 "$SHIM" $R50 --batch-size $B1
tp r50_v2_b$B3 90 "$SHIM" $R50 --batch-size $B3
[ -n "${BEFORE_TREE:-}" ] && tp r50_v2_b$B3.before 90 "$BEFORE_SHIM" $R50 --batch-size $B3
tp vits_v3_b$V1 90 "$SHIM" $VITS --batch-size $V1
tp vits_v3_b$V2 90 "$SHIM" $VITS --batch-size $V2
fi

DATA=/tmp/gpu_e2e_data
step e2e_data 90 env PYTHONPATH="$SHIM" "$PY" -P -c "import multiprocessing as mp
from moco_retrieval.trainer.demo_data import CLASSES, write_demo_dataset
with mp.Pool(len(CLASSES)) as pool:  # one process per class
    pool.starmap(write_demo_dataset, [('$DATA', $PER_CLASS, $DATA_SIZE, 0, (c,)) for c in CLASSES])"
tp r50_v2_b$B2.e2e 180 "$SHIM" $R50 --batch-size $B2 --data "$DATA" --workers $WORKERS --phases
[ "${E2E_ONLY:-0}" = 1 ] && DEADLINE=0
tp r50_v2_b$B2.compile 200 "$SHIM" $R50 --batch-size $B2 --compile
tp vits_v3_b$V2.compile 200 "$SHIM" $VITS --batch-size $V2 --compile
echo "=== done after $SECONDS s" >>"$LOG"
# Only a few files come back from a device call: every result in one JSON, and one line per result on stdout.
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
merged = {}
for path in sorted(out.glob("*.json")):
    if path.name == "gpu_checks.json":
        continue
    merged[path.stem] = json.loads(path.read_text())
    for row in merged[path.stem]["results"]:
        print(f"{path.stem:28s} {row['mode']:10s} batch {row['batch_size']:5d} bn_splits {row.get('bn_splits')} "
              f"compile {row['compile']}: {row['images_per_s']:8.1f} images/s, peak {row['peak_gpu_memory_gib']} GiB",
              {k: v for k, v in row.items() if k.endswith("_ms")} or "")
    path.unlink()
(out / "gpu_checks.json").write_text(json.dumps(merged, indent=1) + "\n")
PY
grep "^===" "$LOG"
