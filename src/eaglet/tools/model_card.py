"""The drafter's model card: ``README.md`` in the exported drafter directory, ready for the
Hugging Face Hub (``hf upload``, ``huggingface_hub.upload_folder``, ``eaglet publish``).

The card is written from what the run recorded, each part from the stage that made it: the
config (``run/config.json`` where the caller has none), the target (``target/target.json``),
the drafter (``drafter/config.json``, the tensor shapes in ``model.safetensors``' header,
``drafter/stats.json``), the data (``prompts/stats.json``, ``synthetic/stats.json``,
``hidden/manifest.json``, ``vocab/stats.json``) and the verdict (``eval/acceptance.json``,
``eval/serve.json``). A part whose stage has not run says so: a card written at export, before
evaluation, says the drafter is not evaluated yet, and the evaluation rewrites it with the
verdict.

It opens with the Hub's metadata block (YAML between ``---`` lines): ``base_model`` (the
target), ``library_name: vllm`` (vLLM loads the drafter; transformers cannot run it alone),
``tags`` (speculative-decoding, the method, eaglet) and ``datasets`` where the data sources
are Hub datasets. No license is written: the run does not know one (the target's and the
data's terms apply; add yours before publishing).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import struct
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from eaglet.core import methods
from eaglet.core.io import atomic_open
from eaglet.core.layout import (
    ACCEPTANCE,
    DRAFTER,
    DRAFTER_CONFIG,
    DRAFTER_STATS,
    DRAFTER_WEIGHTS,
    MANIFEST,
    PROMPT_STATS,
    REPO,
    RUN_CONFIG,
    SERVE,
    START_RECORD,
    SYNTHETIC_STATS,
    TARGET_JSON,
    VOCAB_STATS,
)
from eaglet.stages.evaluate.runs import is_drafter
from eaglet.target.checkpoint import read_target

log = logging.getLogger("eaglet.tools.model_card")

CARD = "README.md"

# the Hub models the embedded targets were made from (dequantized from their Q4 GGUF)
EMBEDDED_ORIGIN = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# the Hub datasets the packaged sources ship: ShareGPT V3 (the unfiltered cleaned split) and
# HumanEval
PACKAGED_DATASETS = {
    "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "humaneval": "openai/openai_humaneval",
}
# a Hub repo id: owner/name
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# the serve command in a card, its speculative config quoted for the shell
SERVE_LINE = re.compile(r"^vllm serve .* --speculative-config (?P<spec>'[^'\n]*')$", re.MULTILINE)


def _read(path: Path) -> Any:
    """A JSON result, or None where its stage has not written it (or wrote it partly)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def run_config(results_dir: str | os.PathLike) -> dict:
    """The run's validated config as Snakemake recorded it, or {} before any run."""
    return _read(Path(results_dir) / RUN_CONFIG) or {}


