"""The vLLM plugin that fixes the CPU engine's expand of per-token sampling parameters."""

import logging
from contextlib import contextmanager
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from eaglet.engine import plugin as vllm_plugin  # noqa: E402

FALLBACK = "vllm.v1.sample.rejection_sampler.expand_kernel"


@pytest.fixture(scope="module")
def platform():
    """vLLM's platform with its fallback kernels in place, as a worker has them."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON, dispatcher

    if not current_platform.is_cpu():
        pytest.skip("the expand checked here runs on host tensors: vLLM's CPU engine only")
    if not HAS_TRITON and FALLBACK not in dispatcher._registry:
        # vLLM's own registration, not the plugin's check after it if vLLM loaded the plugin
        install = current_platform.register_triton_kernel_overrides
        getattr(install, "__wrapped__", install)()
    return current_platform


@pytest.fixture
def sampler(platform, monkeypatch):
    """vLLM's rejection sampler module, its expand restored after the test."""
    import vllm.v1.sample.rejection_sampler as sampler

    monkeypatch.setattr(sampler, "expand_batch_to_tokens", sampler.expand_batch_to_tokens)
    return sampler


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextmanager
def plugin_log():
    """The plugin's records (it logs under vLLM's logger, which may not reach the root's)."""
    logger = logging.getLogger(vllm_plugin.log.name)
    level, handler = logger.level, Records()
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def reference_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """The contract, one request at a time."""
    out, start = [], 0
    for value, end in zip(x.tolist(), cu_num_tokens.tolist()):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    assert len(out) == num_tokens
    return torch.tensor(out, dtype=x.dtype)


def test_the_entry_point_is_installed_and_resolves_to_register():
    found = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.split(":")[0] == "eaglet.engine.plugin"
    ]
    assert len(found) == 1, (
        "eaglet's vllm.general_plugins entry point is not installed: "
        "reinstall eaglet (pip install --no-deps -e .)"
    )
    assert found[0].name == "eaglet_cpu_fixes"
    assert found[0].load() is vllm_plugin.register


def test_the_check_tells_a_correct_expand_from_a_wrong_one():
    assert vllm_plugin.expand_preserves_dtype(reference_expand)
    assert vllm_plugin.expand_preserves_dtype(vllm_plugin.expand_batch_to_tokens)

    def to_int64(x, *args, **kwargs):  # the values through an int64 copy
        return reference_expand(x.long(), *args, **kwargs)

    def uninitialized(x, cu_num_tokens, num_tokens, **kwargs):
        return x.new_empty(num_tokens)

    def ignores_replace(x, cu_num_tokens, num_tokens, **kwargs):
        return reference_expand(x, cu_num_tokens, num_tokens)

    for wrong in (to_int64, uninitialized, ignores_replace):
        assert not vllm_plugin.expand_preserves_dtype(wrong), wrong.__name__


def test_vllm_cpu_fallback_expand_is_found_wrong(sampler):
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM runs the Triton expand on CPU, not the C++ fallback")
    original = sampler.expand_batch_to_tokens
    assert not getattr(original, "_eaglet_dtype_preserving", False)
    assert not vllm_plugin.expand_preserves_dtype(original), (
        "vLLM's CPU expand now keeps float values: the plugin no longer patches it, and "
        "eaglet.engine.plugin can be dropped"
    )


def test_register_fixes_the_expand_of_float_temperatures(sampler):
    original = sampler.expand_batch_to_tokens
    buggy = not vllm_plugin.expand_preserves_dtype(original)
    with plugin_log() as records:
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may load plugins more than once: still one fix
    replaced = [r for r in records if "replaced" in r.getMessage()]
    if buggy:
        assert sampler.expand_batch_to_tokens is vllm_plugin.expand_batch_to_tokens
        [line] = replaced
        assert line.levelno == logging.INFO and sampler.__name__ in line.getMessage()
    else:  # a correct vLLM is left alone
        assert sampler.expand_batch_to_tokens is original and not replaced

    greedy = float(sampler.GREEDY_TEMPERATURE)
    temperature = torch.tensor([0.7, greedy, 1.3, 0.35], dtype=torch.float32)
    cu = torch.tensor([2, 3, 6, 7], dtype=torch.int32)
    want = reference_expand(temperature, cu, 7, replace_from=greedy, replace_to=1.0)
    got = sampler.expand_batch_to_tokens(temperature, cu, 7, replace_from=greedy, replace_to=1)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    top_k = torch.tensor([5, 0, 40, 2])
    assert torch.equal(sampler.expand_batch_to_tokens(top_k, cu, 7), reference_expand(top_k, cu, 7))

    # and the sampler's caller divides each draft token's logits by its request's temperature
    logits = torch.randn(7, 11)
    metadata = SimpleNamespace(all_greedy=False, temperature=temperature, top_k=None, top_p=None)
    scaled = sampler.apply_sampling_constraints(logits.clone(), cu, metadata)
    torch.testing.assert_close(scaled, logits / want.unsqueeze(-1), rtol=0, atol=0)


