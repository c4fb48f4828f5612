"""ops: chunked log-probs against the naive log_softmax, gradients, memory shape; masked reductions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from alignkit.constants import IGNORE_INDEX
from alignkit.ops import logprobs
from alignkit.ops.logprobs import (chunk_rows, chunked_token_logps, selective_log_softmax,
                                   token_logps_from_logits)
from alignkit.ops.reduce import masked_mean, masked_sum


def _naive(hidden, weight, targets, bias=None):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(1)


def _inputs(n, v, h, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) / math.sqrt(h)
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


class _ShapeRecorder(TorchDispatchMode):
    """Records (shape, dtype) of every tensor any aten op returns, forward and backward, and (op name, shape)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((tuple(t.shape), t.dtype))
                self.ops.append((func.overloadpacket.__name__, tuple(t.shape)))
        return out


# ---------------------------------------------------------------- selective_log_softmax


def test_selective_log_softmax_hand_value():
    # log_softmax([1,2,3])[2] = -log(1 + e^-1 + e^-2) = -log(1.5032147) = -0.4076060
    out = selective_log_softmax(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([2]))
    assert out.item() == pytest.approx(-0.40760596, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_selective_log_softmax_matches_naive_noncontiguous(chunk):
    logits = torch.randn(3, 6, 11, dtype=torch.float64, requires_grad=True)
    shifted = logits[:, :-1]  # non-contiguous: must not be copied, must still be right
    index = torch.randint(0, 11, (3, 5))
    out = selective_log_softmax(shifted, index, chunk_size=chunk)
    ref = torch.log_softmax(shifted, -1).gather(-1, index[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn(3, 5, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


def test_selective_log_softmax_gradcheck():
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 7, (4,))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index, chunk_size=3), (logits,))


def test_selective_log_softmax_bf16_no_full_float32_copy():
    m, v = 64, 1000
    logits = torch.randn(m, v).to(torch.bfloat16).requires_grad_()
    index = torch.randint(0, v, (m,))
    with _ShapeRecorder() as rec:
        out = selective_log_softmax(logits, index, chunk_size=8)
        out.sum().backward()
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, index[:, None]).squeeze(1)
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=1e-5)
    big_fp32 = [s for s, d in rec.outputs if d == torch.float32 and math.prod(s) > 8 * v]
    assert big_fp32 == [], f"float32 tensors larger than one chunk: {big_fp32}"
    assert logits.grad.dtype == torch.bfloat16


def test_token_logps_from_logits_ignore_index_gives_zero_and_no_grad():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    labels = torch.tensor([[1, IGNORE_INDEX, 3, 0], [IGNORE_INDEX, IGNORE_INDEX, 4, 2]])
    out = token_logps_from_logits(logits, labels)
    assert out.shape == (2, 4)
    assert out[0, 1].item() == 0.0 and out[1, 0].item() == 0.0 and out[1, 1].item() == 0.0
    ref = torch.log_softmax(logits, -1)[0, 2, 3]
    assert out[0, 2].item() == pytest.approx(ref.item(), abs=1e-6)
    out.sum().backward()
    assert torch.all(logits.grad[0, 1] == 0) and torch.all(logits.grad[1, :2] == 0)


# ---------------------------------------------------------------- chunked_token_logps


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])  # N=13: not a multiple of 4 or 7; 64 > N
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_matches_naive_values_and_grads(dtype, atol, chunk, bias):
    hidden, weight, b, targets = _inputs(13, 17, 6, dtype, bias=bias)
    leaves = [t.requires_grad_() for t in (hidden, weight, b) if t is not None]
    upstream = torch.randn(13, dtype=dtype)
    out = chunked_token_logps(hidden, weight, targets, bias=b, chunk_size=chunk)
    ref = _naive(hidden, weight, targets, b)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=atol)


