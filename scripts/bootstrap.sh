#!/usr/bin/env bash
# Make a fresh machine (Python 3.11 + pip only) ready: uv, the workspace venv,
# the CPU engines, SGLang and vLLM, the real instruct model SmolLM2-135M-Instruct and the
# coding-agent harnesses (Claude Code, Codex, OpenCode, mini-swe-agent; all cached outside
# the checkout). Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export UV_PYTHON_DOWNLOADS=never
# uv 0.13.9: the version uv.lock was written with.
UV_VERSION=0.13.9
if ! command -v uv >/dev/null || [ "$(uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3.11 -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
uv sync --locked --quiet
scripts/install-engine.sh sglang >/dev/null
scripts/install-engine.sh vllm >/dev/null
scripts/setup-model.sh smollm2 >/dev/null
# The coding-agent harnesses the harness tests run unmodified (npm and PyPI, pinned; cached).
scripts/install-harnesses.sh
# Headless Chromium for the browser tests of `areal inf trace --html` (tests/trace_browser.py
# drives it with Playwright; Debian's package, never a browser download). CI runs as root;
# elsewhere without root those tests skip, and this says how to get it.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "bootstrap: no /usr/bin/chromium (the trace page's browser tests skip); as root:" \
      "apt-get install --no-install-recommends chromium" >&2
  fi
fi
