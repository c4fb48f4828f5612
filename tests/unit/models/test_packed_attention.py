"""Packed rows attend within each example from the collator's host-side boundaries (models/attention.py).

Packed == padded to round-off (loss and gradients, with and without gradient checkpointing); a packed forward
and backward dispatch no op that makes a GPU wait for the host; the varlen kernels' plumbing (layout, GQA,
the collator's cu_seq_lens) on CPU through stand-ins; ``auto`` and the one-line errors for a kernel that cannot
run; and, on CUDA (``gpu``), packed == padded in bf16 through whichever kernel ``auto`` picks.
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from alignkit.config.schema import ModelConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch, model_inputs
from alignkit.data.collate import PACKED_KEYS, TokenCollator
from alignkit.errors import ConfigError
from alignkit.models import attention
from alignkit.models.loading import enable_checkpointing, load_causal_lm, split_lm
from alignkit.models.policy import final_hidden

LENGTHS = (7, 3, 12, 5, 1)
#: ops that make a GPU wait for the host (``../shared/gpu/opcount.py``)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "equal", "is_nonzero")


def _examples(seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 900, (n,), generator=g).tolist(),
             "labels": [IGNORE_INDEX] + torch.randint(5, 900, (n - 1,), generator=g).tolist()} for n in LENGTHS]


def _nll(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed next-token NLL over the batch's targets, through the training forward (``final_hidden``)."""
    backbone, head = split_lm(model)
    inputs = {k: v for k, v in model_inputs(batch).items() if k != "input_ids"}
    hidden = final_hidden(backbone, model, batch["input_ids"], inputs)
    logits = head(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _loss_and_grads(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = _nll(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class SyncCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> dict[str, int]:
        return {k: v for k, v in self.ops.items() if k in SYNC_OPS or k == "repeat_interleave"}


def test_collator_emits_host_side_boundaries() -> None:
    batch = TokenCollator(0, packed=True)(_examples())
    assert set(PACKED_KEYS) <= batch.input_keys  # model inputs: they reach the attention through **kwargs
    cu = batch["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 7, 10, 22, 27, 28] and batch["cu_seq_lens_k"].equal(cu)
    assert batch["max_length_q"] == batch["max_length_k"] == 12 and batch["packed_seq_lens"] == LENGTHS
    moved = batch.to(torch.device("meta"))  # Batch.to moves the tensors, the host lengths stay Python ints
    assert moved["cu_seq_lens_q"].is_meta and moved["packed_seq_lens"] == LENGTHS and moved["max_length_q"] == 12
    assert not set(PACKED_KEYS) & TokenCollator(0)(_examples()).keys()  # padded batches carry none


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_equals_padded_loss_and_grads(micro_model: Path, checkpointing: bool) -> None:
    """micro: 4 query heads over 2 KV heads (GQA), so the per-example path's enable_gqa is exercised too."""
    model = load_causal_lm(ModelConfig(name_or_path=str(micro_model), attn_implementation="auto"))
    assert model.config._attn_implementation == attention.NAME
    if checkpointing:
        enable_checkpointing(model)
        model.train()
    exs = _examples()
    loss_pad, g_pad = _loss_and_grads(model, TokenCollator(0)(exs))
    loss_pack, g_pack = _loss_and_grads(model, TokenCollator(0, packed=True)(exs))
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-5, atol=1e-5)
    assert g_pad.keys() == g_pack.keys() and len(g_pad) == len(list(model.parameters()))
    for n in g_pad:
        torch.testing.assert_close(g_pack[n], g_pad[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_row_never_attends_across_examples(micro_model: Path) -> None:
    """Changing example 1 leaves every other example's hidden states exactly as they were: the boundaries the
    collator sent are the ones applied (transformers' own block mask is not built: packed_model_inputs)."""
    model = load_causal_lm(ModelConfig(name_or_path=str(micro_model)))
    backbone, _ = split_lm(model)
    exs, other = _examples(0), _examples(1)
    changed = [exs[0], other[1], *exs[2:]]
    hs = []
    for e in (exs, changed):
        batch = TokenCollator(0, packed=True)(e)
        with torch.no_grad():
            hs.append(final_hidden(backbone, model, batch["input_ids"],
                                   {k: v for k, v in model_inputs(batch).items() if k != "input_ids"})[0])
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]] = False
    assert torch.equal(hs[0][keep], hs[1][keep]) and not torch.equal(hs[0][~keep], hs[1][~keep])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_backward_has_no_host_sync(micro_model: Path, checkpointing: bool) -> None:
    """No op that would make a GPU wait for the host (nonzero, .item()/.tolist(), ...) in a packed forward and
    backward: the boundaries are the collator's, neither the attention nor transformers' mask creation asks."""
    model = load_causal_lm(ModelConfig(name_or_path=str(micro_model)))
    if checkpointing:
        enable_checkpointing(model)
        model.train()
    batch = TokenCollator(0, packed=True)(_examples())
    backbone, _ = split_lm(model)
    inputs = {k: v for k, v in model_inputs(batch).items() if k != "input_ids"}
    count = SyncCount()
    with count:
        final_hidden(backbone, model, batch["input_ids"], inputs).float().pow(2).mean().backward()
    assert sum(count.ops.values()) > 100 and count.syncs() == {}, count.syncs()


# ------------------------------------------------------------------ varlen plumbing through CPU stand-ins
def _spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int, causal: bool, scale: float | None = None, gqa: bool = False) -> torch.Tensor:
    """What torch's varlen_attn computes, with its checks: equal heads unless ``gqa``, the collator's lengths."""
    assert causal and max_q == max_k == max(LENGTHS) and q.is_contiguous()
    if not gqa and q.shape[1] != k.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    bounds = cu_q.tolist()
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    return torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                     scale=scale, enable_gqa=gqa).transpose(0, 1)
                      for s, e in itertools.pairwise(bounds)])


