"""Hugging Face ``transformers`` integration of linattn language models.

Importing ``linattn.hf`` registers ``model_type="linattn"`` with ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM`` (no ``trust_remote_code`` needed)::

    import linattn.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("runs/demo-hf")
    tokenizer = AutoTokenizer.from_pretrained("runs/demo-hf")

``linattn export --ckpt RUN --out DIR`` writes such a directory from a training run.
"""

from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from ..models import LM
from .cache import LinattnCache, RowGroup
from .config import LinattnConfig
from .export import export_run, save_pretrained_lm
from .modeling import LinattnForCausalLM, LinattnModel, causal_lm_loss, lm_state_of
from .tokenizer import LinattnByteTokenizer, byte_tokenizer


class CodebookUpdateCallback(TrainerCallback):
    """HF ``Trainer`` callback: the EMA codebook update of a linattn model's VQ layers after
    every optimizer step (what linattn's own trainer does). The model may be wrapped (a PEFT
    ``PeftModel``, DDP, ...): every linattn ``LM`` among its modules is updated."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for lm in _linattn_lms(model):
            lm.update_codebooks()
        return control


def _linattn_lms(model) -> list[LM]:
    """The linattn ``LM``s inside ``model``, however wrapped (none for anything else)."""
    if not isinstance(model, nn.Module):
        return []
    return [module for module in model.modules() if isinstance(module, LM)]


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
    "byte_tokenizer",
    "causal_lm_loss",
    "export_run",
    "lm_state_of",
    "save_pretrained_lm",
]