def test_chunked_frozen_weight_lora_case():
    hidden, weight, _, targets = _inputs(10, 9, 4, torch.float64, bias=False)
    hidden.requires_grad_()
    out = chunked_token_logps(hidden, weight, targets, chunk_size=3)
    out.sum().backward()
    ref_h = hidden.detach().clone().requires_grad_()
    _naive(ref_h, weight, targets).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_frozen_head_grad_in_forward(temperature, with_entropy):
    """A frozen head (LoRA) computes the hidden states' gradient basis in the forward: same values and
    gradients as the naive tempered log-softmax, ignored rows 0, float64 gradcheck; under no_grad it keeps
    nothing of the kind (nothing to differentiate)."""
    hidden, weight, b, targets = _inputs(11, 9, 4, torch.float64)
    targets[[1, 6]] = IGNORE_INDEX
    hidden.requires_grad_()
    fn = lambda h: chunked_token_logps(h, weight, targets, bias=b, chunk_size=4, temperature=temperature,  # noqa: E731
                                       with_entropy=with_entropy)
    out = fn(hidden)
    out = out[0] if with_entropy else out
    keep = targets != IGNORE_INDEX
    ref = torch.log_softmax((hidden @ weight.T + b) / temperature, -1).gather(-1, targets.clamp(min=0)[:, None])
    ref = torch.where(keep, ref.squeeze(1), 0.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    upstream = torch.randn(11, dtype=torch.float64)
    grad, = torch.autograd.grad((out * upstream).sum(), hidden)
    grad_ref, = torch.autograd.grad((ref * upstream).sum(), hidden)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-12)
    assert torch.all(grad[~keep] == 0)
    assert torch.autograd.gradcheck(lambda h: fn(h)[0] if with_entropy else fn(h), (hidden,))


def test_chunked_frozen_hidden_trains_weight_only():
    hidden, weight, b, targets = _inputs(10, 9, 4, torch.float64)
    weight.requires_grad_()
    chunked_token_logps(hidden, weight, targets, bias=b, chunk_size=4).sum().backward()
    w_ref = weight.detach().clone().requires_grad_()
    _naive(hidden, w_ref, targets, b).sum().backward()
    assert hidden.grad is None and b.grad is None
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=0, atol=1e-12)