def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` reads as a Hub repo id (``owner/name``), not a local path."""
    return bool(name) and HUB_ID.match(name) is not None and not Path(name).exists()


# -- what the card is made from ---------------------------------------------------------------


def parameter_count(weights: Path) -> int | None:
    """The drafter's trained parameters from its safetensors header (no tensor is read):
    every tensor but the vocabulary maps ``d2t``/``t2d``, which are buffers."""
    try:
        with open(weights, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error):
        return None
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or name in ("d2t", "t2d"):
            continue
        count = 1
        for dim in info["shape"]:
            count *= dim
        total += count
    return total


def base_model(cfg: dict, target: dict | None) -> str | None:
    """The target as the Hub knows it where it is a Hub model (or an embedded target made
    from one), else as the config names it."""
    if target and target.get("hub_id"):
        return target["hub_id"]
    spec = (cfg.get("target") or {}).get("model") or (target or {}).get("spec")
    return EMBEDDED_ORIGIN.get(spec, spec)


def served_target(cfg: dict, target: dict | None) -> str | None:
    """What ``vllm serve`` takes for the target: its Hub id, else its directory."""
    if target:
        return target.get("hub_id") or target.get("path")
    spec = (cfg.get("target") or {}).get("model")
    return spec if spec and not spec.startswith("embedded:") else None


def hub_datasets(cfg: dict) -> list[str]:
    """The Hub datasets among the run's data sources (an ``hf`` source's name, the packaged
    sources' origins), in order, once each."""
    out = []
    for source in (cfg.get("data") or {}).get("sources") or []:
        name = (
            source.get("name")
            if source.get("type") == "hf"
            else PACKAGED_DATASETS.get(source.get("type"))
        )
        if source.get("type") in PACKAGED_DATASETS and source.get("path"):
            name = None  # the same format from a file of the user's own
        if name and name not in out:
            out.append(name)
    return out


def _source_words(source: dict) -> str:
    kind = source.get("type", "?")
    where = source.get("name") or source.get("path") or PACKAGED_DATASETS.get(kind)
    out = f"{kind}" + (f" ({where})" if where else "")
    extras = [
        f"at most {source['limit']:,} rows" if source.get("limit") else "",
        f"prompts up to {source['max_prompt_chars']:,} characters"
        if source.get("max_prompt_chars")
        else "",
        "trained on the recorded answers"
        if source.get("answers") == "dataset"
        else "answered by the target",
    ]
    return out + ": " + ", ".join(e for e in extras if e)


def served_spec(
    results: Path, drafter_dir: Path, cfg: dict, serve: dict | None
) -> tuple[dict | None, str]:
    """The speculative config the card serves the drafter with and where it comes from:
    serve.json's (the evaluation's choice), else the method's at the first k the config
    sweeps (the drafter not evaluated yet, or no k that paid)."""
    if serve and serve.get("speculative_config"):
        return dict(serve["speculative_config"]), "eval/serve.json, the evaluation's choice"
    config = _read(drafter_dir / "config.json")
    if config is None:
        return None, "no drafter exported yet"
    k = ((cfg.get("evaluate") or {}).get("num_speculative_tokens") or [3])[0]
    spec = methods.from_config(config).speculative_config(drafter_dir, k)
    why = (
        f"k={k}, the first draft length of evaluate.num_speculative_tokens: the evaluation "
        f"found no draft length faster than the target alone"
        if serve
        else f"k={k}, the first draft length of evaluate.num_speculative_tokens (not evaluated yet)"
    )
    return spec, why


def vllm_serve(target: str, spec: dict) -> str:
    """The command that serves ``target`` with the drafter of ``spec``."""
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"


def card_spec(card: str) -> dict | None:
    """The speculative config of a card's serve command (None where it has none)."""
    found = SERVE_LINE.search(card)
    return json.loads(shlex.split(found["spec"])[0]) if found else None


def name_drafter(card: str, ref: str) -> str:
    """The card with its serve command naming the drafter ``ref`` (a Hub repo id, once
    published) in place of the directory it was written in, and the target by its
    ``base_model`` where that is a Hub id and the command names a local directory."""
    found = SERVE_LINE.search(card)
    if not found:
        return card
    spec = {**card_spec(card), "model": ref}
    argv = shlex.split(found[0])
    base = front_matter(card).get("base_model")
    target = str(base) if argv[2].startswith("/") and is_hub_id(str(base)) else argv[2]
    return card[: found.start()] + vllm_serve(target, spec) + card[found.end() :]


def front_matter(card: str) -> dict:
    """The card's metadata block, parsed ({} where it has none)."""
    if not card.startswith("---\n"):
        return {}
    block, sep, _ = card[4:].partition("\n---\n")
    return (yaml.safe_load(block) or {}) if sep else {}


def _eaglet_version() -> str:
    try:
        version = metadata.version("eaglet")
    except metadata.PackageNotFoundError:
        version = "?"
    commit = checkout_commit(REPO)
    return version + (f" (commit {commit})" if commit else "")


def checkout_commit(repo: Path) -> str:
    """The short commit of the checkout at ``repo``, read from its ``.git`` files ('' where
    there is none): no git process, as every parse of the Snakefile renders the report texts."""
    git = repo / ".git"
    try:
        if git.is_file():  # a worktree: its .git file names its own git directory
            git = (repo / git.read_text().partition(":")[2].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head.removeprefix("ref: ")
        common = git / "commondir"
        base = (git / common.read_text().strip()).resolve() if common.is_file() else git
        for root in (git, base):
            if (root / ref).is_file():
                return (root / ref).read_text().strip()[:7]
        packed = base / "packed-refs"
        for line in packed.read_text().splitlines() if packed.is_file() else []:
            if line.endswith(f" {ref}"):
                return line[:7]
    except OSError:
        pass
    return ""


# -- the card ---------------------------------------------------------------------------------


def _speedup(entry: dict) -> str:
    if entry.get("speedup") is None:
        return "not measured"
    out = f"{entry['speedup']:.2f}x"
    if entry.get("speedup_low") is not None and entry.get("speedup_high") is not None:
        out += f" [{entry['speedup_low']:.2f}, {entry['speedup_high']:.2f}]"
    return out


def _al(value: float | None) -> str:
    return "no drafts" if value is None else f"{value:.2f}"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|")


def _drafter_section(results: Path, drafter_dir: Path) -> list[str]:
    config = _read(drafter_dir / "config.json")
    lines = ["## The drafter", ""]
    if config is None:
        return lines + [f"Not exported yet: `{DRAFTER_CONFIG}` does not exist.", ""]
    method = methods.from_config(config)
    variant = methods.variant_of(config)
    attention = (
        "MLA" if config.get("model_type") == "deepseek_v2" else (method.layer_kind or "Llama")
    )
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (
        config.get("dflash_config") or {}
    ).get("target_layer_ids")
    layers = config.get("num_hidden_layers", 1)
    params = parameter_count(drafter_dir / "model.safetensors")
    items = [
        f"Method: {method.words} (`train.method: {method.name}`), served by vLLM as "
        f'`"method": "{method.served_as}"`'
        + (" with parallel drafting (all k tokens in one forward)" if method.parallel else ""),
        f"Layers: {layers} decoder layer{'s' if layers != 1 else ''} with {attention} "
        f"attention" + ("" if method.block else f", {variant.words} variant"),
        f"Architecture: {', '.join(config.get('architectures') or ['?'])}, hidden size "
        f"{config.get('hidden_size')}, target hidden size {config.get('target_hidden_size')}",
        f"Draft vocabulary: {config.get('draft_vocab_size', '?'):,} of the target's "
        f"{config.get('vocab_size', '?'):,} tokens (`d2t` maps draft ids to target ids)"
        if isinstance(config.get("draft_vocab_size"), int)
        and isinstance(config.get("vocab_size"), int)
        else "",
        f"Target layers read (aux hidden state layer ids): {aux}" if aux else "",
        f"Parameters: {params:,} (the target's embedding is shared, not stored)" if params else "",
        f"Weights: {config.get('torch_dtype') or config.get('dtype') or '?'}",
    ]
    start = _read(results / START_RECORD)
    if start:  # train.init_from: the drafter this one was fine-tuned from
        items.append(
            f"Fine-tuned from: `{start.get('source')}` ({start.get('format', '?')} format; "
            f"{len(start.get('from_drafter', []))} tensors taken from it, "
            f"{len(start.get('new', []))} new)"
        )
    training = _read(results / DRAFTER_STATS)
    shipped = ((training or {}).get("shipped") or {}).get("note")
    if training:
        items.append(
            f"Training: {training.get('steps', '?'):,} steps"
            if isinstance(training.get("steps"), int)
            else "Training: finished"
        )
        if (training.get("eval") or {}).get("sim_al") is not None:
            items[-1] += (
                f"; held-out simulated acceptance length {float(training['eval']['sim_al']):.2f}"
            )
        if shipped:
            items[-1] += f"; {shipped}"
    return lines + [f"- {item}" for item in items if item] + [""]


def _data_section(results: Path, cfg: dict) -> list[str]:
    lines = ["## Training data", ""]
    sources = (cfg.get("data") or {}).get("sources") or []
    if sources:
        lines += ["Prompt sources (`data.sources`):", ""]
        lines += [f"- {_source_words(s)}" for s in sources] + [""]
    prompts, samples = _read(results / PROMPT_STATS), _read(results / SYNTHETIC_STATS)
    hidden, vocab = _read(results / MANIFEST), _read(results / VOCAB_STATS)
    facts = []
    if prompts:
        facts.append(
            f"{prompts.get('n_train', 0):,} training and {prompts.get('n_eval', 0):,} "
            f"held-out prompts"
        )
    train = ((samples or {}).get("splits") or {}).get("train")
    if train:
        tokens = train.get("prompt_tokens", 0) + train.get("completion_tokens", 0)
        facts.append(
            f"{train.get('samples', 0):,} training samples, {tokens:,} tokens "
            f"({train.get('completion_tokens', 0):,} in answers)"
        )
        if samples.get("dataset_answers"):
            facts.append(
                f"{samples['dataset_answers']:,} of them recorded answers, the rest "
                f"the target's own"
            )
    if hidden:
        facts.append(
            f"hidden states of {hidden.get('num_samples', 0):,} samples, "
            f"{hidden.get('tokens', 0):,} tokens, from target layers "
            f"{hidden.get('aux_layer_ids')}"
        )
    if vocab and vocab.get("coverage") is not None:
        facts.append(
            f"the draft vocabulary covers {100 * vocab['coverage']:.2f}% of the answers' tokens"
        )
    if not sources and not facts:
        return lines + ["Not recorded: the run has prepared no data yet.", ""]
    return lines + ([("In this run: " + "; ".join(facts) + "."), ""] if facts else [])


def evaluated(results: Path, name: str) -> dict | None:
    """An evaluation result (``eval/acceptance.json``, ``eval/serve.json``) of the drafter
    exported now: None where there is none, or where it is older than the drafter's weights
    (the evaluation of an earlier export, before training ran again)."""
    path, weights = results / name, results / DRAFTER_WEIGHTS
    try:
        if weights.is_file() and path.stat().st_mtime < weights.stat().st_mtime:
            return None
    except FileNotFoundError:
        return None
    return _read(path)


def _verdict_section(results: Path) -> list[str]:
    lines = ["## Verdict", ""]
    acceptance = evaluated(results, ACCEPTANCE)
    if acceptance is None:
        return lines + [
            "Not evaluated yet: the run has not measured this drafter in vLLM "
            f"(no `{ACCEPTANCE}` newer than its weights), so there is no acceptance "
            "length or speedup to report.",
            "",
        ]
    verdict = acceptance.get("verdict") or {}
    lines += [verdict.get("summary") or "No run of the drafter was measured.", ""]
    warnings = verdict.get("warnings") or []
    lines += [f"- {w}" for w in warnings] + ([""] if warnings else [])
    sets = list(acceptance.get("prompt_sets") or {})
    concurrencies = acceptance.get("concurrency") or []
    runs = [r for r in acceptance.get("runs", []) if r.get("method") != "baseline"]
    runs.sort(key=lambda r: not is_drafter(r))  # the drafter's first, vLLM's own beside them
    checked = (evaluated(results, SERVE) or {}).get("checked_by")
    header = ["run", "AL", *(f"AL {s}" for s in sets)] + [
        f"speedup at concurrency {c}" for c in concurrencies
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        by_c = {e["concurrency"]: e for e in run.get("by_concurrency", [])}
        row = [
            run["name"]
            + (" (compared)" if run.get("compare") else "")
            + (" (serve.json)" if run["name"] == checked else ""),
            _al(run.get("acceptance_length")),
            *(_al((run.get("sets") or {}).get(s, {}).get("acceptance_length")) for s in sets),
            *(_speedup(by_c[c]) if c in by_c else "not measured" for c in concurrencies),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    temps = ", ".join(f"{t:g}" for t in acceptance.get("temperature") or [0])
    lines += [
        "",
        f"AL: mean acceptance length in vLLM (1 + accepted/drafts), per prompt set "
        f"({', '.join(sets) or 'none'}). Speedup: output tokens/s over the target alone "
        f"at the same concurrency, with its 95% interval where measured in rounds. "
        f"Temperature {temps}, answers of up to {acceptance.get('max_tokens', '?')} "
        f"tokens.",
        "",
    ]
    return lines


def _serve_section(
    results: Path, drafter_dir: Path, cfg: dict, target: dict | None, drafter_ref: str | None
) -> list[str]:
    lines = ["## Serve it", ""]
    serve = evaluated(results, SERVE)
    spec, why = served_spec(results, drafter_dir, cfg, serve)
    model = served_target(cfg, target)
    if spec is None or model is None:
        return lines + [f"Nothing to serve yet ({why if spec is None else 'no target'}).", ""]
    if drafter_ref is not None:
        spec["model"] = drafter_ref
    lines += [f"With vLLM ({why}):", "", "```sh", vllm_serve(model, spec), "```", ""]
    if serve and serve.get("note"):
        lines += [f"The evaluation's advice: {serve['note']}.", ""]
    lines += [
        '`"model"` names this drafter: its directory, or its Hub repo id once '
        "published. On vLLM's CPU package `python -m vllm.entrypoints.openai.api_server "
        "--model TARGET` takes the same `--speculative-config`. A speculators-format copy "
        "(`eaglet speculators DRAFTER OUT --target TARGET -k K`) is served by "
        "`vllm serve OUT` alone.",
        "",
    ]
    return lines


