#!/usr/bin/env bash
# The whole check, as CI runs it: set-up, lint, types, proto drift, each
# package's unit tests against its own dependencies, then the e2e suites with
# a real SGLang engine on the CPU. Prints how long each stage took.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export UV_PYTHON_DOWNLOADS=never

declare -a timings=()
total_start=$(date +%s)
stage() {
  local name=$1; shift
  local t0; t0=$(date +%s)
  echo "=== stage: $name"
  "$@"
  local dt=$(( $(date +%s) - t0 ))
  timings+=("$(printf '%-28s %5ss' "$name" "$dt")")
  echo "=== stage: $name done in ${dt}s"
}

packages=(areal-proto areal-runtime areal-cli areal-router areal-proxy areal-gateway areal-agent-worker areal-agent-proxy areal-train areal-client)

unit_tests() {
  for pkg in "${packages[@]}"; do
    echo "--- $pkg (its own dependencies only)"
    # A venv per package, so each suite sees only what its package declares.
    UV_PROJECT_ENVIRONMENT=".venv-isolated/$pkg" uv run --quiet --exact --package "$pkg" \
      pytest -q -p no:cacheprovider "packages/$pkg/tests"
  done
}

stage "bootstrap (uv, venv, engine)" scripts/bootstrap.sh
stage "ruff" bash -c "uv run --quiet ruff check . && uv run --quiet ruff format --check ."
stage "mypy (package code)" uv run --quiet mypy packages/*/src
stage "proto drift" uv run --quiet python scripts/gen_proto.py --check
stage "sync client drift" uv run --quiet python scripts/gen_sync_client.py --check
stage "dependencies (deptry)" uv run --quiet python scripts/check_deps.py
# Each package's modules in layers, imports one way (importlinter.toml), and the size rule
# (scripts/check_sizes.py: modules <= 500 lines, classes <= 300, or allow-listed with a reason).
stage "layers (import-linter)" uv run --quiet lint-imports importlinter.toml --no-cache
stage "sizes" uv run --quiet python scripts/check_sizes.py
stage "unit tests" unit_tests
# One engine at a time: the SGLang session engine and vLLM would share 2 cores and 6.5 GB.
# The real model's suites (its engine, shared by the first three files; a fresh set-up; a
# 2-step GRPO smoke run) run in a stage of their own, last.
real_model_tests=(
  tests/e2e/test_real_model.py tests/e2e/test_real_model_agents.py
  tests/e2e/test_real_model_long_sessions.py tests/e2e/test_setup_model.py
  tests/train/test_smol_grpo.py tests/train/test_smol_async.py tests/harness/test_harnesses_smol.py
)
# --durations: the slowest tests of each e2e stage, to keep the whole run under 45 minutes.
# AREAL_TEST_REQUIRE_HARNESSES: bootstrap installed the harnesses; their tests must not skip.
stage "e2e tests (SGLang engine)" env AREAL_TEST_REQUIRE_HARNESSES=1 uv run --quiet pytest -q -p no:cacheprovider --durations=12 tests \
  --ignore=tests/e2e/test_vllm_engine.py --ignore=tests/cluster "${real_model_tests[@]/#/--ignore=}"
# A real two-node Ray cluster on this machine (one network + pid namespace per node, root
# needed): --scheduler ray for inf and agent services, node loss, TLS (docs/cluster.md).
stage "e2e tests (Ray cluster)" env AREAL_TEST_REQUIRE_RAY=1 \
  uv run --quiet pytest -q -p no:cacheprovider --durations=8 tests/cluster
stage "e2e tests (vLLM engine)" env AREAL_TEST_REQUIRE_VLLM=1 \
  uv run --quiet pytest -q -p no:cacheprovider tests/e2e/test_vllm_engine.py
stage "e2e tests (SmolLM2 engine)" env AREAL_TEST_REQUIRE_REAL_MODEL=1 AREAL_TEST_REQUIRE_HARNESSES=1 \
  uv run --quiet pytest -q -p no:cacheprovider "${real_model_tests[@]}"

echo
echo "stage timings:"
printf '  %s\n' "${timings[@]}"
echo "  total                        $(( $(date +%s) - total_start ))s"