# stand-ins with exactly the signatures of torch's releases (torch/nn/attention/varlen.py)
def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,  # type: ignore[no-untyped-def]
                return_aux=None):
    return _spans(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,  # type: ignore[no-untyped-def]
                return_aux=None, scale=None, window_size=(-1, -1)):
    return _spans(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,  # type: ignore[no-untyped-def]
                return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    return _spans(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, enable_gqa)


VARLEN_APIS = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.13": varlen_2_13}


def _fake_torch_varlen(takes_gqa: bool) -> Any:
    return attention.VarlenApi.of(varlen_2_13 if takes_gqa else varlen_2_11)


def _fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):  # type: ignore[no-untyped-def]
    assert dropout_p == 0.0
    return _spans(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, q.shape[1] != k.shape[1])


@pytest.mark.parametrize("kernel", ["flash", "torch_gqa", "torch_no_gqa"])
def test_varlen_kernel_plumbing(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The (1, H, T, D) <-> (T, H, D) layouts, the collator's cu_seq_lens and max_length, and GQA reach a varlen
    kernel as its contract says, and its output comes back as per-example SDPA's (CPU stand-ins for the kernels)."""
    if kernel == "flash":
        monkeypatch.setattr(attention, "flash_varlen", lambda: _fake_flash)
        name = attention.FLASH_ATTN
    else:
        takes = kernel == "torch_gqa"
        monkeypatch.setattr(attention, "torch_varlen", lambda: _fake_torch_varlen(takes))
        name = attention.TORCH_VARLEN
    batch = TokenCollator(0, packed=True)(_examples())
    T, g = sum(LENGTHS), torch.Generator().manual_seed(0)
    # transformers' layout: (1, T, H, D) projections viewed as (1, H, T, D)
    q, k, v = (torch.randn(1, T, h, 16, generator=g).transpose(1, 2) for h in (4, 2, 2))
    got = attention._varlen(name, q, k, v, dict(batch), 0.0, None).unsqueeze(0)
    want = attention._per_example(q, k, v, list(LENGTHS), 0.0, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, 16 ** -0.5, 0.3])