def model_card(
    results_dir: str | os.PathLike, cfg: dict | None = None, drafter_ref: str | None = None
) -> str:
    """The card's text (markdown with the Hub's metadata block) for the drafter of the run in
    ``results_dir``, from its config ``cfg`` (None: the run's recorded config) and what its
    stages wrote. ``drafter_ref``: what the serve command names the drafter by (a Hub repo id;
    None: its directory, as the evaluation served it)."""
    results = Path(results_dir)
    cfg = cfg if cfg is not None else run_config(results)
    # where the target is now (read_target: the embedded one moves with the results)
    target = _read(results / TARGET_JSON) and read_target(results / TARGET_JSON)
    drafter_dir = (results / DRAFTER).resolve()
    config = _read(drafter_dir / "config.json")
    method = (
        methods.from_config(config)
        if config
        else methods.method((cfg.get("train") or {}).get("method", methods.DEFAULT.name))
    )
    meta: dict[str, Any] = {}
    base = base_model(cfg, target)
    if base:
        meta["base_model"] = base
    meta["library_name"] = "vllm"
    meta["tags"] = list(
        dict.fromkeys(["speculative-decoding", method.name, method.served_as, "eaglet"])
    )
    datasets = hub_datasets(cfg)
    if datasets:
        meta["datasets"] = datasets
    spec = (target or {}).get("spec") or (cfg.get("target") or {}).get("model") or "?"
    title = f"# {method.words} drafter for {base or spec}"
    about = (
        f"A speculative-decoding drafter ({method.words}) for `{spec}`: it proposes draft "
        f"tokens from the target's own hidden states, and vLLM verifies them with the "
        f"target, so the answers are the target's."
    )
    if spec in EMBEDDED_ORIGIN:
        about += (
            f" The target is {EMBEDDED_ORIGIN[spec]} as eaglet embeds it (dequantized "
            f"from its Q4 GGUF)."
        )
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", title, "", about, ""]
    lines += _verdict_section(results)
    lines += _serve_section(results, drafter_dir, cfg, target, drafter_ref)
    lines += _drafter_section(results, drafter_dir)
    lines += _data_section(results, cfg)
    lines += [
        "## How it was made",
        "",
        f"Made with eaglet {_eaglet_version()}, which trains "
        f"EAGLE-3-style drafters on the target's hidden states and measures them in vLLM "
        f"against the target alone. No license is stated here: the terms of the target "
        f"and of the training data apply.",
        "",
    ]
    return "\n".join(lines)


