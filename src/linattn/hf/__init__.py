"""Hugging Face ``transformers`` integration of linattn language models.

Importing ``linattn.hf`` registers ``model_type="linattn"`` with ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM`` (no ``trust_remote_code`` needed)::

    import linattn.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("runs/demo-hf")
    tokenizer = AutoTokenizer.from_pretrained("runs/demo-hf")

``linattn export --ckpt RUN --out DIR`` writes such a directory from a training run.
"""

import sys

from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from ..models import LM
from ..nn import VectorQuantizer
from .cache import LinattnCache, RowGroup
from .config import LinattnConfig
from .export import export_run, save_pretrained_lm
from .modeling import LinattnForCausalLM, LinattnModel, causal_lm_loss, lm_state_of
from .tokenizer import LinattnByteTokenizer, LinattnTokenizer, byte_tokenizer


class CodebookUpdateCallback(TrainerCallback):
    """HF ``Trainer`` callback: the EMA codebook update of a linattn model's VQ layers after
    every optimizer step (what linattn's own trainer does). The model may be wrapped (a PEFT
    ``PeftModel``, DDP, ...): every linattn ``LM`` among its modules is updated.

    Under a PEFT adapter the codebooks belong to the adapter: its ``modules_to_save`` must hold
    the quantizers (``LoraConfig(..., modules_to_save=["quantizer"])``), so the adapter trains
    and saves its own copy of them and the base model stays as it was. A model whose adapter
    does not carry them is refused (a ValueError naming each quantizer) at the start of
    training, before any step: their update would change the frozen base model in place, and
    the saved adapter, loaded on a fresh base model, would not reproduce the trained model."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_adapter_carries_codebooks(model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        _check_adapter_carries_codebooks(model)
        for lm in _linattn_lms(model):
            lm.update_codebooks()
        return control


def _linattn_lms(model) -> list[LM]:
    """The linattn ``LM``s inside ``model``, however wrapped (none for anything else)."""
    if not isinstance(model, nn.Module):
        return []
    return [module for module in model.modules() if isinstance(module, LM)]


def _check_adapter_carries_codebooks(model) -> None:
    """ValueError naming the VQ quantizers of ``model`` that a PEFT adapter in it does not
    carry: with a PEFT model or tuner layer among its modules, every quantizer outside a
    ``modules_to_save`` wrapper (the wrapper holds the frozen original and the adapter's copy)."""
    peft = sys.modules.get("peft")  # a model holds PEFT modules only once peft is imported
    if peft is None or not isinstance(model, nn.Module):
        return
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    modules = dict(model.named_modules())
    if not any(isinstance(module, (peft.PeftModel, BaseTunerLayer)) for module in modules.values()):
        return
    wrappers = tuple(f"{name}." for name, module in modules.items() if isinstance(module, ModulesToSaveWrapper))
    uncarried = [name for name, module in modules.items()
                 if isinstance(module, VectorQuantizer) and not name.startswith(wrappers)]
    if uncarried:
        raise ValueError(f"CodebookUpdateCallback: the PEFT adapter does not carry the VQ codebooks of "
                         f"{', '.join(uncarried)}: they are buffers of the frozen base model, so their EMA update "
                         "would change the base model in place and the saved adapter, loaded on a fresh base model, "
                         "would not reproduce the trained model. Give the adapter its own codebooks, saved with it: "
                         'LoraConfig(..., modules_to_save=["quantizer"])')


AutoConfig.register("linattn", LinattnConfig, exist_ok=True)
AutoModel.register(LinattnConfig, LinattnModel, exist_ok=True)
AutoModelForCausalLM.register(LinattnConfig, LinattnForCausalLM, exist_ok=True)
AutoTokenizer.register(LinattnConfig, fast_tokenizer_class=LinattnByteTokenizer, exist_ok=True)

__all__ = [
    "LinattnConfig",
    "LinattnModel",
    "LinattnForCausalLM",
    "LinattnCache",
    "RowGroup",
    "CodebookUpdateCallback",
    "LinattnByteTokenizer",
    "LinattnTokenizer",
    "byte_tokenizer",
    "causal_lm_loss",
    "export_run",
    "lm_state_of",
    "save_pretrained_lm",
]
