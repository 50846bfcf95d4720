#!/bin/bash
# One call on a lent GPU machine (one GPU, 16 CPU cores, no package registry): the GPU
# checks on cores 0-3 and three gloo-rank jobs on the other twelve, each with its own
# time limit, together inside the device's 10 minutes a call. Results go to $OUT (or
# ./out/gpu-session); docs/BENCHMARKS.md says what each session found with it.
#
# Before the call, on the development machine (the device has torch but not ortools):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict==4.3.1 \
#     protobuf==6.33.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
#     referencing==0.37.0 rpds-py==2026.9.1
# then run `bash benchmarks/gpu_session.sh` there, carrying .whl.
#
# GPU (cores 0-3): single-GPU training throughput and memory peaks against the analytic
# price for the detected preset, the one-stage compiled step against eager, per-node
# profiles (summed against the plain step where kernels are short); then the peaks again with cuDNN's default algorithms (no benchmark trials, less workspace).
# CPU (one-thread gloo ranks, CUDA hidden):
#   cores 4-7:   four ranks, resnet18, M=4: the schedules auto chooses among, measured
#   cores 8-11:  four ranks against torch.distributed.pipelining's schedules
#   cores 12-15: four ranks, googlenet (held out), M=4
set -u
OUT=${OUT:-out/gpu-session}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
  --format=csv
python3 -c "import torch, ortools, crosscut; print(torch.__version__, torch.cuda.get_device_name(0))" \
  || exit 1
lscpu | grep -E "Model name|^CPU\(s\)"
cpu() {  # cores, time limit, output, command...
  local cores=$1 limit=$2 out=$3
  shift 3
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "$limit" taskset -c "$cores" python3 "$@" \
    > "$OUT/$out" 2>&1
}
L=${CPU_LIMIT:-400}
cpu 4-7 "$L" schedules-resnet18-4ranks.txt benchmarks/schedules.py --measure --ranks 4 \
  --model resnet18 --batch 16 --size 64 --microbatches 4 --cost profiled --rounds 3 \
  --schedules 1f1b,zb-h1,zb-h2,gpipe,1f1b-v2,zbv &
cpu 8-11 "$L" peers-resnet18-4ranks.txt benchmarks/distributed.py --ranks 4 --models resnet18 \
  --batch 16 --size 64 --microbatches 4 --schedule zbv --cost profiled --rounds 2 --peer \
  --peer-tries 2 --peer-schedule zbv,interleaved1f1b,1f1b &
cpu 12-15 "$L" schedules-googlenet-4ranks.txt benchmarks/schedules.py --measure --ranks 4 \
  --model googlenet --batch 16 --size 64 --microbatches 4 --cost profiled --rounds 3 \
  --schedules 1f1b,zb-h1,1f1b-v2,zbv &
timeout "${GPU_LIMIT:-270}" taskset -c 0-3 python3 benchmarks/gpu_check.py --out "$OUT/gpu" \
  --parts throughput,pipeline,profile \
  --profiles efficientnet_b0:fp16:nhwc:256,resnet50:fp16:nhwc:256,mobilenet_v2:fp16:nhwc:256 \
  > "$OUT/gpu_check.txt" 2>&1
echo "gpu_check exit $?"
rm -rf "$OUT/gpu/profiles"  # the per-node times are in gpu/gpu_check.json
timeout "${PEAK_LIMIT:-110}" taskset -c 0-3 python3 benchmarks/gpu_check.py --out "$OUT/peaks" \
  --parts throughput --no-cudnn-benchmark --throughput \
  resnet50:fp32:nchw:256,vgg16:fp32:nchw:64,efficientnet_b0:fp16:nhwc:256,mobilenet_v2:fp16:nhwc:256 \
  > "$OUT/gpu_check_peaks.txt" 2>&1
echo "gpu_check (default cuDNN algorithms) exit $?"
wait
grep -v "^\s*File\|^\s*\^" "$OUT/gpu_check.txt" | tail -30
tail -8 "$OUT/gpu_check_peaks.txt"
for f in schedules-resnet18-4ranks peers-resnet18-4ranks schedules-googlenet-4ranks; do
  echo "== $f"; grep -v "round [0-9]" "$OUT/$f.txt" | tail -14
done
