# Stand-in for the `vllm` package inside the SGLang CPU engine venv.
#
# SGLang 0.5.23 imports `vllm._custom_ops.rotary_embedding` when it builds its
# rotary embedding on a non-CUDA platform, but never calls it on the CPU
# torch-native path. Without a module of that name the engine fails at start
# with "No module named 'vllm'". This stub is installed only into the engine
# venv by scripts/install-engine.sh, never into the workspace.
