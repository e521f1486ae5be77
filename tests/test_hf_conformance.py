"""transformers' own model tests on linattn's classes: ``ModelTesterMixin`` of the pinned
transformers (its ``tests/test_modeling_common.py``, from the source distribution, which
``make transformers-tests`` fetches by version and hash into ``.venv/transformers-tests``) on
``LinattnModel`` and ``LinattnForCausalLM``, registered as transformers registers its own causal
LMs. The tests that do not apply are listed in ``NOT_APPLICABLE`` with the reason for each."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path

import torch
import transformers
from transformers.models.auto import modeling_auto

import linattn.hf as H

torch.set_num_threads(1)

TESTS_DIR = Path(os.environ.get("LINATTN_TRANSFORMERS_TESTS", Path(sys.prefix) / "transformers-tests"))
_PACKAGE = "transformers_sdist_tests"


def _load_model_tester_mixin(folder: Path) -> types.ModuleType:
    """``tests/test_modeling_common.py`` of the transformers source distribution in ``folder``, as
    the module ``transformers_sdist_tests.test_modeling_common``. The sdist ships only the top-level
    test files: the two mixins it imports from subfolders it lacks (``exporters/test_export.py``,
    ``generation/test_utils.py``) are empty classes here, so their tests are not run (linattn's own:
    ``tests/test_export_program.py``, ``tests/test_hf.py``)."""
    common = folder / "tests" / "test_modeling_common.py"
    if not common.is_file():
        raise RuntimeError(f"{common} is missing: `make transformers-tests` fetches the tests of the pinned "
                           "transformers (or set LINATTN_TRANSFORMERS_TESTS to such a folder)")
    version = next(line.split(":", 1)[1].strip() for line in (folder / "PKG-INFO").read_text().splitlines()
                   if line.startswith("Version:"))
    if version != transformers.__version__:
        raise RuntimeError(f"{folder} holds the tests of transformers {version}, but {transformers.__version__} is "
                           "installed: `make transformers-tests` fetches the pinned version's")
    sys.path.insert(0, str(folder / "site"))  # what the tests import that .venv lacks (parameterized)
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(folder / "tests")]
    sys.modules[_PACKAGE] = package
    for module, mixin in (("exporters.test_export", "ExportTesterMixin"), ("generation.test_utils",
                                                                            "GenerationTesterMixin")):
        parent = module.split(".")[0]
        sys.modules.setdefault(f"{_PACKAGE}.{parent}", types.ModuleType(f"{_PACKAGE}.{parent}"))
        stub = types.ModuleType(f"{_PACKAGE}.{module}")
        setattr(stub, mixin, type(mixin, (), {}))
        sys.modules[stub.__name__] = stub
    spec = importlib.util.spec_from_file_location(f"{_PACKAGE}.test_modeling_common", common)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


common = _load_model_tester_mixin(TESTS_DIR)

# The tests of ModelTesterMixin that are not run here (names or fnmatch patterns), by reason.
# transformers' own skips: each of these tests skips itself (its message quoted) for what it needs
# and a linattn model on the CPU does not have; they are left out, so that no test is skipped.
SKIPPED_BY_TRANSFORMERS = {
    "'test requires accelerator', 'multiple accelerators', 'MPS': a CUDA device (or another) or several":
        ["test_can_load_with_device_context_manager", "test_can_load_with_global_device_set", "test_cpu_offload",
         "test_disk_offload_bin", "test_disk_offload_safetensors", "test_flex_attention_with_grads",
         "test_sdpa_can_compile_dynamic", "test_sdpa_can_dispatch_on_flash", "test_model_parallelism",
         "test_flash_attn_kernels_mps_inference_equivalence"],
    "'test requires Flash Attention' (2, 3, 4), 'the kernels library', 'deepspeed': packages not installed, and "
    "linattn refuses every attention implementation but its own (tests/test_hf_api.py)":
        ["test_flash_attn_[234]_*", "test_flash_attn_kernels_inference_equivalence",
         "test_kernels_can_load_without_crashing", "test_resize_*_with_deepspeed*"],
    "'Model architecture does not support attentions', 'Model does not output attentions': no layer forms a "
    "[T, T] attention matrix (has_attentions = False; output_attentions=True is refused by name)":
        ["test_eager_matches_sdpa_inference_*", "test_attn_implementation_composite_models",
         "test_sdpa_can_dispatch_composite_models", "test_sdpa_can_dispatch_non_composite_models",
         "test_attention_outputs", "test_multimodal_outputs_are_returned", "test_sliding_window_mask",
         "test_can_set_attention_dynamically"],
    "'does not support grouped_mm', 'has no sparse experts', 'no `output_router_logits`': no mixture of experts":
        ["test_eager_matches_batched_and_grouped_inference_*", "test_moe_models_record_router_logits",
         "test_output_router_logits_from_config"],
    "'does not have RoPE', 'does not support RoPE scaling', 'no axial RoPE layer', 'no position embeddings': "
    "rotary settings live in LMConfig (rotary_base, rotary_scaling), not in transformers' rope parameters":
        ["test_model_rope_*", "test_vision_axial_rope", "test_resize_position_vector_embeddings"],
    "'No subconfigs', 'not composite', 'No sequence-to-sequence language modeling head': one decoder-only model":
        ["test_internal_model_config_and_subconfig_are_same", "test_can_set_attention_dynamically_composite_model",
         "test_encoder_decoder_loss_no_double_shift"],
    "'no _keep_in_fp32_modules', 'No `_keep_in_fp32_modules_strict`': none declared (the VQ codebooks keep "
    "float32 on their own, tests/test_hf.py)": ["test_keep_in_fp32_modules*"],
    "'No conversion found', 'does not have a TP plan', 'No usage of the `capture_outputs` decorator', 'Cannot "
    "capture hidden states', 'non standard Cache': transformers' checkpoint conversions, tensor parallelism, "
    "output capture and KV caches, which linattn's own checkpoints, states and LinattnCache replace":
        ["test_can_load_from_already_mapped_keys", "test_reverse_loading_mapping", "test_tp_plan_matches_params",
         "test_capture_outputs_decorator", "test_can_capture_specific_layers_hidden_states",
         "test_bc_cache_name_forward"],
    "'test is slow' (RUN_SLOW): torch.compile of a training step; linattn's per-layer compile is tested by "
    "tests/test_train_parallel.py": ["test_torch_compile_for_training"],
}
# The tests that do not apply to linattn models (they fail here by design), each with the reason.
NOT_APPLICABLE = {
    "GenerationTesterMixin (tests/generation/test_utils.py) is not in the source distribution; generate is "
    "tested against linattn's own decoding by tests/test_hf.py": ["test_generation_tester_mixin_inheritance"],
    "they need transformers' GradientCheckpointingLayer modules; linattn's LM checkpoints its own layers "
    "(LM.activation_checkpointing, behind the HF switches: tests/test_hf_api.py), with use_reentrant=False only":
        ["test_gradient_checkpointing_enable_disable", "test_training_gradient_checkpointing*"],
    "it compares buffers by value between two random draws: the VQ codebook and its EMA sums are random codes "
    "(tests/test_hf_init.py checks every buffer against an eager build from the same random state)":
        ["test_init_weights_can_init_buffers"],
    "it sets a 10 x 10 input embedding on a model of width 16, which set_input_embeddings refuses by name":
        ["test_model_get_set_embeddings"],
    "the test's own error for bool buffers (it calls the state dict, `state_dict()[key]`), which the VQ "
    "quantizer's `initialized` flag reaches; save and load are tested by tests/test_hf.py": ["test_torch_save_load"],
}


class LinattnModelTester:
    """A two-layer model (multi-head attention over VQ keys, a Gated DeltaNet) on 8-token rows of 2."""

    def __init__(self, parent: unittest.TestCase):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = 2, 8, 256
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 16, 2, 2
        self.is_training = True

    def get_config(self) -> H.LinattnConfig:
        return H.LinattnConfig(d_model=self.hidden_size, n_layers=self.num_hidden_layers,
                               attention="vq-attn:rerope,gated-delta", n_heads=self.num_attention_heads,
                               codebook_size=8, block_size=4, chunk_size=4)

    def prepare_config_and_inputs_for_common(self) -> tuple[H.LinattnConfig, dict]:
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


class LinattnModelTest(common.ModelTesterMixin, unittest.TestCase):
    all_model_classes = (H.LinattnModel, H.LinattnForCausalLM)
    test_can_init_all_missing_weights_before_2023 = True  # linattn's _init_weights initialises every tensor
    has_attentions = False  # no layer forms a [T, T] attention matrix (output_attentions=True is refused)

    def setUp(self):
        self.model_tester = LinattnModelTester(self)
        for names, value in ((modeling_auto.MODEL_MAPPING_NAMES, "LinattnModel"),
                             (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "LinattnForCausalLM")):
            names["linattn"] = value  # what transformers' own causal LMs are listed under
            self.addCleanup(names.pop, "linattn")


def _left_out(names: list[str]) -> list[str]:
    """Every test of ``LinattnModelTest`` matched by one of ``names`` (fnmatch patterns)."""
    return [name for name in dir(LinattnModelTest)
            if name.startswith("test_") and any(fnmatch.fnmatchcase(name, pattern) for pattern in names)]


LEFT_OUT = {reason: _left_out(names) for reason, names in {**SKIPPED_BY_TRANSFORMERS, **NOT_APPLICABLE}.items()}
for _names in LEFT_OUT.values():
    for _name in _names:
        setattr(LinattnModelTest, _name, None)  # not collected


def test_every_test_left_out_is_a_test_of_the_mixin():
    """Each name and pattern above matches a test of ``ModelTesterMixin`` (a renamed or removed test
    is noticed), and no test is left out for two reasons."""
    patterns = [pattern for names in {**SKIPPED_BY_TRANSFORMERS, **NOT_APPLICABLE}.values() for pattern in names]
    tests = [name for name in dir(common.ModelTesterMixin) if name.startswith("test_")]
    assert [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in tests)] == []
    left_out = [name for names in LEFT_OUT.values() for name in names]
    assert len(left_out) == len(set(left_out))
