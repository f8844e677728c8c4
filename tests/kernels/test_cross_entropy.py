"""Triton cross-entropy and fused linear + cross-entropy against `meshtrain.kernels.reference`.

Shapes are tiny (the interpreter runs one program per token row) but odd: 123 tokens, a
vocabulary of 77 real rows padded to 80, and `MAX_BLOCK` lowered so a row spans several
vocabulary blocks and the online max/sum is exercised.
"""

import importlib

import pytest
import torch

from meshtrain.kernels import reference
from tests.kernels.conftest import DEVICE, TOL, needs_triton

pytestmark = needs_triton


@pytest.fixture
def small_blocks(monkeypatch):
    ce = importlib.import_module(
        "meshtrain.kernels.cross_entropy"
    )  # `meshtrain.kernels.cross_entropy` is the op
    monkeypatch.setattr(ce, "MAX_BLOCK", 32)  # 77 columns -> three blocks per row


def _labels(n, vocab, ignored=True):
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    if ignored:
        labels[
            3
        ] = -100  # F.cross_entropy's default ignore_index: zero loss, still in the mean's count
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cross_entropy(dtype, masked, small_blocks):
    """Loss and dlogits. fp32: reductions in another order -> 1e-5. bf16 logits: both sides
    upcast the same bf16 values to fp32, so the loss agrees to fp32 rounding (1e-5) and only
    the bf16 dlogits carry bf16 rounding (2e-2)."""
    from meshtrain.kernels.cross_entropy import cross_entropy

    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 41, 77, device=DEVICE)).to(dtype).requires_grad_()
    labels = _labels(3 * 41, 77).view(3, 41)
    mask = (torch.rand(3, 41, device=DEVICE) > 0.3).float() if masked else None
    loss = cross_entropy(logits, labels, mask)
    (grad,) = torch.autograd.grad(loss * 2.0, logits)  # a non-unit incoming gradient
    ref = reference.cross_entropy(logits.detach().double(), labels, mask)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    logits64 = logits.detach().double().requires_grad_()
    (grad64,) = torch.autograd.grad(reference.cross_entropy(logits64, labels, mask) * 2.0, logits64)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), grad64, **TOL[dtype])


def test_cross_entropy_on_the_real_columns_of_padded_logits(small_blocks):
    """What the reference projection hands the Triton cross-entropy (train.compiled_triton_ops
    = ["cross_entropy"]): logits over the padded vocabulary with the padding's columns cut
    off, so each row starts 80 elements after the last but holds 77. Loss and gradient as on
    a contiguous copy; the padding's columns get no gradient."""
    from meshtrain.kernels.cross_entropy import cross_entropy

    torch.manual_seed(0)
    padded = (3 * torch.randn(2, 41, 80, device=DEVICE)).requires_grad_()
    padded.data[..., 77:] = 50.0  # would dominate the softmax if they were read
    labels = _labels(2 * 41, 77).view(2, 41)
    loss = cross_entropy(padded[..., :77], labels)
    (grad,) = torch.autograd.grad(loss, padded)
    dense = padded.detach()[..., :77].contiguous().double().requires_grad_()
    ref = reference.cross_entropy(dense, labels)
    (grad_ref,) = torch.autograd.grad(ref, dense)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[..., :77].double(), grad_ref, rtol=1e-5, atol=1e-6)
    assert torch.all(grad[..., 77:] == 0)


def _linear_case(dtype, masked):
    torch.manual_seed(0)
    hidden = torch.randn(3, 41, 24, device=DEVICE).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(80, 24, device=DEVICE)).to(dtype)
    weight[77:] = 50.0  # padding rows with huge logits must not leak into the softmax
    weight.requires_grad_()
    labels = _labels(3 * 41, 77).view(3, 41)
    mask = (torch.rand(3, 41, device=DEVICE) > 0.3).float() if masked else None
    return hidden, weight, labels, mask


