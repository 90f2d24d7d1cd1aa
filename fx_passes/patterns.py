"""Pattern fusion: named rewrite passes that turn core-ATen patterns into single ctpu ops.

Before: a normalised graph (normalize.py). After: every occurrence of a pattern (see pattern_*.py for
the forms) is one call of its ctpu op, computing the same values to rounding; the nodes it replaced
are gone, and every node's meta["val"] is up to date.

The passes run in this order, each visiting consumers before producers, because earlier patterns
contain pieces of later ones: attention holds a softmax and two bmm's, SwiGLU holds the SiLU that a
linear epilogue would otherwise take, and every linear feeds on what the others leave.
"""

from __future__ import annotations

from .pattern_attention import attention_rule, sdpa_rule
from .pattern_mlp import linear_rule, rope_rule, swiglu_rule
from .pattern_norm import layer_norm_rule, rms_norm_rule, softmax_rule
from .rewrite import RewritePass

PATTERN_PASSES: tuple[RewritePass, ...] = (
    RewritePass("attention", (attention_rule, sdpa_rule), reverse=True),
    RewritePass("norms", (rms_norm_rule, layer_norm_rule), reverse=True),
    RewritePass("softmax", (softmax_rule,), reverse=True),
    RewritePass("rope", (rope_rule,), reverse=True),
    RewritePass("swiglu", (swiglu_rule,), reverse=True),
    RewritePass("linear", (linear_rule,), reverse=True),
)
