"""The LRA `adaptive-span` variant: a bidirectional effattn.nn.AdaptiveSpan per layer whose penalty
joins the training loss, trained a few steps on a tiny ListOps."""
import torch

from benchmarks.lra.train import Trainer
from benchmarks.lra.variants import span_loss
from benchmarks.tests.test_lra_train import cache, one_thread, small_cfg, tiny  # noqa: F401 (fixtures)
from effattn.nn import AdaptiveSpan


def test_adaptive_span_variant_trains_a_few_steps(tmp_path, cache, tiny):  # noqa: F811
    tr = Trainer(small_cfg(tmp_path, cache, variant="adaptive-span", steps=6, eval_every=1000), quiet=True)
    spans = [m for m in tr.model.modules() if isinstance(m, AdaptiveSpan)]
    assert len(spans) == tr.model.encoder.cfg.layers and all(m.bidirectional for m in spans)
    before = [m.ratio.detach().clone() for m in spans]
    assert float(span_loss(tr.model).detach()) > 0
    tr.run()
    losses = tr.state["losses"]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    after = [m.ratio.detach() for m in spans]
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the spans never moved"
    assert all(((a >= 0) & (a <= 1)).all() for a in after)            # clamped after each step


def test_span_loss_is_zero_without_spans():
    assert span_loss(torch.nn.Linear(2, 2)) == 0.0
