"""The shape constants every part of the package shares (one source; no imports).

``HEAD_DIM`` is the head dimension the operators offer (SPEC 2: ``[tokens, heads, 128]``). The
JIT passes it to the templates as the configuration parameter ``head_dim``
(``flashinfer_h3.jit.KernelConfig``); the CUDA headers state the shape they are written for and
the bindings ``static_assert`` that it matches.
"""

HEAD_DIM = 128
#: Head dims a kernel configuration may be rendered for (only ``HEAD_DIM`` is built and offered).
RENDERABLE_HEAD_DIMS = (64, 128)
