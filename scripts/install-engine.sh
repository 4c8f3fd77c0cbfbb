#!/usr/bin/env bash
# Install a CPU engine into its own venv, cached outside the checkout.
#
#   scripts/install-engine.sh [sglang]      (default: sglang)
#
# The venv lives at $AREAL_ENGINES_DIR/<engine>-<version> (default
# ~/.cache/areal/engines). A marker written last makes a second run a no-op,
# so CI and later sessions on the same machine pay the install once.
# Prints the engine's python path on its last line.
set -euo pipefail

engine=${1:-sglang}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engines_dir=${AREAL_ENGINES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/areal/engines}
export UV_PYTHON_DOWNLOADS=never

case "$engine" in
  sglang)
    # 0.5.23 is pinned because the CPU stub below relies on an internal import
    # of this exact release (engines-on-cpu.md).
    version=0.5.23
    # torch 2.14.1 + torchvision 0.29.1: the pair sglang 0.5.23 requires that
    # also imports on the CPU. The rest is sglang's own requirement list minus
    # the CUDA-only packages (kernels, flashinfer, cutlass, deep-ep, ...).
    reqs=(
      torch==2.14.1 torchvision==0.29.1
      aiohttp 'anthropic>=0.20.0' blobfile==3.0.0 build compressed-tensors==0.18.0
      datasets distro easydict einops fastapi gguf interegular IPython
      'llguidance<2.0.0,>=1.7.6' 'mistral_common>=1.11.5' modelscope msgspec ninja
      numba==0.65.1 numpy openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11
      packaging partial_json_parser pillow 'prometheus-client>=0.20.0' psutil py-spy
      pybase64 pydantic 'python-dateutil<3' python-multipart 'pyzmq>=25.1.2' regex
      requests scipy sentencepiece==0.2.1 setproctitle 'smg-grpc-servicer>=0.9.0'
      soundfile==0.13.1 tiktoken timm==1.0.25 tokenizers==0.23.2 tqdm
      transformers==5.19.0 'uvicorn>=0.51' uvloop watchfiles xgrammar==0.2.7 xxhash
      zstandard
    )
    ;;
  *)
    echo "install-engine: unknown engine '$engine' (known: sglang)" >&2
    exit 2
    ;;
esac

venv="$engines_dir/$engine-$version"
marker="$venv/.areal-engine-ok"
stamp="$engine==$version $(printf '%s\n' "${reqs[@]}" | sha256sum | cut -c1-16) $(sha256sum "$here"/engines/sglang-cpu-stub/vllm/*.py | sha256sum | cut -c1-16)"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ] && "$venv/bin/python" -c 'import sglang' 2>/dev/null; then
  echo "install-engine: $engine $version already installed at $venv" >&2
  echo "$venv/bin/python"
  exit 0
fi

command -v uv >/dev/null || { echo "install-engine: uv is missing; run scripts/bootstrap.sh first" >&2; exit 1; }

start=$(date +%s)
echo "install-engine: installing $engine $version into $venv (several minutes, once)" >&2
rm -rf "$venv"
mkdir -p "$engines_dir"
uv venv --quiet --python python3.11 "$venv"
uv pip install --quiet --python "$venv/bin/python" "${reqs[@]}"
uv pip install --quiet --python "$venv/bin/python" --no-deps "$engine==$version"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r "$here/engines/sglang-cpu-stub/vllm" "$site/"
"$venv/bin/python" -c 'import sglang, torch, vllm._custom_ops; print("sglang", sglang.__version__, "torch", torch.__version__)' >&2
echo "$stamp" > "$marker"
echo "install-engine: done in $(( $(date +%s) - start ))s, venv $(du -sh "$venv" | cut -f1)" >&2
echo "$venv/bin/python"
