"""`swap_attention`: put effattn under an existing model, in place, weights kept."""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from ..integrations import huggingface
from .attention import MultiheadAttention
from .variants import VARIANT_KEYS, check_variant


def _describe(m: nn.Module) -> str:
    kind = "effattn.nn.MultiheadAttention" if isinstance(m, MultiheadAttention) else "torch.nn.MultiheadAttention"
    parts = [str(m.embed_dim), str(m.num_heads)]
    if not m._qkv_same_embed_dim:
        parts.append(f"kdim={m.kdim}, vdim={m.vdim}")
    if m.batch_first:
        parts.append("batch_first=True")
    if isinstance(m, MultiheadAttention):
        for key, val in m.variant().items():
            parts.append(f"{key}={val!r}" if isinstance(val, (str, int, tuple)) else f"{key}={type(val).__name__}")
    return f"{kind}({', '.join(parts)})"


def swap_attention(model: nn.Module, *, select: Optional[Callable[[str, nn.Module], bool]] = None,
                   verbose: bool = False, return_changes: bool = False, **variant):
    """Replaces every ``torch.nn.MultiheadAttention`` inside ``model`` by an
    :class:`effattn.nn.MultiheadAttention` with the same configuration, weights, device, dtype and
    train/eval mode, and the given variant. The weights are not copied: the new modules hold the old
    ones' ``Parameter`` objects, so an optimizer built before the swap, frozen weights and tied weights
    are unaffected. Hooks registered on the old modules are not carried over.

    Args:
        model: any ``nn.Module``; modified in place. Its attention modules are found with
            ``named_modules``: inside ``torch.nn.TransformerEncoderLayer`` / ``DecoderLayer``,
            ``torch.nn.Transformer``, or any custom module. A module shared by several parents stays
            shared. effattn modules already there are rebuilt with the new variant (so a second call
            changes the variant); subclasses of torch's class are left alone, with a warning, since
            their ``forward`` may differ.
        select: optional ``(qualified_name, module) -> bool``; only modules it accepts are swapped,
            e.g. ``select=lambda name, m: name.endswith("self_attn")`` to leave cross-attention as is.
        verbose: print one line ``name: old -> new`` per swapped module.
        return_changes: return ``(model, changes)`` instead of ``model``.
        **variant: ``window``, ``layout``, ``linear``, ``backend``, ``context_parallel`` (see
            :class:`effattn.nn.MultiheadAttention`). None given: plain softmax attention, and the
            model's outputs are unchanged up to rounding.

    Returns:
        ``model`` itself (modified in place), so ``model = effattn.swap_attention(model)`` works; with
        ``return_changes=True`` the pair ``(model, changes)``, where ``changes`` lists
        ``(qualified_name, "old -> new")``, one per swapped module (what ``verbose`` prints). When no
        module is swapped a warning says so (e.g. a Hugging Face model, whose attention is not
        ``torch.nn.MultiheadAttention``: use :func:`effattn.integrations.huggingface.register`).

    Raises:
        TypeError: an unknown variant key.
        ValueError: an impossible variant (negative window, ``linear`` with ``window``, ``linear`` on a
            module with ``add_bias_kv``, ...). Nothing is swapped then: all replacements are built
            before any is installed.

    Hugging Face T5-style models (T5, mT5, UMT5, Pix2Struct, ...: attention modules with a
    ``relative_attention_bias`` and ``compute_bias``) loaded with ``attn_implementation="effattn"``
    get their relative position bias upgraded to a fused term (O(L) memory instead of a dense
    ``(1, H, Lq, Lk)`` tensor): see :func:`effattn.integrations.huggingface.upgrade_t5_bias`; with
    another attention implementation those modules are left as they are, with a warning.

    torch's own fused inference paths stay correct: ``TransformerEncoderLayer``'s fast path (which
    would read the weights and bypass the attention module) is disabled by the effattn module, and
    ``TransformerEncoder``'s nested-tensor path hands the effattn module a nested tensor, which it
    serves.

    Examples::

        >>> model = nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, batch_first=True), 6)
        >>> model = effattn.swap_attention(model, window=128, verbose=True)
        layers.0.self_attn: torch.nn.MultiheadAttention(512, 8, batch_first=True) -> effattn.nn.MultiheadAttention(512, 8, batch_first=True, window=128)
        ...
    """
    unknown = sorted(set(variant) - set(VARIANT_KEYS))
    if unknown:
        raise TypeError(f"swap_attention: unknown variant keys {unknown}; expected some of {', '.join(VARIANT_KEYS)}")
    check_variant("swap_attention", **variant)
    if isinstance(model, nn.MultiheadAttention) or isinstance(model, MultiheadAttention):
        raise ValueError("swap_attention replaces the attention modules inside a model; for a bare attention module "
                         "use effattn.nn.MultiheadAttention.from_torch(module, **variant)")

    # every (parent, attribute) that points at an attention module, shared modules included
    new_for: Dict[int, nn.Module] = {}
    slots: List[Tuple[nn.Module, str, nn.Module, str]] = []
    report: List[Tuple[str, str]] = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            is_torch = type(child) is nn.MultiheadAttention
            is_ours = isinstance(child, MultiheadAttention)
            if not (is_torch or is_ours):
                if isinstance(child, nn.MultiheadAttention):
                    warnings.warn(f"swap_attention: {name} is a {type(child).__name__}, a subclass of "
                                  "torch.nn.MultiheadAttention; left unchanged", stacklevel=2)
                continue
            if select is not None and not select(name, child):
                continue
            if id(child) not in new_for:
                try:
                    new_for[id(child)] = MultiheadAttention.from_torch(child, share_parameters=True, **variant)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"swap_attention: cannot swap {name}: {e}") from None
                report.append((name, f"{_describe(child)} -> {_describe(new_for[id(child)])}"))
            slots.append((parent, child_name, child, name))
    for parent, child_name, child, _ in slots:
        setattr(parent, child_name, new_for[id(child)])
    t5 = huggingface.upgrade_t5_bias(model, select=select)
    report += [(name, "T5 relative bias (dense tensor) -> effattn.bias.Relative (fused term)") for name in t5["served"]]
    for name, why in t5["not served"].items():
        warnings.warn(f"swap_attention: {name}: T5 relative bias left dense: {why}", stacklevel=2)
    if not report and not t5["not served"]:
        warnings.warn("swap_attention: found no torch.nn.MultiheadAttention to swap in this model" +
                      (" that select accepts" if select is not None else "") + ". Models that compute attention "
                      "in their own modules (Hugging Face transformers, ...) are not changed by swap_attention; "
                      "for transformers use effattn.integrations.huggingface.register() and "
                      "attn_implementation='effattn'", stacklevel=2)
    if verbose:
        for name, change in report:
            print(f"{name}: {change}")
    return (model, report) if return_changes else model