def write_card(results_dir: str | os.PathLike, cfg: dict | None = None) -> Path | None:
    """Write the card into the run's exported drafter directory (``drafter/README.md``,
    atomically); the path, or None where there is no drafter yet. Never raises: the card
    comes beside a stage's outputs and must not fail the stage (a failure is logged)."""
    results = Path(results_dir)
    if not (results / DRAFTER_WEIGHTS).is_file():
        return None
    path = results / DRAFTER / CARD
    try:
        card = model_card(results, cfg)
        with atomic_open(path) as handle:
            handle.write(card)
    except Exception as exc:  # noqa: BLE001 (a result of another shape than expected)
        log.warning("could not write the model card %s: %s: %s", path, type(exc).__name__, exc)
        return None
    log.info("model card: %s", path)
    return path


# -- publishing -------------------------------------------------------------------------------

REQUIRED = (CARD, "config.json", "model.safetensors")
LOGIN = (
    "log in with `hf auth login` (`huggingface-cli login` with an older huggingface_hub) "
    "or set HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens)"
)


class PublishError(Exception):
    """Why a drafter directory was not published, and the fix, in one message."""


def check_publishable(folder: str | os.PathLike, repo_id: str) -> str:
    """The card of ``folder`` if it can be uploaded as ``repo_id``, else a PublishError
    saying what is missing: the files, a repo id of the Hub's form, a base_model the Hub
    accepts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PublishError(
            f"{folder} is not a directory: give the exported drafter "
            f"(results/drafter, or a speculators-format copy of it)"
        )
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        fix = (
            f"the card comes with training and evaluation (drafter/{CARD}); write it with "
            f"python -c 'from eaglet.tools.model_card import write_card; "
            f'write_card("results")\''
            if missing == [CARD]
            else "give the directory training exported (results/drafter)"
        )
        raise PublishError(
            f"{folder} is not an exported drafter ready to publish: it has no "
            f"{', '.join(missing)}; {fix}"
        )
    if not HUB_ID.match(repo_id):
        raise PublishError(
            f"{repo_id!r} is not a Hugging Face repo id: give OWNER/NAME "
            f"(your user or organization, then the model's name)"
        )
    card = (folder / CARD).read_text()
    base = front_matter(card).get("base_model")
    if base is not None and not is_hub_id(str(base)):
        raise PublishError(
            f"{folder / CARD} names base_model {base!r}, which is not a "
            f"Hugging Face model id (the Hub refuses such a card): set it to the "
            f"id of the model the target is, or delete the line"
        )
    return card


def hub_upload(folder: Path, repo_id: str, private: bool) -> str:
    """Create ``repo_id`` (kept where it exists) and upload ``folder`` to it in one commit;
    the repo's URL."""
    import huggingface_hub

    if huggingface_hub.get_token() is None:
        raise PublishError(f"no Hugging Face token: {LOGIN}")
    api = huggingface_hub.HfApi()
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        commit_message="Upload the drafter and its model card (eaglet)",
    )
    return str(url)