def test_chunked_gradcheck_float64():
    hidden, weight, b, targets = _inputs(7, 5, 3, torch.float64)
    targets[2] = IGNORE_INDEX
    for t in (hidden, weight, b):
        t.requires_grad_()
    fn = lambda h, w, bb: chunked_token_logps(h, w, targets, bias=bb, chunk_size=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_chunked_ignore_index_and_leading_dims():
    hidden, weight, _, targets = _inputs(12, 8, 5, torch.float64, bias=False)
    targets[[0, 5]] = IGNORE_INDEX
    hidden.requires_grad_()
    out = chunked_token_logps(hidden.view(3, 4, 5), weight, targets.view(3, 4), chunk_size=5)
    assert out.shape == (3, 4)
    flat = out.reshape(-1)
    assert flat[0].item() == 0.0 and flat[5].item() == 0.0
    keep = targets != IGNORE_INDEX
    torch.testing.assert_close(flat[keep], _naive(hidden, weight, targets.clamp(min=0))[keep])
    flat.sum().backward()
    assert torch.all(hidden.grad[0] == 0) and torch.all(hidden.grad[5] == 0)


def test_chunked_bf16_close_to_float32():
    hidden, weight, _, targets = _inputs(20, 50, 16, torch.float32, bias=False)
    out = chunked_token_logps(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=6)
    ref = _naive(hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-2)


def test_chunked_never_creates_or_saves_an_n_by_v_tensor():
    n, v, h, chunk = 4096, 8192, 16, 256
    hidden, weight, b, targets = _inputs(n, v, h, torch.float32)
    for t in (hidden, weight, b):
        t.requires_grad_()
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with _ShapeRecorder() as rec:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = chunked_token_logps(hidden, weight, targets, bias=b, chunk_size=chunk)
        out.sum().backward()
    assert saved, "saved_tensors_hooks saw nothing: the check would be vacuous"
    assert max(math.prod(s) for s in saved) <= v * h  # hidden / weight, never logits
    biggest = max(math.prod(s) for s, _ in rec.outputs)
    assert biggest <= chunk * v, f"an op produced {biggest} elements > one chunk ({chunk}x{v})"
    assert all(s != (n, v) for s, _ in rec.outputs)
    assert hidden.grad.shape == (n, h) and weight.grad.shape == (v, h)


def test_chunk_rows_by_memory():
    # 512 MiB of float32 logits per chunk on a GPU, 32 MiB on a CPU (the tiny model's former 1024 rows)
    assert chunk_rows(151_936, "cuda") == (512 << 20) // (4 * 151_936) == 883
    assert chunk_rows(32_000, torch.device("cuda", 0)) == 4194 and chunk_rows(32_000, "meta") == 4194
    assert chunk_rows(8192, "cpu") == 1024 and chunk_rows(1024, "cpu") == 8192
    assert chunk_rows(10**12, "cpu") == 1 and chunk_rows(100, "cpu", chunk_bytes=4000) == 10


def test_auto_chunks_and_one_logits_recompute(monkeypatch):
    """chunk_size=0 takes chunk_rows' rows; forward + backward compute each chunk's logits twice (forward,
    the one recompute in backward) plus one matmul each for grad hidden and grad weight; a frozen head none
    in backward."""
    n, v, h = 20, 50, 4
    monkeypatch.setattr(logprobs, "CHUNK_BYTES_CPU", 8 * v * 4)  # 8 rows per chunk: 8 + 8 + 4
    hidden, weight, b, targets = _inputs(n, v, h, torch.float64)
    for t in (hidden, weight, b):
        t.requires_grad_()
    with _ShapeRecorder() as rec:
        out = chunked_token_logps(hidden, weight, targets, bias=b)
        forward_ops = len(rec.ops)
        out.sum().backward()
    mm = ("mm", "addmm", "addmm_")
    logits = [(i < forward_ops, s) for i, (op, s) in enumerate(rec.ops) if op in mm and s[-1] == v]
    assert logits == [(True, (8, v)), (True, (8, v)), (True, (4, v)), (False, (8, v)), (False, (8, v)), (False, (4, v))]
    grads = [s for op, s in rec.ops[forward_ops:] if op in mm and s[-1] == h]
    assert sorted(grads) == sorted([(8, h), (8, h), (4, h)] + [(v, h)] * 3)  # dL/dh per chunk, dL/dW accumulated
    torch.testing.assert_close(out, _naive(hidden, weight, targets, b), rtol=0, atol=1e-10)

    # a frozen head (LoRA): per chunk one logits GEMM and one for the gradient basis, all in the forward
    hidden = hidden.detach().requires_grad_()
    weight, b = weight.detach(), b.detach()
    with _ShapeRecorder() as rec:
        out = chunked_token_logps(hidden, weight, targets, bias=b)
        forward_ops = len(rec.ops)
        out.sum().backward()
    gemms = [(i < forward_ops, s) for i, (op, s) in enumerate(rec.ops) if op in mm]
    assert gemms == [(True, (8, v)), (True, (8, h)), (True, (8, v)), (True, (8, h)), (True, (4, v)), (True, (4, h))]
    with torch.no_grad(), _ShapeRecorder() as rec:  # a reference forward: the logits GEMMs only
        chunked_token_logps(hidden, weight, targets, bias=b)
    assert [s for op, s in rec.ops if op in mm] == [(8, v), (8, v), (4, v)]


def test_shape_recorder_catches_the_naive_path():
    # sanity of the instrument: the naive path does create the (N, V) logits
    hidden, weight, _, targets = _inputs(32, 64, 4, torch.float32, bias=False)
    hidden.requires_grad_()
    with _ShapeRecorder() as rec:
        _naive(hidden, weight, targets).sum().backward()
    assert (32, 64) in [s for s, _ in rec.outputs]


def test_chunked_rejects_bad_arguments():
    hidden, weight, _, targets = _inputs(4, 6, 3, torch.float32, bias=False)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logps(hidden, weight, targets, chunk_size=-1)
    with pytest.raises(ValueError, match="targets shape"):
        chunked_token_logps(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="does not match weight"):
        chunked_token_logps(hidden, weight[:, :2], targets)


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_hand_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("-inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # row sums: 1+2 = 3, 4+6 = 10 (the -inf under the mask must not leak)
    torch.testing.assert_close(masked_sum(values, mask, dim=1), torch.tensor([3.0, 10.0]))
    assert masked_sum(values, mask.bool()).item() == 13.0
    # means: 3/2 = 1.5, 10/2 = 5; global 13/4 = 3.25
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 5.0]))
    assert masked_mean(values, mask).item() == 3.25


def test_masked_mean_all_masked_is_zero_and_grad_finite():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, False]])
    out = masked_mean(values, mask, dim=1)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0]))
    out.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_ops_and_losses_stay_device_agnostic():
    # ARCHITECTURE principle 3: no distributed imports or device-specific backends in the pure math
    root = Path(__file__).resolve().parents[3] / "src" / "alignkit"
    banned = ("torch.distributed", "cu" + "da", "nc" + "cl")
    for sub in ("ops", "losses"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text().lower()
            hits = [b for b in banned if b in text]
            assert not hits, f"{path} mentions {hits}"


def test_chunked_under_autocast_matches_linear_then_log_softmax():
    hidden, weight, _, targets = _inputs(9, 12, 8, torch.float32, bias=False)
    hidden.requires_grad_()
    weight.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_token_logps(hidden, weight, targets, chunk_size=4)
        ref = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), -1)
        ref = ref.gather(-1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    out.sum().backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.shape == hidden.shape


def test_chunked_rejects_mixed_dtypes():
    hidden, weight, _, targets = _inputs(4, 6, 3, torch.float32, bias=False)
    with pytest.raises(ValueError, match="share one dtype"):
        chunked_token_logps(hidden.double(), weight, targets)
