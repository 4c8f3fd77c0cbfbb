"""The one symbol SGLang 0.5.23 imports from vllm on the CPU path (see __init__)."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError(
        "vllm._custom_ops.rotary_embedding is a stub installed by areal for the "
        "SGLang CPU engine; a real vLLM build is required for this code path"
    )
