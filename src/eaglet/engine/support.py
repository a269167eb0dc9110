"""What the installed vLLM does with a target, asked of vLLM itself: the model class it serves
the target's architecture with, whether that class gives the aux hidden states every method
eaglet trains needs (vLLM's ``SupportsEagle3`` interface: EAGLE-3, P-EAGLE and DFlash drafters
read them, and so does the ``extract_hidden_states`` capture), whether it serves the target
with multi-head latent attention, and the engine settings a CPU needs.

A target whose class lacks the interface fails deep inside the server ("Model does not support
EAGLE3 interface but aux_hidden_state_outputs was requested") after generation, or, with the
transformers extraction backend, at evaluation after every hour of training:
:func:`refusal` says so before any stage runs, with what vLLM can serve instead.

vLLM is imported only by :func:`ask` (in a process of its own through :func:`ask_in_subprocess`
where the caller must stay free of PyTorch, as ``eaglet plan`` must); the rest is plain data.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from eaglet.core.methods import SPECULATIONS
from eaglet.target.checkpoint import LAYOUTS, text_config, weight_map

log = logging.getLogger("eaglet.engine.support")

INTERFACE = "SupportsEagle3"

# config.json keys that declare the target's own multi-token-prediction layers, which vLLM
# serves with speculative method "mtp" (config/speculative.py reads these two)
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")

# The weights' dtypes vLLM's AMX MLA backend takes (amx_mla.py, process_weights_after_loading:
# bfloat16, float16, and quantized int8/fp8/mxfp4/int4 weights, which a checkpoint declares);
# the CPU platform picks that backend for every MLA model on a CPU with AMX tiles unless
# CPU_MLA is asked for (platforms/cpu.py, get_attn_backend_cls), and CPU_MLA takes any dtype
AMX_MLA_DTYPES = ("bfloat16", "float16")
CPU_MLA = "CPU_MLA"

# the x86 instruction set vLLM's CPU kernels are built for at the least (vllm._C_AVX2; the
# platform loads the AVX-512 build where the CPU has it: platforms/cpu.py, import_kernels)
CPU_ENGINE_FLAG = "avx2"


class UnsupportedTarget(RuntimeError):
    """vLLM cannot serve a drafter of eaglet's for this target."""


def mtp_layers(config: dict) -> int:
    """How many multi-token-prediction layers the target's config declares (0: none)."""
    for part in (text_config(config), config):
        for key in MTP_KEYS:
            if isinstance(part.get(key), int) and part[key] > 0:
                return part[key]
    return 0


# where a checkpoint keeps MTP layers that sit in no decoder-layer container: a container of
# their own (Qwen3.5's and Qwen3-Next's ``mtp.``, MiMo's ``model.mtp_layers.``)
MTP_CONTAINER = re.compile(r"(^|\.)mtp(_layers)?\.")
# decoder-layer containers vLLM's MTP loaders look for layer num_hidden_layers + i in
# (models/utils.py, get_spec_layer_idx_from_weight_name), and every layout eaglet reads
LAYER_CONTAINERS = tuple(
    dict.fromkeys(
        ["model.layers.", "layers.", "model.language_model.layers."]
        + [c for layout in LAYOUTS for c in layout.containers]
    )
)


def mtp_layers_held(config: dict, names: Iterable[str]) -> int:
    """How many of the MTP layers ``config`` declares the checkpoint's tensor ``names`` hold,
    by where vLLM's MTP loaders read them: a declared layer i is held where a decoder-layer
    container has layer num_hidden_layers + i (DeepSeek-V3, GLM-4.5), and every declared layer
    where a name is in an MTP container of its own (Qwen3.5, MiMo)."""
    declared = mtp_layers(config)
    base = text_config(config).get("num_hidden_layers")
    held: set[int] = set()
    for name in names:
        if MTP_CONTAINER.search(name):
            return declared
        if isinstance(base, int):
            for container in LAYER_CONTAINERS:
                if name.startswith(container):
                    head = name[len(container) :].split(".", 1)[0]
                    if head.isdigit() and base <= int(head) < base + declared:
                        held.add(int(head))
    return len(held)


