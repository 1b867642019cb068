"""Check the chunked loss end to end on CPU in seconds: path selection for the 4B model, correctness against
float64 on small tensors, and the fwd+bwd peak memory at full 4B shapes measured under FakeTensorMode.

    python verify_chunked_loss.py        # one PASS/FAIL line per check; exit code 1 on any failure

Notation: B batch, T sequence length, N = B*T tokens, C model width, V vocabulary size.
Sizes are binary GiB (2^30 bytes). Nothing large is allocated: the 4B model and every full-size tensor are fake.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model import ComputeConfig, ModelConfig, Transformer
from modeling.config import GiB
from modeling.loss import IGNORE_INDEX, chunked_linear_cross_entropy, standard_linear_cross_entropy
from modeling.memtrack import LiveBytesTracker
from training.cli import Parser

SEQ_LENS = (4096, 40_000, 131_072)


def fake_loss_peak(loss_fn: Callable, N: int, C: int, V: int, dtype: torch.dtype = torch.bfloat16, **kwargs) -> int:
    """Peak bytes, beyond the inputs, of `loss_fn(hidden (N, C), weight (V, C), targets (N,), **kwargs)` forward
    plus backward, under FakeTensorMode (shapes only; nothing is allocated). `loss_fn` may return (loss, logits):
    the logits are dropped at once, so only what the loss itself keeps counts."""
    with FakeTensorMode():
        hidden = torch.empty(N, C, dtype=dtype, requires_grad=True)
        weight = torch.empty(V, C, dtype=dtype, requires_grad=True)
        targets = torch.zeros(N, dtype=torch.long)
        with LiveBytesTracker() as tracker:
            loss = loss_fn(hidden, weight, targets, **kwargs)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
    return tracker.peak


class Report:
    def __init__(self) -> None:
        self.failures = 0

    def check(self, ok: bool, what: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
        self.failures += not ok


def check_path_selection(report: Report) -> None:
    """For the 4B geometry, the path `Transformer.compute_loss` takes at each sequence length (B=1, bf16)."""
    config, compute = ModelConfig.from_preset("4B"), ComputeConfig()
    print(f"\n4B: V={config.vocab_size}, C={config.dim}, threshold {compute.loss_chunk_threshold_bytes / GiB:g} GiB "
          f"of logits in the compute dtype (bf16), loss_mode={compute.loss_mode!r}")
    fake_mode = FakeTensorMode()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: Module.to cannot swap fake parameters afterwards
    try:
        with fake_mode:
            model = Transformer(config, compute)  # 4B parameters, all fake
    finally:
        torch.set_default_dtype(default_dtype)
    with fake_mode:
        for T in SEQ_LENS:
            logits_gib = T * config.vocab_size * 2 / GiB
            expect_chunked = logits_gib * GiB > compute.loss_chunk_threshold_bytes
            hidden = torch.empty(1, T, config.dim, dtype=torch.bfloat16, requires_grad=True)  # (B, T, C)
            labels = torch.zeros(1, T, dtype=torch.long)  # (B, T)
            with (mock.patch.object(Transformer, "_compute_loss_chunked", autospec=True,
                                    side_effect=Transformer._compute_loss_chunked) as chunked,
                  mock.patch.object(Transformer, "_compute_loss_standard", autospec=True,
                                    side_effect=Transformer._compute_loss_standard) as standard,
                  LiveBytesTracker() as tracker):
                loss, logits = model.compute_loss(hidden, labels)
                loss.backward()
            took = "chunked" if chunked.called else "standard"
            ok = (chunked.called, standard.called) == (expect_chunked, not expect_chunked)
            ok = ok and (logits is None) == expect_chunked
            report.check(ok, f"T={T:>7,}: logits {logits_gib:6.2f} GiB bf16 -> should chunk: "
                             f"{'yes' if expect_chunked else 'no ':3}; compute_loss took the {took} path "
                             f"(fwd+bwd peak {tracker.peak / GiB:6.2f} GiB beyond inputs)")


def float64_reference(hidden, weight, targets, z_loss_coef=0.0, softcap=None, normalizer=None):
    """Sum over non-ignored rows of cross-entropy (+ z-loss) computed naively in float64, divided by `normalizer`
    (default: the number of non-ignored rows, at least 1). Independent of loss.py."""
    logits = hidden.double() @ weight.double().t()  # (N, V)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = targets != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    rows = lse - logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1) + z_loss_coef * lse**2  # (N,)
    return (rows * valid).sum() / (valid.sum().clamp(min=1) if normalizer is None else normalizer)


def check_small_correctness(report: Report) -> None:
    print("\nsmall tensors (N=203, C=48, V=1000, 25% ignored), chunk 64 (does not divide N); vs float64 reference")
    g = torch.Generator().manual_seed(0)
    N, C, V = 203, 48, 1000
    hidden32 = torch.randn(N, C, generator=g)
    weight32 = torch.randn(V, C, generator=g) / C**0.5
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < 0.25] = IGNORE_INDEX
    cases = [(torch.float32, 0.0, None, 1e-5), (torch.float32, 1e-3, 30.0, 1e-5), (torch.bfloat16, 0.0, None, 2e-2),
             (torch.bfloat16, 1e-3, 30.0, 2e-2)]
    for dtype, z_loss_coef, softcap, tol in cases:
        errors = {}
        ref_inputs = [t.to(dtype).double().detach().requires_grad_() for t in (hidden32, weight32)]
        ref = float64_reference(*ref_inputs, targets, z_loss_coef, softcap)
        ref_grads = torch.autograd.grad(ref, ref_inputs)
        for name, fn in (("standard", lambda *a, **k: standard_linear_cross_entropy(*a, **k)[0]),
                         ("chunked", lambda *a, **k: chunked_linear_cross_entropy(*a, chunk_size=64, **k))):
            inputs = [t.to(dtype).detach().requires_grad_() for t in (hidden32, weight32)]
            loss = fn(*inputs, targets, z_loss_coef=z_loss_coef, softcap=softcap)
            grads = torch.autograd.grad(loss, inputs)
            errors[name] = [abs(loss.item() - ref.item()) / abs(ref.item())] + [
                ((a.double() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads, strict=True)]
        err = errors["chunked"]
        report.check(max(err) < tol, f"{str(dtype)[6:]:8} z_loss={z_loss_coef:g} softcap={softcap}: relative error "
                                     f"loss {err[0]:.1e}, d_hidden {err[1]:.1e}, d_weight {err[2]:.1e} (< {tol:g}; "
                                     f"standard path: {max(errors['standard']):.1e})")

    hidden = hidden32.clone().requires_grad_()
    weight = weight32.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full((N,), IGNORE_INDEX), chunk_size=64)
    loss.backward()
    zero = loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any() and loss.requires_grad
    report.check(zero, "all labels ignored: loss 0 connected to the graph, zero (not NaN) gradients")


def check_full_size_peak(report: Report) -> None:
    N, C, V = 131_072, 2560, 151_936
    print(f"\nfwd+bwd peak at 4B shapes, N={N:,}, C={C}, V={V:,}, bf16 (FakeTensorMode + LiveBytesTracker, "
          f"bytes beyond hidden and weight)")
    standard = fake_loss_peak(standard_linear_cross_entropy, N, C, V)
    chunked = fake_loss_peak(chunked_linear_cross_entropy, N, C, V, chunk_size=4096)
    report.check(standard > 100 * GiB, f"standard: {standard / GiB:7.2f} GiB (> 100 GiB expected)")
    report.check(chunked < 8 * GiB, f"chunked : {chunked / GiB:7.2f} GiB (< 8 GiB expected; {standard / chunked:.0f}x "
                                    f"lower)")


def main(argv: list[str] | None = None) -> int:
    Parser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options: refuse any
    torch.manual_seed(0)
    report = Report()
    check_path_selection(report)
    check_small_correctness(report)
    check_full_size_peak(report)
    print(f"\n{'ALL PASS' if not report.failures else f'{report.failures} FAILED'}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