def _network_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "ConnectError", "TimeoutException", "OfflineModeIsEnabled"}
    )


def publish(
    folder: str | os.PathLike, repo_id: str, private: bool = False, upload=hub_upload
) -> str:
    """Upload the exported drafter ``folder`` (its weights, config and card) to the Hub as
    ``repo_id``; its URL. The card's serve command is made to name the drafter by
    ``repo_id`` first (README.md in ``folder`` is rewritten so), so the published card serves
    the published drafter. Every failure is a PublishError saying which and the fix: no
    token, no network, a token refused."""
    folder = Path(folder)
    card = check_publishable(folder, repo_id)
    named = name_drafter(card, repo_id)
    if named != card:
        with atomic_open(folder / CARD) as handle:
            handle.write(named)
    try:
        return _upload(folder, repo_id, private, upload)
    except BaseException:
        if named != card:  # not published: the local card serves the local drafter again
            with atomic_open(folder / CARD) as handle:
                handle.write(card)
        raise


def _upload(folder: Path, repo_id: str, private: bool, upload) -> str:
    """``upload``, its failures said as :class:`PublishError` with the fix they need."""
    try:
        return upload(folder, repo_id, private)
    except PublishError:
        raise
    except Exception as exc:  # noqa: BLE001 (said as the fix it needs, never a traceback)
        if _network_error(exc):
            offline = type(exc).__name__ == "OfflineModeIsEnabled" or os.environ.get(
                "HF_HUB_OFFLINE"
            ) not in (None, "", "0")
            raise PublishError(
                f"could not reach the Hugging Face Hub ({type(exc).__name__}: {exc}). "
                + (
                    "HF_HUB_OFFLINE is set: unset it to upload."
                    if offline
                    else "This machine has no network to huggingface.co: publish from one that has "
                    f"(copy {folder}), or upload it there with `hf upload {repo_id} {folder}`."
                )
            ) from None
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            raise PublishError(f"the Hub refused the token (HTTP 401): {LOGIN}") from None
        if status == 403:
            raise PublishError(
                f"the token may not write to {repo_id} (HTTP 403): use a token "
                f"with write access to its owner, or another owner"
            ) from None
        raise PublishError(f"the upload to {repo_id} failed: {type(exc).__name__}: {exc}") from None
