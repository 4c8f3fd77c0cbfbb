#!/usr/bin/env bash
# Install the coding-agent harnesses the harness tests run unmodified (tests/harness), at
# pinned versions, cached outside the checkout like the engine venvs:
#
#   scripts/install-harnesses.sh            install what is missing; prints nothing when cached
#   scripts/install-harnesses.sh --where    print `name=path` of each harness's executable
#                                           (exit 1, saying what to run, if not installed)
#
# npm packages go into $AREAL_HARNESSES_DIR/npm-<hash of the pins> (default
# ~/.cache/areal/harnesses), mini-swe-agent into its own venv beside them. A marker written
# last makes a second run a no-op; a change of pin is a new folder.
set -euo pipefail

dir=${AREAL_HARNESSES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/areal/harnesses}
export UV_PYTHON_DOWNLOADS=never

# The releases docs/harnesses.md's before-and-after table was measured with and the
# harness tests were written against: a new release sends new fields, so a pin moves with a run of
# those tests.
npm_pins=(
  # Claude Code 2.1.332: /v1/messages, streamed; its first prompt is ~17k SmolLM2 tokens.
  "@anthropic-ai/claude-code@2.1.332"
  # Codex CLI 0.171.0: speaks only /v1/responses (no chat completions), streamed.
  "@openai/codex@0.171.0"
  # OpenCode 1.18.33: chat completions through its bundled OpenAI-compatible provider.
  "opencode-ai@1.18.33"
)
# mini-swe-agent 2.4.6: its default config calls a `bash` tool over litellm chat completions.
# litellm 1.110.2 pinned with it: mini-swe-agent takes any litellm, and litellm's releases
# change what it sends (and what it reads from the network at import).
mini_pins=("mini-swe-agent==2.4.6" "litellm==1.110.2")

npm_hash=$(printf '%s\n' "${npm_pins[@]}" | sha256sum | cut -c1-12)
mini_hash=$(printf '%s\n' "${mini_pins[@]}" | sha256sum | cut -c1-12)
npm_dir="$dir/npm-$npm_hash"
mini_dir="$dir/mini-swe-agent-$mini_hash"
npm_ok="$npm_dir/.areal-harness-ok"
mini_ok="$mini_dir/.areal-harness-ok"

if [ "${1:-}" = "--where" ]; then
  if [ ! -f "$npm_ok" ] || [ ! -f "$mini_ok" ]; then
    echo "install-harnesses: not installed; run scripts/install-harnesses.sh" >&2
    exit 1
  fi
  echo "claude=$npm_dir/node_modules/.bin/claude"
  echo "codex=$npm_dir/node_modules/.bin/codex"
  echo "opencode=$npm_dir/node_modules/.bin/opencode"
  echo "mini=$mini_dir/bin/mini"
  exit 0
fi

mkdir -p "$dir"
if [ ! -f "$npm_ok" ]; then
  command -v npm >/dev/null || { echo "install-harnesses: npm is missing (Debian: apt-get install nodejs npm)" >&2; exit 1; }
  start=$(date +%s)
  rm -rf "$npm_dir"
  # Install scripts run: they only link each package's native binary from its platform
  # package (an optional dependency), they download nothing.
  npm install --prefix "$npm_dir" --no-audit --no-fund --save-exact --loglevel=error \
    "${npm_pins[@]}" >/dev/null
  for bin in claude codex opencode; do
    "$npm_dir/node_modules/.bin/$bin" --version >/dev/null
  done
  echo "${npm_pins[*]}" > "$npm_ok"
  echo "install-harnesses: npm harnesses in $(( $(date +%s) - start ))s at $npm_dir" >&2
fi
if [ ! -f "$mini_ok" ]; then
  command -v uv >/dev/null || { echo "install-harnesses: uv is missing; run scripts/bootstrap.sh first" >&2; exit 1; }
  start=$(date +%s)
  rm -rf "$mini_dir"
  uv venv --quiet --python python3.11 "$mini_dir"
  uv pip install --quiet --python "$mini_dir/bin/python" "${mini_pins[@]}"
  # litellm reads its price list from the network unless told to use its bundled copy.
  LITELLM_LOCAL_MODEL_COST_MAP=True "$mini_dir/bin/python" -c 'import minisweagent, litellm' >/dev/null
  echo "${mini_pins[*]}" > "$mini_ok"
  echo "install-harnesses: mini-swe-agent in $(( $(date +%s) - start ))s at $mini_dir" >&2
fi