def _mtp_weights(target_dir: str | Path) -> tuple[int, int | None]:
    """The MTP layers the target's config declares, and how many of them its checkpoint's
    tensors hold (:func:`mtp_layers_held`; None where the directory names no tensor, or none
    is declared); the config and the tensor names are read once."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        return 0, None
    config = json.loads(path.read_text())
    declared = mtp_layers(config)
    names = weight_map(target_dir) if declared else None
    return declared, None if names is None else mtp_layers_held(config, names)


def _missing(declared: int, held: int) -> str:
    return (
        f"the checkpoint holds no MTP weights: its config declares {declared} MTP layer(s), "
        f"its tensors hold {held} (vLLM refuses method mtp at load: 'MTP speculative decoding "
        f"layer weights missing from checkpoint'; quantized releases often drop them)"
    )


def mtp_served(target_dir: str | Path) -> tuple[int, str | None]:
    """The MTP layers vLLM can serve of the target in ``target_dir`` (the k of its ``mtp``
    baseline; 0: none) and, where its config declares layers its checkpoint does not hold,
    why none are served. vLLM refuses ``method: mtp`` at load then ("MTP speculative decoding
    layer N weights missing from checkpoint"), as it does for quantized releases that dropped
    them. Where the directory names no tensors (config files alone), the declaration stands."""
    declared, held = _mtp_weights(target_dir)
    if held is None or held == declared:
        return declared, None
    return 0, _missing(declared, held)


def mtp_note(target_dir: str | Path, evaluated: bool = True) -> tuple[bool | None, str] | None:
    """What the target's files say of its MTP baseline, for `eaglet plan` and `eaglet
    rehearse` to say up front: (True, ...) where the checkpoint holds the layers its config
    declares (the evaluation measures vLLM's ``mtp`` beside the drafter), (None, ...) where
    it lacks them (that run is not measured, and the drafter's verdict comes out all the
    same) or where these files name no tensor (config files alone: the evaluation reads the
    weights); None where no layers are declared. ``evaluated``: whether evaluate.mtp
    measures the baseline at all."""
    declared, held = _mtp_weights(target_dir)
    if not declared:
        return None
    said = f"the target's config declares {declared} multi-token-prediction layer(s)"
    if held is None:
        return None, (
            f"{said}; these files name no tensor (no model.safetensors.index.json), so "
            f"whether the checkpoint holds their weights is read from the weights at evaluation"
        )
    if held != declared:
        missing = _missing(declared, held)
        return None, f"{missing}; the evaluation reports its mtp baseline as not measured"
    then = (
        f"the evaluation measures vLLM's mtp at k {declared} beside the drafter"
        if evaluated
        else "evaluate.mtp is off, so the evaluation does not measure them"
    )
    return True, f"{said} and its checkpoint holds their weights: {then}"


def uses_mla(config: dict) -> bool:
    """Whether vLLM serves the model of ``config`` (a config.json's dict) with multi-head
    latent attention: vLLM's own answer (its architecture config's ``is_deepseek_mla``, for
    a config with the latent rank its rule reads) where vLLM is importable, else that rank's
    presence (``kv_lora_rank``)."""
    text = text_config(config)
    if text.get("kv_lora_rank") is None and "compress_ratios" not in text:
        return False  # vLLM's rule needs one of them: no need to import it
    try:
        import vllm.config  # noqa: F401  (breaks the convertor module's import circle)
        from transformers import PretrainedConfig
        from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

        hf_text = PretrainedConfig(**text)
        hf = PretrainedConfig(**config) if text is not config else hf_text
        return bool(ModelArchConfigConvertorBase(hf, hf_text).is_deepseek_mla())
    except Exception as error:  # not importable here, or another vLLM: the config's sign
        log.debug("vLLM's MLA rule not asked (%s: %s)", type(error).__name__, error)
        return text.get("kv_lora_rank") is not None


def cpu_attention_backend(mla: bool, dtype: str) -> str | None:
    """The attention backend to ask of vLLM's CPU engine for a model served in ``dtype``:
    CPU_MLA for an MLA model whose weights the AMX MLA backend would refuse (float32), so that
    the same configuration serves on every x86 CPU, with AMX or without; None (vLLM's own
    choice) otherwise."""
    return CPU_MLA if mla and dtype not in AMX_MLA_DTYPES else None


def cpu_engine_problem(flags: Iterable[str]) -> str | None:
    """Why vLLM's CPU engine cannot run on a CPU with these /proc/cpuinfo ``flags`` (x86), or
    None."""
    flags = set(flags)
    if flags and CPU_ENGINE_FLAG not in flags:
        return (
            f"this CPU lacks {CPU_ENGINE_FLAG.upper()}, the least instruction set vLLM's CPU "
            f"engine is built for (its kernels come as AVX2 and AVX-512 builds): serve on a "
            f"machine whose /proc/cpuinfo flags list {CPU_ENGINE_FLAG}, or on GPUs"
        )
    return None


def cpu_engine_args(
    args: list[str], model_config: dict | None, dtype: str, draft_config=None
) -> list[str]:
    """``args`` of a server on vLLM's CPU engine with the attention backend each model needs
    (:func:`cpu_attention_backend`): the target's through ``--attention-backend``, the draft
    model's through the speculative config's ``attention_backend`` (vLLM never gives a draft
    the target's backend: it chooses again, and would pick AMX MLA for an MLA drafter).
    ``draft_config(path)`` reads a drafter's config.json; a speculative method without a model
    of its own (``extract_hidden_states``, ``mtp``) runs the target's layers. A backend the
    args already name is kept."""
    out = list(args)
    if model_config is None:
        return out
    backend = cpu_attention_backend(uses_mla(model_config), dtype)
    if backend and "--attention-backend" not in out:
        out += ["--attention-backend", backend]
    if "--speculative-config" in out:
        at = out.index("--speculative-config") + 1
        spec = json.loads(out[at])
        if spec.get("model"):
            drafter = draft_config(spec["model"]) if draft_config else None
        else:
            drafter = None if spec.get("method") in DRAFTER_FREE else model_config
        backend = cpu_attention_backend(uses_mla(drafter), dtype) if drafter else None
        if backend and "attention_backend" not in spec:
            out[at] = json.dumps({**spec, "attention_backend": backend})
    return out


# vLLM's speculative methods that run no model layers
DRAFTER_FREE = tuple(name for name, s in SPECULATIONS.items() if not s.runs_layers)


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The first processor's flags (empty where the file has none: not Linux, not x86)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def ask(config: dict) -> dict:
    """vLLM's answers for the target of ``config`` (a config.json's dict), in this process:
    ``vllm_version``, the ``architecture`` of config.architectures vLLM registers first (as it
    resolves a model), its ``model_class``, whether it implements ``SupportsEagle3``
    (``supports_eagle3``: None where the class could not be loaded here, with the ``error``), ``mla``,
    and the ``mtp_layers`` the config declares."""
    import vllm
    import vllm.config  # noqa: F401
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    out = {
        "vllm_version": vllm.__version__,
        "architectures": config.get("architectures") or [],
        "architecture": None,
        "model_class": None,
        "supports_eagle3": None,
        "error": None,
        "mla": uses_mla(config),
        "mtp_layers": mtp_layers(config),
    }
    supported = ModelRegistry.get_supported_archs()
    for arch in out["architectures"]:
        if arch not in supported:
            continue
        out["architecture"] = arch
        try:
            cls = ModelRegistry._try_load_model_cls(arch)
        except Exception as error:  # the module imports what this machine lacks
            cls, out["error"] = None, f"{type(error).__name__}: {error}"
        if cls is None:
            out["error"] = out["error"] or f"vLLM could not load the class of {arch} here"
        else:
            out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
            out["supports_eagle3"] = bool(supports_eagle3(cls))
        break
    else:
        out["error"] = (
            f"vLLM {vllm.__version__} registers none of the architectures {out['architectures']}"
        )
    return out


def ask_in_subprocess(
    config_path: str | Path, python: str = sys.executable, timeout_s: float = 300.0
) -> dict:
    """:func:`ask` in a process of its own (vLLM imports PyTorch); a dict with ``error`` alone
    where that process fails (no vLLM installed, say)."""
    try:
        done = subprocess.run(
            [python, "-m", "eaglet.engine.support", str(config_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"vLLM could not be asked ({last})"}
    return json.loads(lines[-1])


def alternatives(answers: dict) -> list[str]:
    """What vLLM serves for a target whose class lacks the interface: its own MTP layers where
    its config declares them, and drafter-free n-gram lookup."""
    out = []
    if answers.get("mtp_layers"):
        out.append(
            f"the target's own {answers['mtp_layers']} multi-token-prediction layer(s) "
            '(--speculative-config \'{"method": "mtp", "num_speculative_tokens": '
            f"{answers['mtp_layers']}}}')"
        )
    out.append(
        'n-gram lookup, which needs no drafter (--speculative-config \'{"method": '
        '"ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\')'
    )
    return out


# vLLM serves a repository in its Mistral mode (tokenizer, config and load format ``mistral``,
# prompts rendered by mistral_common) where its weights are consolidated*.safetensors and a
# Mistral tokenizer file is there (tokenizers/registry.py, transformers_utils/repo_utils.py)
MISTRAL_WEIGHTS = "consolidated*.safetensors"
MISTRAL_TOKENIZERS = ("tekken.json", "tokenizer.model.v*")
MISTRAL_CONFIG = "params.json"


def mistral_mode(target_dir: str | Path) -> bool | None:
    """Whether vLLM serves the target in ``target_dir`` in its Mistral mode, by vLLM's rule
    (:data:`MISTRAL_WEIGHTS` beside one of :data:`MISTRAL_TOKENIZERS`). None where the
    directory holds Mistral's format (``params.json`` and its tokenizer) but no weights to
    decide by (config files alone): such a repository ships its weights consolidated."""
    directory = Path(target_dir)
    if not any(any(directory.glob(p)) for p in MISTRAL_TOKENIZERS):
        return False
    if any(directory.glob(MISTRAL_WEIGHTS)):
        return True
    if any(directory.glob("*.safetensors")) or not (directory / MISTRAL_CONFIG).is_file():
        return False
    return None


def template_kwargs_refusal(target_dir: str | Path, template_kwargs: dict | None) -> str | None:
    """Why generate.chat_template_kwargs cannot be sent to this target, or None: vLLM's
    Mistral mode renders prompts with mistral_common, which takes no template variables, and
    refuses every request that carries them (tokenizers/mistral.py, validate_request_params),
    so generation and evaluation would fail at their first request."""
    if not template_kwargs:
        return None
    mode = mistral_mode(target_dir)
    if mode is False:
        return None
    served = (
        "is served by vLLM in its Mistral mode"
        if mode
        else f"is in Mistral's format ({MISTRAL_CONFIG} and {' or '.join(MISTRAL_TOKENIZERS)}), "
        f"which vLLM serves in its Mistral mode from its {MISTRAL_WEIGHTS} weights"
    )
    return (
        f"generate.chat_template_kwargs {json.dumps(template_kwargs)} cannot be sent: the "
        f"target {served}, where prompts are rendered by mistral_common (no chat template) "
        f"and vLLM refuses every request that carries chat_template_kwargs. Remove "
        f"generate.chat_template_kwargs (the model's own format, its system prompt included, "
        f"decides how it reasons)"
    )


def refusal(answers: dict, method: str, target: str) -> str | None:
    """Why eaglet cannot train a ``method`` drafter (in words: EAGLE-3, P-EAGLE, DFlash) for
    ``target`` by vLLM's ``answers`` (:func:`ask`), with the options; None where it can, or
    where vLLM could not say (the caller warns)."""
    if answers.get("supports_eagle3") is not False:
        return None
    options = "\n".join(f"  - {line}" for line in alternatives(answers))
    return (
        f"vLLM {answers.get('vllm_version')} cannot serve {method} drafters for {target}: "
        f"its class for {answers.get('architecture')}, {answers.get('model_class')}, does "
        f"not implement {INTERFACE} (the aux hidden states that every EAGLE-3-style "
        f"drafter, and vLLM's hidden-state capture for extraction, read). Neither "
        f"extraction nor the evaluation could run. EAGLE-3, P-EAGLE and DFlash all need "
        f"it. What vLLM serves for this target instead:\n{options}\n"
        f"or a vLLM whose class for {answers.get('architecture')} implements {INTERFACE}."
    )


def require_drafter_support(
    config_path: str | Path, method: str, target: str, python: str = sys.executable
) -> dict:
    """Raise :class:`UnsupportedTarget` (:func:`refusal`) where vLLM cannot serve the run's
    drafter for the target whose config.json is ``config_path``; warn where vLLM could not be
    asked. Returns vLLM's answers."""
    answers = ask_in_subprocess(config_path, python)
    message = refusal(answers, method, target)
    if message:
        raise UnsupportedTarget(message)
    if answers.get("supports_eagle3") is None:
        log.warning(
            "could not ask vLLM whether it serves a drafter for %s (%s): the first server will say",
            target,
            answers.get("error"),
        )
    return answers


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0])
    config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    print(json.dumps(ask(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