@pytest.mark.parametrize("release", VARLEN_APIS)
def test_each_torch_varlen_signature(release: str, scaling: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each release's varlen_attn is called by its own signature (read once): 2.10's is_causal with the scale
    folded into q and kv heads repeated, 2.11's scale and window_size, 2.13's enable_gqa; the output is
    per-example SDPA's with the same scale (GQA: 4 query over 2 KV heads, D=16)."""
    api = attention.VarlenApi.of(VARLEN_APIS[release])
    assert api is not None and (api.causal, api.scale, api.gqa) == {
        "2.10": ("is_causal", False, False), "2.11": ("window_size", True, False),
        "2.13": ("window_size", True, True)}[release]
    monkeypatch.setattr(attention, "torch_varlen", lambda: api)
    batch = TokenCollator(0, packed=True)(_examples())
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, sum(LENGTHS), h, 16, generator=g).transpose(1, 2) for h in (4, 2, 2))
    got = attention._varlen(attention.TORCH_VARLEN, q, k, v, dict(batch), 0.0, scaling).unsqueeze(0)
    want = attention._per_example(q, k, v, list(LENGTHS), 0.0, scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if scaling == 0.3:  # a scale the kernel was not told about would show
        assert not torch.allclose(want, attention._per_example(q, k, v, list(LENGTHS), 0.0, None), atol=1e-3)


def test_installed_torch_varlen_signature_is_understood() -> None:
    """This machine's torch (2.13 here) has varlen_attn with scale, window_size and enable_gqa; a signature with
    no way to say "causal" is not used (packed rows then run SDPA per example)."""
    from torch.nn.attention import varlen

    api = attention.torch_varlen()
    assert api is not None and api.fn is varlen.varlen_attn and (api.causal, api.scale, api.gqa) == (
        "window_size", True, True)
    assert attention.VarlenApi.of(lambda q, k, v, cu_q, cu_k, max_q, max_k: q) is None


def test_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn's varlen first, then torch's varlen_attn, else per-example SDPA; CPU, fp32 and dropout the latter."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "_flash_capable", lambda index: True)
    monkeypatch.setattr(attention, "flash_varlen", lambda: _fake_flash)
    monkeypatch.setattr(attention, "torch_varlen", lambda: _fake_torch_varlen(True))
    assert attention.packed_kernel(cuda) == attention.FLASH_ATTN
    assert attention.packed_kernel(torch.device("cpu")) == attention.PER_EXAMPLE
    assert attention.packed_kernel(cuda, torch.float32) == attention.PER_EXAMPLE
    monkeypatch.setattr(attention, "flash_varlen", lambda: None)
    assert attention.packed_kernel(cuda, torch.float16) == attention.TORCH_VARLEN
    assert attention.packed_kernel(cuda, dropout=0.1) == attention.PER_EXAMPLE  # varlen_attn has no dropout
    assert "packed rows torch varlen_attn (window_size+scale+enable_gqa)" in attention.describe("auto", cuda)
    monkeypatch.setattr(attention, "torch_varlen", lambda: None)
    assert attention.packed_kernel(cuda) == attention.PER_EXAMPLE
    monkeypatch.setattr(attention, "_flash_capable", lambda index: False)  # pre-Ampere
    monkeypatch.setattr(attention, "flash_varlen", lambda: _fake_flash)
    assert attention.packed_kernel(cuda) == attention.PER_EXAMPLE


def test_vlm_scorer_language_model_attends_packed(micro_llava: Path) -> None:
    """A LLaVA reward model's language model reads the packed boundaries too (and gets the empty prepared mask),
    its vision tower keeps transformers' SDPA."""
    from alignkit.models.scalar import load_scalar_model

    hf = load_scalar_model(ModelConfig(name_or_path=str(micro_llava)), trainable=False)
    cfg = hf.config
    assert (cfg.text_config._attn_implementation, cfg.vision_config._attn_implementation) == (attention.NAME, "sdpa")
    assert attention.uses_packed_attention(hf)
    inputs = attention.packed_model_inputs(hf, {"packed_seq_lens": (2, 3)}, torch.device("cpu"))
    assert inputs["attention_mask"].shape == (1, 1, 5, 0)
    padded = {"attention_mask": torch.ones(1, 5)}  # a padded batch (no lengths) keeps its own mask
    assert attention.packed_model_inputs(hf, padded, torch.device("cpu")) is padded


# ------------------------------------------------------------------ auto and the one-line errors
def test_auto_is_the_default_and_names_its_kernel() -> None:
    from alignkit.models.loading import attention_for, plain_attention

    assert ModelConfig().attn_implementation == "auto"
    assert attention_for("auto") == attention_for("sdpa") == attention.NAME
    assert attention_for("eager") == "eager" and plain_attention("auto") == "sdpa"
    line = attention.describe("auto", torch.device("cpu"))
    assert line.startswith("Attention: sdpa_packed (model.attn_implementation=auto)")
    assert "SDPA per example on cpu" in line
    assert "transformers' own" in attention.describe("eager", torch.device("cpu"))


def _session(micro_model: Path, tmp_path: Path, attn: str) -> Any:
    from alignkit.config.loader import load_config
    from alignkit.train.runner import Session

    cfg = load_config(None, [f"model.name_or_path={micro_model}", "training.per_device_batch_size=2", "algorithm=sft",
                             "data.train=builtin:sft_train.jsonl", f"model.attn_implementation={attn}",
                             f"output_dir={tmp_path}"], notes=False)
    return Session.start(cfg)


def test_start_up_log_names_the_attention(micro_model: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    _session(micro_model, tmp_path, "auto").announce(type("Log", (), {"info": lambda self, m: lines.append(m)})())
    assert any(m.startswith("Attention: sdpa_packed") and "packed rows SDPA per example on cpu" in m for m in lines)


def test_flash_attention_2_that_cannot_run_is_one_line(micro_model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU, and without flash_attn on a GPU: a ConfigError of one line, before any model loads."""
    from alignkit.train import runner

    monkeypatch.setattr(runner, "build_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=r"flash_attention_2 needs a CUDA GPU .* choose auto") as e:
        _session(micro_model, tmp_path, "flash_attention_2")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(attention, "flash_varlen", lambda: None)
    with pytest.raises(ConfigError, match=r"needs the flash_attn package.*pip install flash-attn") as e:
        attention.check_installed("flash_attention_2", torch.device("cuda", 0))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="flash_attn package"):  # any load path, device or not
        load_causal_lm(ModelConfig(name_or_path=str(micro_model), attn_implementation="flash_attention_2"))
    attention.check_installed("auto", torch.device("cpu"))  # auto always runs
    attention.check_installed("eager", torch.device("cpu"))


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_packed_varlen_equals_padded_in_bf16(micro_model: Path, checkpointing: bool) -> None:
    """Under bf16 autocast on CUDA, a packed row through the kernel ``auto`` picks (flash_attn's or torch's
    varlen where installed) gives the padded batch's loss and gradients to bf16 round-off, without a host sync."""
    device = torch.device("cuda")
    model = load_causal_lm(ModelConfig(name_or_path=str(micro_model))).to(device)
    if checkpointing:
        enable_checkpointing(model)
        model.train()
    exs = _examples()
    results = []
    for batch in (TokenCollator(0)(exs), TokenCollator(0, packed=True)(exs)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(_loss_and_grads(model, batch.to(device)))
    (loss_pad, g_pad), (loss_pack, g_pack) = results
    kernel = attention.describe("auto", device)  # named in every failure: which kernel ran the packed row
    torch.testing.assert_close(loss_pack, loss_pad, rtol=2e-2, atol=1e-2, msg=lambda m: f"{kernel}: loss {m}")
    for n in g_pad:
        torch.testing.assert_close(g_pack[n], g_pad[n], rtol=5e-2, atol=5e-3, msg=lambda m, n=n: f"{kernel}: {n} {m}")
    packed = TokenCollator(0, packed=True)(exs).to(device)
    backbone, _ = split_lm(model)
    inputs = {k: v for k, v in model_inputs(packed).items() if k != "input_ids"}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the first synchronising call raises from the line that made it
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            final_hidden(backbone, model, packed["input_ids"], inputs).float().pow(2).mean().backward()
    except RuntimeError as e:
        raise AssertionError(f"{kernel}: a packed forward/backward synchronised: {e}") from e
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_each_available_varlen_kernel_matches_per_example_sdpa() -> None:
    """Every varlen kernel this machine has, against per-example SDPA, in bf16 (GQA: 8 query over 2 KV heads)."""
    device = torch.device("cuda")
    kernels = [k for k, ok in ((attention.FLASH_ATTN, attention.flash_varlen() is not None),
                               (attention.TORCH_VARLEN, attention.torch_varlen() is not None)) if ok]
    if not kernels or attention.packed_kernel(device) == attention.PER_EXAMPLE:
        pytest.skip("no varlen kernel on this machine")
    batch = TokenCollator(0, packed=True)(_examples()).to(device)
    T, g = sum(LENGTHS), torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, T, h, 64, generator=g, device=device, dtype=torch.bfloat16).transpose(1, 2)
               for h in (8, 2, 2))
    want = attention._per_example(q, k, v, list(LENGTHS), 0.0, None)
    for kernel in kernels:
        got = attention._varlen(kernel, q, k, v, dict(batch), 0.0, None).unsqueeze(0)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=kernel)