def test_register_before_the_platform_kernels_checks_once_they_are_installed(
    sampler, platform, monkeypatch
):
    """vLLM loads plugins before a worker installs the CPU fallback kernels."""
    installed = sampler.expand_batch_to_tokens
    if vllm_plugin.expand_preserves_dtype(installed):
        pytest.skip("vLLM's expand is correct here: nothing for the deferred check to fix")

    def not_launchable(*args, **kwargs):  # what the bare Triton function does without Triton
        raise TypeError("Cannot inspect kernel parameters for function")

    def install_fallbacks(cls):
        sampler.expand_batch_to_tokens = installed

    cls = type(platform)
    monkeypatch.setattr(sampler, "expand_batch_to_tokens", not_launchable)
    monkeypatch.setattr(cls, "register_triton_kernel_overrides", classmethod(install_fallbacks))
    vllm_plugin.register()
    assert sampler.expand_batch_to_tokens is not_launchable
    platform.register_triton_kernel_overrides()
    assert sampler.expand_batch_to_tokens is vllm_plugin.expand_batch_to_tokens


def test_register_never_raises(sampler, monkeypatch):
    def broken(expand):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(vllm_plugin, "_mismatch", broken)
    with plugin_log() as records:
        vllm_plugin.register()
    [warning] = [r for r in records if r.levelno == logging.WARNING]
    assert "did nothing" in warning.getMessage() and "probe exploded" in str(warning.exc_info[1])


def test_the_replays_target_distribution_is_the_rejection_samplers_after_top_k_and_top_p(sampler):
    """At T > 0 vLLM verifies drafts against the target's logits at the request's temperature
    cut by its top-k and top-p (apply_sampling_constraints); the offline replay's
    ``token_probability`` must give that distribution for every token, or its expected
    acceptance is not the one vLLM measures at a run's evaluate.top_p and top_k."""
    from eaglet.model.replay import token_probability

    vllm_plugin.register()
    vocab = 64
    # per request: temperature, top_p, top_k (vLLM stores top-k off as the vocabulary size)
    requests = [(0.7, 0.9, vocab), (1.0, 0.95, 20), (1.3, 1.0, 5), (0.6, 0.5, 3), (1.0, 1.0, vocab)]
    cu = torch.arange(1, len(requests) + 1, dtype=torch.int32) * 2  # two draft tokens each
    torch.manual_seed(0)
    logits = torch.randn(int(cu[-1]), vocab) * 3
    logits[0, :4] = logits[0, 0]  # a tie at the top-k and top-p edges of one row
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor([r[0] for r in requests]),
        top_p=torch.tensor([r[1] for r in requests]),
        top_k=torch.tensor([r[2] for r in requests], dtype=torch.int32),
    )
    want = torch.softmax(sampler.apply_sampling_constraints(logits.clone(), cu, metadata), -1)
    cut_something = 0
    for row in range(logits.shape[0]):
        t, top_p, top_k = requests[row // 2]
        got = torch.tensor(
            [
                token_probability(logits[row], x, t, top_p, 0 if top_k == vocab else top_k)
                for x in range(vocab)
            ]
        )
        torch.testing.assert_close(got, want[row], rtol=1e-5, atol=1e-7)
        cut_something += int((got == 0).sum())
    assert cut_something > vocab  # the cut left tokens out: the check compared cut rows


def test_the_grouped_norm_fix_normalizes_each_layer_by_its_own_weight():
    """DFlash's context keys of all layers go through one rms_norm call with a weight row per
    layer: the wrapped kernel is right where vLLM's own may not be (its CPU kernel applies
    row 0 to every layer), and a call with one weight row passes straight through."""
    pytest.importorskip("vllm")
    import torch
    from vllm import _custom_ops as ops

    from eaglet.engine import plugin

    original = getattr(ops.rms_norm, "__wrapped__", ops.rms_norm)
    wrapped = plugin.grouped_rms_norm(original)
    assert plugin._norm_mismatch(wrapped) is None
    if plugin._norm_mismatch(original) is not None:  # this vLLM's kernel: the bug is there
        assert "off by" in plugin._norm_mismatch(original)
    x, w = torch.randn(5, 2, 8), torch.rand(8) + 0.5
    plain, through = torch.empty_like(x), torch.empty_like(x)
    original(plain, x, w, 1e-6)
    wrapped(through, x, w, 1e-6)
    assert torch.equal(plain, through)