@pytest.mark.parametrize("masked", [False, True])
def test_linear_cross_entropy_fp32(masked, small_blocks):
    """fp32 end to end, 50 tokens a chunk (three chunks, the last short): loss, dhidden and
    dweight to 1e-5 of the fp64 reference; padded weight rows get exactly zero gradient."""
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    hidden, weight, labels, mask = _linear_case(torch.float32, masked)
    loss = linear_cross_entropy(hidden, weight, labels, mask, 77, chunk_size=50)
    dh, dw = torch.autograd.grad(loss * 0.5, (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference.linear_cross_entropy(h64, w64, labels, mask, 77)
    dh64, dw64 = torch.autograd.grad(ref * 0.5, (h64, w64))
    torch.testing.assert_close(loss.double(), ref, **TOL[torch.float32])
    torch.testing.assert_close(dh.double(), dh64, **TOL[torch.float32])
    torch.testing.assert_close(dw.double(), dw64, **TOL[torch.float32])
    assert torch.all(dw[77:] == 0)


def test_linear_cross_entropy_bf16(small_blocks):
    """bf16 hidden and weight: the logits are rounded to bf16 after the matmul exactly as in the
    reference, so the loss agrees to ~1e-3 (fp32 math on the same bf16 logits, but chunked
    matmuls may round differently); the gradients go through bf16 matmuls -> 2e-2 relative,
    with dweight's absolute tolerance a little wider since it sums 123 bf16 products."""
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    hidden, weight, labels, mask = _linear_case(torch.bfloat16, True)
    loss = linear_cross_entropy(hidden, weight, labels, mask, 77, chunk_size=64)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference.linear_cross_entropy(h64, w64, labels, mask, 77)
    dh64, dw64 = torch.autograd.grad(ref, (h64, w64))
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh.double(), dh64, **TOL[torch.bfloat16])
    torch.testing.assert_close(dw.double(), dw64, rtol=2e-2, atol=3e-2)


def test_linear_cross_entropy_without_grad_matches_loss():
    """The loss-only path (no autograd, no gradient buffers) gives the same loss."""
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    hidden, weight, labels, mask = _linear_case(torch.float32, True)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, mask, 77, chunk_size=64)
    ref = reference.linear_cross_entropy(
        hidden.detach().double(), weight.detach().double(), labels, mask, 77
    )
    torch.testing.assert_close(loss.double(), ref, **TOL[torch.float32])


def _call_with_a_bad_label(which: str, bad: int) -> None:
    """One loss call with `bad` as one of its labels: the fused linear + loss with and without
    autograd, or the plain loss (`which`: "linear", "linear-no-grad", "plain")."""
    from meshtrain.kernels.cross_entropy import cross_entropy
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    hidden, weight, labels, _ = _linear_case(torch.float32, False)
    labels[1, 5] = bad
    if which == "linear":
        linear_cross_entropy(hidden, weight, labels, None, 77)
    elif which == "linear-no-grad":
        with torch.no_grad():
            linear_cross_entropy(hidden, weight, labels, None, 77)
    else:
        cross_entropy(torch.randn(3, 41, 77, device=DEVICE), labels)


@pytest.mark.parametrize("which", ["linear", "linear-no-grad", "plain"])
@pytest.mark.parametrize(
    "bad", [77, 79, -1], ids=["first-padding-row", "last-padding-row", "negative"]
)
def test_a_label_outside_the_vocabulary_is_an_error(bad, which):
    """As in the reference (F.cross_entropy) and the vocab-parallel loss: a label in the padded
    rows (77..79 here) or a negative one other than -100 is refused, not read as a zero logit
    (which gave loss = logsumexp and a gradient without its -1).

    On the CPU the check raises its message. On a GPU it is a device-side assert, as
    F.cross_entropy's is: the device prints the message, the next CUDA call fails, and the
    process's CUDA context is left unusable. So there the call runs in a child process of its
    own, which must die of the assert, and this process's context stays clean for the tests
    after it.
    """
    import subprocess
    import sys
    from pathlib import Path

    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            _call_with_a_bad_label(which, bad)
        return
    code = (
        "import sys, torch\n"
        "from tests.kernels.test_cross_entropy import _call_with_a_bad_label\n"
        "_call_with_a_bad_label(sys.argv[1], int(sys.argv[2]))\n"
        "torch.cuda.synchronize()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, which, str(bad)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # the device prints the failed assertion with its message; the host's error comes from
    # whichever CUDA call next meets the dead context (a sync, or cuBLAS's handle creation)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Assertion `a label is outside the vocabulary" in out.stderr, out.stderr[-2000:]


def test_vocab_shards_combine_to_the_full_softmax():
    """The vocab-parallel recipe of the module docstring, with two shards simulated in one
    process (a max and two sums stand in for the all-reduces): per-shard stats combine to the
    full loss, and per-shard softmax_grad_ equals the matching slice of the full gradient."""
    from meshtrain.kernels.cross_entropy import logit_stats, softmax_grad_

    torch.manual_seed(0)
    logits = 3 * torch.randn(9, 77, device=DEVICE)
    labels = _labels(9, 77)
    scale = torch.full((9,), 1 / 9, device=DEVICE)
    bounds = [(0, 40), (40, 77)]  # uneven shards
    stats = [logit_stats(logits[:, a:b], labels, a) for a, b in bounds]
    m = torch.stack([s[0] for s in stats]).amax(0)
    total = sum(s[1] * torch.exp(s[0] - m) for s in stats)
    target = sum(s[2] for s in stats)
    lse = m + torch.log(total)
    loss_rows = torch.where(labels == -100, 0.0, lse - target)
    ref = reference.cross_entropy(logits.double(), labels)
    torch.testing.assert_close((loss_rows * scale).sum().double(), ref, **TOL[torch.float32])
    full = logits.double().requires_grad_()
    (grad64,) = torch.autograd.grad(reference.cross_entropy(full, labels), full)
    for a, b in bounds:
        shard = logits[:, a:b].contiguous()
        torch.testing.assert_close(
            softmax_grad_(shard, labels, lse, scale, a).double(),
            grad64[:, a:b],
            **TOL[torch.float32],
        )


def test_tracing_leaves_the_fp32_accumulation_flag_alone(monkeypatch):
    """While torch.compile traces the fused op (fake tensors), the weight-gradient accumulation
    takes the two-pass form without trying `out_dtype` (torch 2.11's fake addmm fails on it),
    so a trace never turns the fast path off for eager calls."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    lce = importlib.import_module(
        "meshtrain.kernels.linear_cross_entropy"
    )  # the package's attribute is the op
    monkeypatch.setattr(lce, "_MM_FP32_OUT", None)
    with FakeTensorMode():
        acc = torch.empty(8, 4, device="cuda", dtype=torch.float32)
        a = torch.empty(8, 6, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(6, 4, device="cuda", dtype=torch.bfloat16)
        # the accumulating call (a fake bf16 -> fp32 copy_, the first chunk's fallback, needs
        # a CUDA build to trace)
        lce._accumulate(acc, a, b, first=False)
    assert lce._MM_FP32_OUT is None


def test_linear_cross_entropy_of_no_tokens_gives_a_zero_weight_gradient():
    """No tokens (a masked-out, empty micro-batch): no chunk writes the fp32 weight-gradient
    buffer, which came back as uninitialized memory; the reference's gradient is 0."""
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    h = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(13, 8, device=DEVICE, requires_grad=True)
    labels, mask = torch.zeros(0, dtype=torch.long, device=DEVICE), torch.ones(0, device=DEVICE)
    for _ in range(3):
        # freed blocks of the buffer's size, full of NaN, for the allocator to hand out again
        junk = [torch.full((13, 8), float("nan"), device=DEVICE) for _ in range(8)]
        del junk
        loss = linear_cross_entropy(h, w, labels, mask, 11, chunk_size=4)
        dh, dw = torch.autograd.grad(loss, (h, w))
        assert loss.item() == 0.0 and dh.shape == (0, 8)
        torch.testing.assert_close(dw, torch.zeros_like(w))


def test_linear_cross_entropy_refuses_a_vocab_size_past_the_weight_rows():
    """vocab_size 13 on an 11-row weight: a label 12 has no logit, and the loss came out as a
    silently wrong number (logsumexp alone); now an error naming both sizes."""
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    h, w = torch.randn(5, 8, device=DEVICE), torch.randn(11, 8, device=DEVICE)
    labels = torch.tensor([0, 1, 2, 3, 12], device=DEVICE)
    with pytest.raises(ValueError, match=r"vocab_size 13 outside 1\.\.11"):
        linear_cross_entropy(h, w, labels, None, 13)


@pytest.mark.parametrize("which", ["cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("bad", ["labels", "loss_mask"])
def test_labels_or_mask_of_another_row_count_is_an_error(which, bad):
    """6 labels (or mask values) for 5 token rows: the fused loss used to average the first 5
    losses over 6 (a silently wrong loss) and cross_entropy read the labels by index before any
    check; the reference refuses it. Now a ValueError naming the shapes, before any launch."""
    from meshtrain.kernels.cross_entropy import cross_entropy
    from meshtrain.kernels.linear_cross_entropy import linear_cross_entropy

    h, w = torch.randn(5, 8, device=DEVICE), torch.randn(11, 8, device=DEVICE)
    labels = torch.randint(0, 11, (6 if bad == "labels" else 5,), device=DEVICE)
    mask = torch.ones(6, device=DEVICE) if bad == "loss_mask" else None
    with pytest.raises(ValueError, match=rf"{bad} of shape \(6,\) \(6 values\) for the 5 rows"):
        if which == "cross_entropy":
            cross_entropy(h @ w.t(), labels, mask)
        else:
            linear_cross_entropy(h, w, labels, mask)
